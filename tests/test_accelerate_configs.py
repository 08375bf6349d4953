"""Every accelerate config is one accelerate accepts and says what it is for; every launch command a recipe
documents resolves, through accelerate's and TRL's own checks, to a consistent batch for its process count; the
vLLM recipes are valid on a machine without vLLM.

Nothing here launches a process: configs are checked as files; cpu.yaml, zero2.yaml and zero3.yaml also run (on
CPU, 2 processes) in test_distributed.py.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from unittest import mock
from urllib.parse import urlparse

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin
from conftest import REPO, run_script
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from trl import GRPOConfig, ModelConfig, SFTConfig, TrlParser
from trl.scripts.vllm_serve import ScriptArguments as VLLMServeArguments

from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
VLLM_RECIPES = [recipe for recipe in RECIPES if "_vllm_" in recipe.stem]
# The entry points a recipe's launch command may name, with the config classes each parses.
ENTRY_POINTS = {
    "recipes/train.py": (TaskArguments, GRPOConfig, ModelConfig),
    "recipes/sft.py": (TaskArguments, SFTConfig, ModelConfig),
}
# What each shipped config must resolve to: (launcher accelerate picks, processes, machines, precision, on CPU).
# "torchrun" is accelerate's multi-GPU launcher, the only one that starts several processes without mpirun.
EXPECTED = {
    "single_gpu": ("simple", 1, 1, "bf16", False),
    "ddp": ("torchrun", 8, 1, "bf16", False),
    "zero2": ("deepspeed", 8, 1, "bf16", False),
    "zero3": ("deepspeed", 8, 1, "bf16", False),
    "multi_node": ("deepspeed", 16, 2, "bf16", False),
    "cpu": ("torchrun", 2, 1, "no", True),
}
# The recipe keys whose meaning depends on the launch set-up: each config's header must say how.
BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "generation_batch_size")


def launch_args(cli: list[str]) -> argparse.Namespace:
    """What `accelerate launch <cli> <script>` resolves to, by accelerate's own parser and checks (no launch)."""
    return _validate_launch_command(launch_command_parser().parse_args(cli))[0]


def launcher_of(args: argparse.Namespace) -> str:
    if args.use_deepspeed:
        return "deepspeed"
    return "torchrun" if args.multi_gpu else "simple"


def header(path: Path) -> str:
    """The comment block a file starts with, continuation backslashes joined."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines).replace("\\\n", " ")


def documented_commands(recipe: Path, program: str) -> list[tuple[dict[str, str], list[str]]]:
    """The `program` commands (e.g. `accelerate launch`) in a recipe's header: (environment, arguments after it)."""
    found = []
    for line in header(recipe).splitlines():
        if program not in line:
            continue
        before, after = line.split(program, 1)
        words = shlex.split(after)
        if not words or not words[0].startswith("--") and not words[0].endswith(".py"):
            continue  # prose that mentions the command
        env = dict(word.split("=", 1) for word in before.split() if re.fullmatch(r"[A-Z_]+=\S+", word))
        found.append((env, words))
    return found


def test_the_configs_the_docs_name_exist() -> None:
    assert {path.stem for path in CONFIGS} >= set(EXPECTED)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_each_config_starts_with_when_to_use_it_its_memory_and_the_keys_to_adjust(config: Path) -> None:
    text = header(config)
    assert len(text.splitlines()) >= 4, f"{config.name}: the header comment is missing"
    assert "memory" in text.lower()
    for key in BATCH_KEYS:
        assert key in text, f"{config.name}: the header does not say how `{key}` depends on this set-up"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_accelerate_accepts_each_config_and_it_is_consistent(config: Path) -> None:
    stored = load_config_from_file(str(config))  # unknown keys fail here
    args = launch_args(["--config_file", str(config), "recipes/train.py"])
    assert args.num_processes >= args.num_machines >= 1
    assert args.num_processes % args.num_machines == 0, "every machine must run the same number of processes"
    assert 0 <= int(args.machine_rank) < args.num_machines
    if args.num_machines > 1:
        assert stored.main_process_ip and stored.main_process_port, "a multi-machine config needs the main address"
    expected = EXPECTED.get(config.stem)
    if expected is not None:
        launcher, processes, machines, precision, cpu = expected
        assert (launcher_of(args), args.num_processes, args.num_machines) == (launcher, processes, machines)
        assert (args.mixed_precision, bool(stored.use_cpu)) == (precision, cpu)


