"""Interrupted training: a run killed (SIGKILL) after a checkpoint resumes from that checkpoint exactly, and SIGINT or
SIGTERM make a run save a checkpoint before it exits.

"Exactly" is checked from the outside, on the real entry point and the tiny model: a test-only reward plugin logs
which prompts (`id`) every step scored, and the resumed run must score the same prompts at the same steps as an
uninterrupted run and end with bit-identical weights. That holds only if the step counter, the optimizer and
scheduler state, the data order and the random state all continue; restarting any one of them changes the weights.
The resumed run goes through the test guard (tests/guard): resuming reads optimizer, scheduler and RNG state without
unpickling anything (torch's weights-only loader) and without touching the network. (The guard needs a fresh
interpreter; the runs that only write checkpoints run without it, forked from the preloaded libraries.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FAMILY_MODELS, REPO, run_script
from safetensors.torch import load_file
from trl import GRPOConfig, ModelConfig
from trl.trainer.utils import RepeatSampler

from vision_grpo.data import get_dataset
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.plugins.rewards import get_recipe_rewards
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.run.checksums import CHECKSUMS, write_checksums
from vision_grpo.run.locks_and_digests import hold_lock
from vision_grpo.run.manifest import code_identity, dataset_identity, write_run_start
from vision_grpo.run.recipe_run import RecipeRun
from vision_grpo.run.resume import TRAINER_STATE, RunConflict, resume_checkpoint
from vision_grpo.training.trainer import EpochSeededSampler, VisionGRPOTrainer

GUARD = REPO / "tests" / "guard"
PROBE_TEMPLATE = '''
import json
import os
import signal
import zlib

from vision_grpo.rewards import completion_texts, reward


@reward()
def NAME(completions, trainer_state, **kwargs):
    """Test only: log (completed steps, prompt ids, process); SIGKILL this process at a given step; REWARDS."""
    with open(os.environ["PROBE_LOG"], "a", encoding="utf-8") as log:
        record = {"step": trainer_state.global_step, "ids": list(kwargs["id"]), "pid": os.getpid()}
        record["rank"] = int(os.environ.get("RANK", 0))
        log.write(json.dumps(record) + "\\n")
    if trainer_state.global_step == int(os.environ.get("PROBE_KILL_AT_STEP", -1)):
        os.kill(os.getpid(), signal.SIGKILL)
    texts, ids = completion_texts(completions), kwargs["id"]
    return EXPRESSION
'''


def probe_plugin(name: str, expression: str, rewards: str) -> str:
    """The source of a reward plugin `name` that logs every call as (step, ids, process) to PROBE_LOG, kills its
    process at step PROBE_KILL_AT_STEP, and returns `expression` (over `texts` and `ids`), which gives `rewards`."""
    return PROBE_TEMPLATE.replace("NAME", name).replace("EXPRESSION", expression).replace("REWARDS", rewards)


PROBE_PLUGIN = probe_plugin("resume_probe", "[len(set(text)) / 10 for text in texts]", "reward variety")
# 4 prompts, 2 per step: an epoch is 2 steps, so 5 steps cross two epoch boundaries.
TINY = {
    "--shapes_train_size": "4",
    "--per_device_train_batch_size": "8",
    "--num_generations": "4",
    "--max_completion_length": "8",
    "--token_check_samples": "1",
    "--reward_funcs": "resume_probe",
    "--reward_weights": "1.0",
    "--report_to": "none",
}


def training_args(tmp_path: Path, run_name: str, **overrides: str) -> list[str]:
    # One probe file per test process: a resume check imports the run's reward plugins in this process, and one
    # reward name may come from one file only.
    plugins = Path(tempfile.gettempdir()) / f"resume_probe_{os.getpid()}"
    plugins.mkdir(exist_ok=True)
    (plugins / "resume_probe.py").write_text(PROBE_PLUGIN)
    flags = {**TINY, "--output_dir": str(tmp_path / "runs"), "--run_name": run_name, "--reward_dirs": str(plugins)}
    flags.update({f"--{key}": value for key, value in overrides.items()})
    return [
        "recipes/train.py",
        "--config",
        "recipes/shapes/tiny_cpu.yaml",
        *(x for pair in flags.items() for x in pair),
    ]


def guarded_env(tmp_path: Path, probe_log: Path) -> dict[str, str]:
    """The probe's log file plus the network-and-pickle guard for every process of the run."""
    path = os.pathsep.join(p for p in (str(GUARD), os.environ.get("PYTHONPATH", "")) if p)
    return {"PROBE_LOG": str(probe_log), "PYTHONPATH": path, "VISION_GRPO_GUARD_LOG": str(tmp_path / "guard.jsonl")}