@pytest.mark.parametrize("config", [c for c in CONFIGS if "deepspeed_config" in yaml.safe_load(c.read_text())])
def test_deepspeed_configs_build_and_leave_batch_and_clipping_to_the_recipe(config: Path) -> None:
    settings = yaml.safe_load(config.read_text())["deepspeed_config"]
    plugin = DeepSpeedPlugin(**{k: v for k, v in settings.items() if k != "deepspeed_multinode_launcher"})
    built = plugin.deepspeed_config
    # "auto": the trainer fills these from the recipe, so a recipe and this file can never disagree.
    assert built["gradient_accumulation_steps"] == built["gradient_clipping"] == "auto"
    zero = built["zero_optimization"]
    assert zero["stage"] in (2, 3)
    if zero["stage"] == 3:
        assert plugin.zero3_init_flag, "ZeRO-3 should load the model sharded"
        assert zero["stage3_gather_16bit_weights_on_model_save"], "the saved model must be loadable without DeepSpeed"
    assert DeepSpeedZeroConfig(**zero).stage == zero["stage"]  # DeepSpeed's own validation


def test_the_multi_node_template_takes_the_machine_rank_from_the_command_line() -> None:
    config = REPO / "accelerate_configs" / "multi_node.yaml"
    for rank in range(2):
        args = launch_args(["--config_file", str(config), "--machine_rank", str(rank), "recipes/train.py"])
        assert int(args.machine_rank) == rank
    assert "FILL" in config.read_text(), "the template marks the fields a user fills in"


# Recipes: the launch commands their headers document, parsed as the trainer would parse them.


def parse_launch(recipe: Path, words: list[str]) -> tuple[int, tuple]:
    """(processes, parsed configs) of a documented `accelerate launch ...` command of `recipe`."""
    script = next(word for word in words if word.endswith(".py"))
    at = words.index(script)
    assert (REPO / script).is_file(), f"{recipe.name} documents a launch of missing {script}"
    script_args = words[at + 1 :]
    assert script_args[script_args.index("--config") + 1] == str(recipe.relative_to(REPO)), "wrong --config"
    # Without --config_file accelerate uses the user's default config: read that as one process.
    processes = launch_args([*words[:at], script]).num_processes if "--config_file" in words else 1
    classes = ENTRY_POINTS[script]
    # The trainer config rejects bf16 without a GPU; use_cpu lifts that check and changes no arithmetic.
    with mock.patch.object(classes[1], "world_size", new_callable=mock.PropertyMock, return_value=processes):
        parsed = parse_recipe(classes, [*script_args, "--use_cpu", "true"])
    return processes, parsed


LAUNCHES = [
    pytest.param(recipe, words, id=f"{recipe.parent.name}/{recipe.stem}-{index}")
    for recipe in RECIPES
    for index, (_env, words) in enumerate(documented_commands(recipe, "accelerate launch"))
]


def test_gpu_shape_recipes_document_how_to_launch_them() -> None:
    recipes = [r for r in RECIPES if r.parent.name == "shapes" and not yaml.safe_load(r.read_text()).get("use_cpu")]
    assert recipes
    for recipe in recipes:
        commands = documented_commands(recipe, "accelerate launch")
        assert any("--config_file" in words for _env, words in commands), f"{recipe.name} names no accelerate config"