def probe_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def guard_violations(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "guard.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert any(r["kind"] == "installed" for r in records), "the guard did not run"
    return [r for r in records if r["kind"] != "installed"]


# ---------------------------------------------------------------------------------------------------------------------
# Which checkpoint a run resumes from.


def make_checkpoint(run_dir: Path, step: int, complete: bool = True, state: bytes = b'{"global_step": 1}') -> Path:
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    if complete:
        (folder / TRAINER_STATE).write_bytes(state)
    return folder


@pytest.mark.parametrize("value", [None, False, "", "false", "False", "none"])
def test_no_resume_value_starts_from_scratch(tmp_path: Path, value) -> None:
    make_checkpoint(tmp_path, 2)
    assert resume_checkpoint(value, tmp_path) is None


@pytest.mark.parametrize("value", [True, "true", "last", "LAST"])
def test_last_is_the_newest_complete_checkpoint(tmp_path: Path, value, caplog: pytest.LogCaptureFixture) -> None:
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 10)  # 10 > 9 numerically, though "checkpoint-10" < "checkpoint-9" as text
    make_checkpoint(tmp_path, 9)
    make_checkpoint(tmp_path, 12, complete=False)  # killed while saving
    make_checkpoint(tmp_path, 14, state='{"log_history": [{"note": "é"'.encode()[:-2])  # cut inside a character
    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint(value, tmp_path) == str(newest)
    assert "checkpoint-14: it has a trainer_state.json cut short" in caplog.text
    assert "checkpoint-12: it has no trainer_state.json" in caplog.text


def test_last_without_any_complete_checkpoint_says_how_to_resume(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*run_name"):
        resume_checkpoint("last", tmp_path)


def test_an_explicit_checkpoint_must_exist_and_be_complete(tmp_path: Path) -> None:
    assert resume_checkpoint(str(make_checkpoint(tmp_path, 4)), tmp_path) == str(tmp_path / "checkpoint-4")
    with pytest.raises(FileNotFoundError, match="checkpoint-5 does not exist"):
        resume_checkpoint(str(tmp_path / "checkpoint-5"), tmp_path)
    partial = make_checkpoint(tmp_path, 6, complete=False)
    with pytest.raises(FileNotFoundError, match="has no trainer_state.json \\(not a complete checkpoint"):
        resume_checkpoint(str(partial), tmp_path)
    cut = make_checkpoint(tmp_path, 7, state=b'{"global_step": ')
    with pytest.raises(FileNotFoundError, match="has a trainer_state.json cut short \\(not a complete checkpoint"):
        resume_checkpoint(str(cut), tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# A run folder belongs to one run; a resume continues the same computation.


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def earlier_run(tmp_path: Path, argv: list[str]) -> Path:
    """A run folder as a run of `argv` leaves it after its second checkpoint: recipe.yaml, manifest, checkpoint-2."""
    with RecipeRun.start(GRPOConfig, argv) as run:
        configs = (run.task_args, run.training_args, run.model_args)
        facts = {"dataset": dataset_identity(run.task_args), "model_weights": run.model_weights}
        facts["code"] = code_identity(run.task_args)
        write_run_start(run.run_dir, run.recipe_path, argv, configs, **facts)
        write_checksums(make_checkpoint(run.run_dir, 2))  # as CheckpointChecksums leaves it after the save
    return run.run_dir


def test_a_fresh_run_in_a_folder_holding_a_run_is_refused_unless_overwritten(tmp_path: Path) -> None:
    argv = training_args(tmp_path, "taken")[1:]
    run_dir = earlier_run(tmp_path, argv)
    before = folder_bytes(run_dir)
    with pytest.raises(RunConflict, match=r"run folder .*taken already holds a run \(checkpoint-2, manifest.json, "):
        RecipeRun.start(GRPOConfig, argv)
    assert folder_bytes(run_dir) == before
    with pytest.raises(RunConflict, match="--resume_from_checkpoint last .*--overwrite_run true .*--run_name"):
        RecipeRun.start(GRPOConfig, argv)
    with RecipeRun.start(GRPOConfig, [*argv, "--overwrite_run", "true"]):
        assert not run_dir.exists(), "the earlier run was kept, to be mixed with the new one"


def test_a_resume_that_would_compute_differently_is_refused_listing_the_changes(tmp_path: Path) -> None:
    argv = training_args(tmp_path, "r")[1:]
    run_dir = earlier_run(tmp_path, argv)
    before = folder_bytes(run_dir)
    changed = [*argv, "--resume_from_checkpoint", "last", "--learning_rate", "1e-5", "--num_generations", "2"]
    with pytest.raises(RunConflict) as refused:
        RecipeRun.start(GRPOConfig, changed)
    assert str(refused.value).startswith(f"cannot resume {run_dir / 'checkpoint-2'}: ")
    changes = str(refused.value).split("(", 1)[1].split(");", 1)[0].split("; ")
    assert sorted(changes) == ["learning_rate: 0.001 then, 1e-05 now", "num_generations: 4 then, 2 now"]
    assert "list the keys in resume_allow_changes to accept them" in str(refused.value)
    assert folder_bytes(run_dir) == before
    with RecipeRun.start(GRPOConfig, [*changed, "--resume_allow_changes", "learning_rate", "num_generations"]) as run:
        assert run.resume_from == str(run_dir / "checkpoint-2")
    with RecipeRun.start(GRPOConfig, [*argv, "--resume_from_checkpoint", "last", "--max_steps", "50"]) as run:
        assert run.resume_from == str(run_dir / "checkpoint-2")  # more steps: the same computation, continued


def test_a_resume_whose_reward_code_changed_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The manifest records each reward's and the task's file by content; an edited plugin is named (before: the
    resume went on with another reward under the same name), and `resume_allow_changes: [code]` accepts it."""
    name = f"edited_{uuid.uuid4().hex[:8]}"
    plugins = tmp_path / "mine"
    plugins.mkdir()
    source = f"from vision_grpo.rewards import reward\n\n\n@reward()\ndef {name}(completions, **kwargs):\n"
    (plugins / "mine.py").write_text(source + "    return [1.0 for _ in completions]\n")
    argv = training_args(tmp_path, "r")[1:] + ["--reward_dirs", str(plugins), "--reward_funcs", name]
    argv += ["--reward_weights", "1"]
    run_dir = earlier_run(tmp_path, argv)
    assert set(json.loads((run_dir / "manifest.json").read_text())["code"]) == {"task shapes", f"reward {name}"}
    resume = [*argv, "--resume_from_checkpoint", "last"]
    with RecipeRun.start(GRPOConfig, resume):
        pass  # the same code: accepted
    (plugins / "mine.py").write_text(source + "    return [0.0 for _ in completions]\n")
    with pytest.raises(RunConflict, match=rf"\(code of reward {name}: .*mine.py sha256:[0-9a-f]{{16}} then, .*now\)"):
        RecipeRun.start(GRPOConfig, resume)
    with RecipeRun.start(GRPOConfig, [*resume, "--resume_allow_changes", "code"]) as run:
        assert run.resume_from == str(run_dir / "checkpoint-2")


def test_resume_allow_changes_refuses_keys_no_resume_can_change(tmp_path: Path) -> None:
    argv = training_args(tmp_path, "r")[1:]
    earlier_run(tmp_path, argv)
    changed = [*argv, "--resume_from_checkpoint", "last", "--lora_r", "16", "--resume_allow_changes", "lora_r"]
    with pytest.raises(RunConflict, match=r"resume_allow_changes lists \['lora_r'\], which a resume can never change"):
        RecipeRun.start(GRPOConfig, changed)


def test_a_resume_is_checked_by_the_models_content_not_its_path(tiny_model_path: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    argv = training_args(tmp_path, "r", model_name_or_path=str(model))[1:]
    run_dir = earlier_run(tmp_path, argv)
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)  # the same weights under another path: compared by content, accepted
    with RecipeRun.start(GRPOConfig, [*argv, "--resume_from_checkpoint", "last", "--model_name_or_path", str(moved)]):
        pass
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "note": "retrained"}))  # other weights, same path
    with pytest.raises(RunConflict, match=r"\(model_weights: \{'sha256': '[0-9a-f]{64}'\} then, \{'sha256'"):
        RecipeRun.start(GRPOConfig, [*argv, "--resume_from_checkpoint", "last"])
    assert json.loads((run_dir / "manifest.json").read_text())["model_weights"]["sha256"]


def test_the_run_folder_records_the_recipes_env_block_and_a_resume_on_other_values_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's `env:` block is part of how the run ran: its folder's recipe.yaml keeps it as written. Environment
    variables are the machine's settings, so a resume with other values is not refused for them."""
    monkeypatch.delenv("VISION_GRPO_RECIPE_ENV", raising=False)
    tiny = (REPO / "recipes/shapes/tiny_cpu.yaml").read_text(encoding="utf-8")
    recipe = tmp_path / "with_env.yaml"
    recipe.write_text(tiny + "env:\n  VISION_GRPO_RECIPE_ENV: 7\n", encoding="utf-8")
    argv = training_args(tmp_path, "env")[1:]
    argv[argv.index("--config") + 1] = str(recipe)
    run_dir = earlier_run(tmp_path, argv)
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["env"] == {"VISION_GRPO_RECIPE_ENV": 7}
    recipe.write_text(tiny + "env:\n  VISION_GRPO_RECIPE_ENV: 8\n", encoding="utf-8")
    with RecipeRun.start(GRPOConfig, [*argv, "--resume_from_checkpoint", "last"]):
        assert os.environ["VISION_GRPO_RECIPE_ENV"] == "8"


def test_overwrite_run_deletes_nothing_that_is_not_a_run_of_ours(tmp_path: Path) -> None:
    """The issue's case: `--output_dir . --run_name rewards --overwrite_run true` deleted the repository's rewards/."""
    checkout = tmp_path / "checkout"
    (checkout / "rewards").mkdir(parents=True)
    (checkout / "rewards" / "counting.py").write_text("# a user's code\n")
    argv = [*training_args(tmp_path, "rewards")[1:], "--output_dir", str(checkout), "--overwrite_run", "true"]
    with pytest.raises(RunConflict, match=r"will not delete .*rewards: .*rewards holds no manifest.json of a run"):
        RecipeRun.start(GRPOConfig, argv)
    assert (checkout / "rewards" / "counting.py").read_text() == "# a user's code\n"
    assert sorted(p.name for p in checkout.iterdir()) == ["rewards"], "the lock file was left behind"


def test_overwrite_run_never_follows_a_symbolic_link(tmp_path: Path) -> None:
    elsewhere = earlier_run(tmp_path, training_args(tmp_path, "real")[1:])  # a real run of ours, outside the target
    before = folder_bytes(elsewhere)
    linked = tmp_path / "linked_runs"
    linked.mkdir()
    (linked / "alias").symlink_to(elsewhere)
    argv = [*training_args(tmp_path, "alias")[1:], "--output_dir", str(linked), "--overwrite_run", "true"]
    with pytest.raises(RunConflict, match=r"will not delete .*alias: .*alias is a symbolic link"):
        RecipeRun.start(GRPOConfig, argv)
    assert folder_bytes(elsewhere) == before


@pytest.mark.parametrize("name", ["/tmp/elsewhere", "../outside", "a/../../outside"])
def test_a_run_name_that_leaves_output_dir_is_refused(tmp_path: Path, name: str) -> None:
    argv = training_args(tmp_path, name)[1:]
    with pytest.raises(RecipeError, match=r"run_name .* must name a folder inside output_dir \(no absolute path"):
        RecipeRun.start(GRPOConfig, argv)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "outside").exists()


def test_two_runs_in_one_folder_at_once_are_refused_naming_the_holder(tmp_path: Path) -> None:
    argv = training_args(tmp_path, "shared")[1:]
    with RecipeRun.start(GRPOConfig, argv):  # the first run holds the folder for as long as it runs
        with pytest.raises(RunConflict, match=rf"runs/shared is in use by another run \(pid {os.getpid()}\)"):
            RecipeRun.start(GRPOConfig, argv)
        with pytest.raises(RunConflict, match="in use by another run"):  # a resume or an overwrite too
            RecipeRun.start(GRPOConfig, [*argv, "--overwrite_run", "true"])
    with RecipeRun.start(GRPOConfig, argv):  # released when the first one ended
        pass


def test_where_the_filesystem_has_no_flock_a_run_still_holds_its_folder(tmp_path: Path, monkeypatch) -> None:
    """Lustre mounted without `flock` (and some network filesystems) answer flock with ENOSYS: a raw flock failed
    every run there; the lock falls back to a lock file that records its holder. (The run folder's lock alone: the
    embedded model's build lock in the shared cache was made with flock, and such a file is not a soft lock's.)"""

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    def busy(holder: str) -> RunConflict:
        return RunConflict(f"in use by another run (pid {holder})")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = tmp_path / "runs" / ".lustre.lock"
    held_here = rf"in use by another run \(pid {os.getpid()}\)"
    with hold_lock(lock, busy), pytest.raises(RunConflict, match=held_here), hold_lock(lock, busy):
        pass
    assert not lock.exists()  # removed on leaving, as with flock
    with hold_lock(lock, busy):  # released when the first one ended
        assert lock.read_text().split("\n", 1)[0] == str(os.getpid())


def _hold_lock(path: str, held) -> None:
    """A run holding its folder's lock, until it is killed."""
    with hold_lock(Path(path), RuntimeError):
        held.set()
        time.sleep(600)


def test_a_lock_left_by_a_killed_run_is_recognised_as_stale(tmp_path: Path) -> None:
    """The holder is a fork of this process (a fresh interpreter spends seconds importing torch for `runs`)."""
    argv = training_args(tmp_path, "crashed")[1:]
    context = multiprocessing.get_context("fork")
    held = context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path / "runs" / ".crashed.lock"), held))
    holder.start()
    assert held.wait(60), "the holder never took the lock"
    with pytest.raises(RunConflict, match=rf"in use by another run \(pid {holder.pid}\)"):
        RecipeRun.start(GRPOConfig, argv)
    holder.kill()  # SIGKILL: no clean-up runs
    holder.join()
    assert (tmp_path / "runs" / ".crashed.lock").read_text() == str(holder.pid)  # the dead holder's file remains
    with RecipeRun.start(GRPOConfig, argv) as run:
        assert run.run_dir == tmp_path / "runs" / "crashed"