@pytest.mark.parametrize(("recipe", "words"), LAUNCHES)
def test_documented_launches_parse_for_their_process_count(recipe: Path, words: list[str]) -> None:
    """TRL's own checks (whole prompt groups in every generation batch) run with the command's process count."""
    processes, (_task, trainer, _model) = parse_launch(recipe, words)
    if isinstance(trainer, GRPOConfig):  # the generation batch was sized for `processes` ranks
        per_generation = trainer.per_device_train_batch_size * processes * trainer.steps_per_generation
        assert trainer.generation_batch_size == per_generation
        if trainer.use_vllm and trainer.vllm_mode == "colocate":
            assert processes % trainer.vllm_tensor_parallel_size == 0, "tensor-parallel groups must tile the ranks"


@pytest.mark.parametrize("recipe", VLLM_RECIPES, ids=lambda p: p.stem)
def test_vllm_recipes_differ_from_their_base_only_in_generation(recipe: Path) -> None:
    base_path = recipe.with_name(recipe.stem.split("_vllm_")[0] + ".yaml")
    base, variant = yaml.safe_load(base_path.read_text()), yaml.safe_load(recipe.read_text())
    changed = {key for key in base.keys() | variant.keys() if base.get(key) != variant.get(key)} - {"output_dir"}
    assert changed, f"{recipe.name} does not differ from {base_path.name}"
    assert all(key == "use_vllm" or key.startswith("vllm_") for key in changed), f"drifted keys: {sorted(changed)}"
    assert variant["use_vllm"] is True and variant["vllm_mode"] in recipe.stem
    assert variant["output_dir"] != base["output_dir"], "runs of the two generators must not share a folder"


@pytest.mark.parametrize("recipe", [r for r in VLLM_RECIPES if r.stem.endswith("_server")], ids=lambda p: p.stem)
def test_the_vllm_server_command_matches_the_recipe(recipe: Path) -> None:
    content = yaml.safe_load(recipe.read_text())
    servers = documented_commands(recipe, "trl vllm-serve")
    assert servers, f"{recipe.name} must show the `trl vllm-serve` command"
    (server_env, server_words), *_ = servers
    (served,) = TrlParser((VLLMServeArguments,)).parse_args_and_config(args=server_words)
    assert served.model == content["model_name_or_path"]
    assert served.port == urlparse(content["vllm_server_base_url"]).port
    assert served.max_model_len is None or served.max_model_len > content["max_completion_length"]
    server_gpus = set(server_env["CUDA_VISIBLE_DEVICES"].split(","))
    for env, words in documented_commands(recipe, "accelerate launch"):
        training_gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert not server_gpus & set(training_gpus), "the server and the trainer must not share a GPU"
        processes, _parsed = parse_launch(recipe, words)
        assert processes == len(training_gpus), "one training process per visible GPU"


def test_vllm_recipes_parse_and_our_code_imports_without_vllm(tmp_path: Path) -> None:
    """In a process of its own (a fork of the suite's preloaded libraries, none of ours), so that no other test's
    imports hide an import of vLLM."""
    code = (
        "import runpy, sys\n"
        "from trl import GRPOConfig, ModelConfig\n"
        "import vision_grpo.data, vision_grpo.rewards, vision_grpo.training.trainer, vision_grpo.evaluation.evaluate\n"
        "from vision_grpo.recipe.arguments import TaskArguments\nfrom vision_grpo.recipe.parse import parse_recipe\n"
        "runpy.run_path('recipes/train.py')\n"
        "for recipe in sys.argv[1:]:\n"
        "    _, trainer, _ = parse_recipe((TaskArguments, GRPOConfig, ModelConfig),"
        " ['--config', recipe, '--use_cpu', 'true'])\n"
        "    assert trainer.use_vllm\n"
        "assert 'vllm' not in sys.modules, 'vllm was imported'\n"
        "print('ok', len(sys.argv) - 1)\n"
    )
    script = tmp_path / "imports_without_vllm.py"
    script.write_text(code)
    result = run_script([str(script), *map(str, VLLM_RECIPES)], timeout=300)
    assert f"ok {len(VLLM_RECIPES)}" in result.stdout
    assert len(VLLM_RECIPES) >= 2