def test_a_run_that_failed_before_its_first_checkpoint_leaves_a_folder_the_same_command_reuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = training_args(tmp_path, "failed")[1:]
    run = RecipeRun.start(GRPOConfig, argv)
    configs = (run.task_args, run.training_args, run.model_args)
    write_run_start(run.run_dir, run.recipe_path, argv, configs, dataset={}, model_weights=run.model_weights)
    run.lock.close()  # the run failed here (a bad value found at train time, a crash): no checkpoint was saved
    with caplog.at_level(logging.WARNING), RecipeRun.start(GRPOConfig, argv) as again:
        assert again.resume_from is None
    assert "stopped before its first checkpoint (nothing to resume): starting over in it" in caplog.text
    assert not run.run_dir.exists() or not any(run.run_dir.iterdir())
    (aside,) = run.run_dir.parent.glob("failed.stopped-*")  # its logs and events kept, named in the log
    assert (aside / "manifest.json").is_file() and f"are moved to {aside}" in caplog.text


@pytest.mark.slow  # two ranks under torchrun, like every other multi-process test
def test_decided_by_main_process_forwards_every_exception_to_every_rank(tmp_path: Path) -> None:
    """A check that fails on rank 0 with an error of any type stops rank 1 too, with the same type and message
    (before: only ValueError and OSError were forwarded, and rank 1 waited for ever)."""
    script = tmp_path / "decide.py"
    script.write_text(DECIDE)
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        cwd=REPO,
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    outcomes = sorted(line for line in process.stdout.splitlines() if line.startswith("rank"))
    assert outcomes == ["rank 0: KeyError 'no such key'", "rank 1: KeyError 'no such key'"], process.stderr[-3000:]


DECIDE = """
import sys
from datetime import timedelta
from accelerate import PartialState
from vision_grpo.run.ranks import decided_by_main_process

state = PartialState(cpu=True, timeout=timedelta(seconds=30))

def check():
    raise KeyError("no such key")

try:
    decided_by_main_process(check)
except Exception as error:
    # one write per line: under PYTHONUNBUFFERED print() writes the text and its newline apart, and the two
    # ranks' lines interleaved ("rank 0: ...rank 1: ...")
    sys.stdout.write(f"rank {state.process_index}: {type(error).__name__} {error}\\n")
state.destroy_process_group()
"""


# ---------------------------------------------------------------------------------------------------------------------
# Checksums: a checkpoint's files as they were saved.


def saved_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint as the Trainer and CheckpointChecksums leave it."""
    folder = make_checkpoint(run_dir, step)
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 80)
    (folder / "optimizer.pt").write_bytes(b"optimizer state" * 100)
    write_checksums(folder)
    return folder


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (
            lambda f: f.write_bytes(f.read_bytes()[:100] + bytes(19900) + f.read_bytes()[20000:]),
            "adapter_model.safetensors corrupted: its bytes changed since it was saved",
        ),
        (lambda f: f.write_bytes(f.read_bytes()[:-7]), "adapter_model.safetensors of 20473 bytes, saved with 20480"),
        (lambda f: f.unlink(), "no adapter_model.safetensors"),
    ],
    ids=["zeroed", "truncated", "deleted"],
)
def test_a_damaged_newest_checkpoint_is_named_and_last_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, named: str
) -> None:
    previous = saved_checkpoint(tmp_path, 2)
    newest = saved_checkpoint(tmp_path, 4)
    damage(newest / "adapter_model.safetensors")
    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint("last", tmp_path) == str(previous)
    assert f"skipping {newest}: it has {named}" in caplog.text
    with pytest.raises(FileNotFoundError, match=r"checkpoint-4 has .*adapter_model.safetensors"):
        resume_checkpoint(str(newest), tmp_path)


def test_a_checkpoint_without_its_checksums_is_not_resumed_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleting checksums.json must not make a damaged checkpoint pass: in a run whose manifest says its checkpoints
    carry checksums, one without them is skipped by `last` and refused by path; a run folder from before checksums
    were recorded resumes as it did."""
    write_run_start(tmp_path, None, [], ())
    previous = saved_checkpoint(tmp_path, 2)
    newest = saved_checkpoint(tmp_path, 4)
    (newest / "adapter_model.safetensors").write_bytes(bytes(20480))  # damaged, same size ...
    (newest / CHECKSUMS).unlink()  # ... and what would have named it deleted
    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint("last", tmp_path) == str(previous)
    assert f"skipping {newest}: it has no checksums.json, so its files cannot be verified" in caplog.text
    with pytest.raises(FileNotFoundError, match=r"checkpoint-4 has no checksums.json"):
        resume_checkpoint(str(newest), tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["checkpoint_checksums"]  # as a run started before checksums were recorded has it
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert resume_checkpoint("last", tmp_path) == str(newest)


def test_a_truncated_optimizer_is_named(tmp_path: Path) -> None:
    folder = saved_checkpoint(tmp_path, 3)
    (folder / "optimizer.pt").write_bytes(b"optimizer")
    with pytest.raises(FileNotFoundError, match=r"checkpoint-3 has optimizer.pt of 9 bytes, saved with 1500"):
        resume_checkpoint(str(folder), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in"):  # and `last` has nothing to fall back to
        resume_checkpoint("last", tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# The data order: a function of (seed, epoch), so a resumed run continues it.


def epochs(sampler: RepeatSampler, count: int, start: int = 0) -> list[list[int]]:
    """The sampler's order for epochs start..count-1, announcing each epoch as the Trainer does."""
    orders = []
    for epoch in range(start, count):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def sampler(cls: type[RepeatSampler]) -> RepeatSampler:
    return cls(data_source=range(8), mini_repeat_count=2, batch_size=4, repeat_count=1, seed=42)


def test_a_sampler_started_at_epoch_k_gives_the_uninterrupted_order() -> None:
    uninterrupted = epochs(sampler(EpochSeededSampler), 4)
    assert uninterrupted[0] == list(sampler(RepeatSampler))  # epoch 0 is TRL's own order
    assert len({tuple(order) for order in uninterrupted}) == 4  # every epoch is shuffled anew
    for start in range(1, 4):  # a resumed run builds a fresh sampler and starts at epoch `start`
        assert epochs(sampler(EpochSeededSampler), 4, start) == uninterrupted[start:]


def test_the_trainer_orders_its_data_with_the_epoch_seeded_sampler(tiny_model_path: Path, tmp_path: Path) -> None:
    """What a resumed run's data order rests on: VisionGRPOTrainer hands TRL's sampler over as EpochSeededSampler
    (TRL's own would repeat epoch 0's order in a run resumed in a later epoch), and its epochs follow (seed, epoch)."""
    argv = ["--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path), "--report_to", "none"]
    task_args, train_args, model_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)
    processor = get_processor(model_args, task_args)
    trainer = VisionGRPOTrainer(
        model=load_model(model_args),
        reward_funcs=get_recipe_rewards(task_args, processor.tokenizer),
        args=train_args,
        train_dataset=get_dataset(task_args, "train", max_pixels_of(processor)),
        processing_class=processor,
    )
    train_sampler = trainer._get_train_sampler(trainer.train_dataset)
    assert isinstance(train_sampler, EpochSeededSampler)
    uninterrupted = epochs(train_sampler, 3)
    resumed = trainer._get_train_sampler(trainer.train_dataset)  # a resumed run builds a fresh one, at epoch 2
    assert epochs(resumed, 3, start=2) == uninterrupted[2:] and uninterrupted[2] != uninterrupted[0]


# ---------------------------------------------------------------------------------------------------------------------
# Real runs.


@pytest.mark.slow
@pytest.mark.parametrize("replica", FAMILY_MODELS)
def test_a_run_killed_after_a_checkpoint_resumes_exactly_where_it_stopped(tmp_path: Path, replica: str) -> None:
    steps = {"max_steps": "5", "save_steps": "1", "model_name_or_path": replica}
    whole_log, cut_log = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    run_script(training_args(tmp_path, "whole", **steps), env={"PROBE_LOG": str(whole_log)}, timeout=600)

    # SIGKILL inside step 4, after checkpoint-3 was written.
    killed = run_script(
        training_args(tmp_path, "cut", **steps),
        env={"PROBE_LOG": str(cut_log), "PROBE_KILL_AT_STEP": "3"},
        timeout=600,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL
    cut_dir = tmp_path / "runs" / "cut"
    assert (cut_dir / "checkpoint-3" / TRAINER_STATE).is_file()
    assert not (cut_dir / "adapter_model.safetensors").exists()  # the final model was never written
    assert json.loads((cut_dir / "manifest.json").read_text())["ended"] is None
    # As if a kill had also cut the save of checkpoint-4 short: weights there, trainer state not yet.
    shutil.copytree(cut_dir / "checkpoint-3", cut_dir / "checkpoint-4")
    (cut_dir / "checkpoint-4" / TRAINER_STATE).unlink()

    resumed = run_script(
        training_args(tmp_path, "cut", **steps, resume_from_checkpoint="last"),
        env=guarded_env(tmp_path, cut_log),
        timeout=600,
    )
    assert "checkpoint-4: it has no trainer_state.json" in resumed.stderr

    whole, cut = probe_records(whole_log), probe_records(cut_log)
    first_pid = cut[0]["pid"]
    assert [r["step"] for r in cut if r["pid"] == first_pid] == [0, 1, 2, 3]
    after_resume = [(r["step"], r["ids"]) for r in cut if r["pid"] != first_pid]
    assert after_resume == [(r["step"], r["ids"]) for r in whole if r["step"] >= 3]  # steps 3 and 4, same prompts
    manifest = json.loads((cut_dir / "manifest.json").read_text())
    assert manifest["resumed_from"] == str(cut_dir / "checkpoint-3") and manifest["global_step"] == 5

    expected = load_file(str(tmp_path / "runs" / "whole" / "adapter_model.safetensors"))
    got = load_file(str(cut_dir / "adapter_model.safetensors"))
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected), "resumed weights differ from uninterrupted"

    # Weights are safetensors only; the resume unpickled nothing and nothing left the machine.
    for folder in (cut_dir, cut_dir / "checkpoint-5"):
        names = {p.name for p in folder.iterdir()}
        assert "adapter_model.safetensors" in names
        assert not names & {"adapter_model.bin", "pytorch_model.bin", "model.bin"}
    assert guard_violations(tmp_path) == []


def wait_for_step(log: Path, process: subprocess.Popen, step: int, timeout: float) -> None:
    """Block until the probe logged `step` (that step's generation has begun), failing if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(r["step"] >= step for r in probe_records(log)):
            return
        if process.poll() is not None:
            raise AssertionError(f"training ended early ({process.returncode}):\n{process.stderr.read()[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_a_checkpoint_and_the_run_then_ends_cleanly(
    tiny_model_path: Path, tmp_path: Path, signum: int
) -> None:
    log = tmp_path / "probe.jsonl"
    # No scheduled checkpoints, so a checkpoint can only come from the signal.
    args = training_args(tmp_path, "stopped", max_steps="200", save_strategy="no")
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, **guarded_env(tmp_path, log)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(log, process, step=1, timeout=300)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr[-4000:]
    assert "saving a checkpoint after this step" in stderr

    run_dir = tmp_path / "runs" / "stopped"
    (checkpoint,) = run_dir.glob("checkpoint-*")
    stopped_at = json.loads((checkpoint / TRAINER_STATE).read_text())["global_step"]
    assert checkpoint.name == f"checkpoint-{stopped_at}" and 1 <= stopped_at < 200
    # The step in flight was finished, and no further one started.
    assert max(r["step"] for r in probe_records(log)) == stopped_at - 1
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ended"] is not None and manifest["global_step"] == stopped_at
    assert (run_dir / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_step(tiny_model_path: Path, tmp_path: Path) -> None:
    """The signal reaches rank 1 only (as when one node's job is preempted): both ranks must stop after the same
    step and save one checkpoint together; a rank that stopped alone would leave the other waiting forever."""
    log = tmp_path / "probe.jsonl"
    args = training_args(tmp_path, "stopped", max_steps="200", save_strategy="no")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    process = subprocess.Popen(
        launch,
        cwd=REPO,
        env={**os.environ, **guarded_env(tmp_path, log), "ACCELERATE_USE_CPU": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a hung run can be killed with all its workers
    )
    try:
        wait_for_step(log, process, step=1, timeout=300)
        rank_1 = next(r["pid"] for r in probe_records(log) if r["rank"] == 1)
        os.kill(rank_1, signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-4000:]
    (checkpoint,) = (tmp_path / "runs" / "stopped").glob("checkpoint-*")
    stopped_at = json.loads((checkpoint / TRAINER_STATE).read_text())["global_step"]
    last_step = {rank: max(r["step"] for r in probe_records(log) if r["rank"] == rank) for rank in (0, 1)}
    assert last_step == {0: stopped_at - 1, 1: stopped_at - 1}, "the ranks stopped after different steps"
    assert 1 <= stopped_at < 200 and (checkpoint / "adapter_model.safetensors").is_file()
