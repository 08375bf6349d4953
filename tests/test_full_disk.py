"""A full disk (issue 37, item 2), simulated by a write wrapper that raises ENOSPC once a budget of bytes is spent:
each write of ours ends in `DiskFull` naming the path and about how much the write needed, keeps what was finished,
and the same command continues once space is freed."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import pytest
import torch
from datasets.arrow_writer import ArrowWriter
from lora_runs import lora_run
from safetensors import SafetensorError
from test_damaged_caches import rows_of
from test_data_cache import recipe, write_source
from test_evaluate import SHAPES_RECIPE
from transformers import PreTrainedModel
from trl import GRPOTrainer

from vision_grpo.data.prepared import ROWS_CACHE
from vision_grpo.evaluation import evaluate
from vision_grpo.evaluation.results import partial_entries, partial_path
from vision_grpo.export import export_command as export_cli
from vision_grpo.run.launched import raised_on_purpose
from vision_grpo.run.recipe_run import RecipeRun
from vision_grpo.storage import writes
from vision_grpo.storage.writes import DiskFull, append_bytes, is_full_disk, write_text_atomic
from vision_grpo.training.trainer import VisionGRPOTrainer


class FullAfter:
    """A file whose writes raise ENOSPC once `budget` bytes have been written (what a full device does)."""

    def __init__(self, inner: Any, budget: int) -> None:
        self.inner, self.budget = inner, budget

    def write(self, data: Any) -> int:
        """As a buffered file on a full device: what fits is written, then ENOSPC."""
        if len(data) > self.budget:
            self.inner.write(bytes(data[: self.budget]))
            self.budget = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= len(data)
        return self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> FullAfter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


def test_a_full_disk_while_the_rows_cache_is_written_names_it_and_the_rerun_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = write_source(tmp_path / "data", [str(i % 9) for i in range(300)])
    real = ArrowWriter.__init__

    rows = tmp_path / "cache" / ROWS_CACHE
    other = rows / "tmp-another-keys-pass"  # what another key's pass on the same folder writes meanwhile
    writers: list[subprocess.Popen] = []

    def full(self: ArrowWriter, *args: Any, **kwargs: Any) -> None:  # the writer of the pass's file
        real(self, *args, **kwargs)
        if ROWS_CACHE in str(kwargs.get("path")):  # not the source's own Arrow cache, which `datasets` writes first
            self.stream = FullAfter(self.stream, budget=2000)
            hold = f"f = open({str(other)!r}, 'ab'); print(flush=True); import time; time.sleep(120)"
            writers.append(subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True))
            writers[-1].stdout.readline()  # it holds the file open

    monkeypatch.setattr(ArrowWriter, "__init__", full)
    try:
        with pytest.raises(DiskFull) as failed:
            rows_of(recipe(folder))
        assert [path.name for path in rows.glob("tmp*")] == [other.name]  # ours removed, the live writer's kept
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    message = str(failed.value)
    assert f"no space left on the device to write {rows}/" in message and ".arrow: the write needed about " in message
    assert "kB" in message and "free some space and run the same command again" in message
    assert not list(rows.glob("*.arrow"))  # nothing half-written left to read
    other.unlink()
    monkeypatch.setattr(ArrowWriter, "__init__", real)  # space freed
    assert len(rows_of(recipe(folder))) == 300


def test_an_atomic_write_on_a_full_disk_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "result.json"
    path.write_text("previous")
    real_open = Path.open

    def full_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        handle = real_open(self, *args, **kwargs)
        return FullAfter(handle, budget=10) if self.name.endswith(".tmp") else handle

    monkeypatch.setattr(Path, "open", full_open)
    with pytest.raises(DiskFull, match=r"to write .*result.json: the write needed about 5.0 kB and .* is free there"):
        write_text_atomic(path, "x" * 5000)
    assert path.read_text() == "previous" and list(tmp_path.iterdir()) == [path]


def test_an_append_on_a_full_disk_keeps_the_lines_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "eval.json.partial.jsonl"
    append_bytes(path, b'{"metadata": {}}\n{"id": "a"}\n')
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: FullAfter(real_open(self, *a, **k), budget=5))
    with pytest.raises(DiskFull, match=r"partial.jsonl: the write needed about 12 bytes"):
        append_bytes(path, b'{"id": "b"}\n')
    monkeypatch.undo()
    assert path.read_bytes() == b'{"metadata": {}}\n{"id": "a"}\n{"id"'  # the cut line is the reader's to drop:
    assert partial_entries(path) == [{"metadata": {}}, {"id": "a"}]


def test_an_evaluation_on_a_full_disk_keeps_its_records_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--config", SHAPES_RECIPE, "--limit", "4", "--batch_size", "2", "--max_new_tokens", "4"]
    whole = tmp_path / "whole.json"
    evaluate.main([*args, "--output", str(whole)])
    output = tmp_path / "eval.json"
    partial = partial_path(output)
    real_open, appends = Path.open, []

    def second_append_full(self: Path, mode: str = "r", *rest: Any, **kwargs: Any) -> Any:
        handle = real_open(self, mode, *rest, **kwargs)
        if self == partial and mode == "ab":
            appends.append(self)
            return FullAfter(handle, budget=0) if len(appends) == 2 else handle
        return handle

    with monkeypatch.context() as patch, pytest.raises(DiskFull) as failed:
        patch.setattr(Path, "open", second_append_full)
        evaluate.main([*args, "--output", str(output)])
    assert f"to write {partial}: the write needed about " in str(failed.value)
    assert len(partial_entries(partial)) == 1 + 2  # the header and the first round's two records, whole
    evaluate.main([*args, "--output", str(output), "--resume"])  # space freed: the same command, resumed
    records = json.loads(output.read_text())["records"]
    assert records == json.loads(whole.read_text())["records"]


# torch's zip writer on a full tmpfs (measured): no errno, only that its position did not move.
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def test_each_library_s_words_for_a_full_disk_are_recognised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_full_disk(OSError(errno.ENOSPC, "No space left on device"), tmp_path, None)
    assert is_full_disk(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path, None)
    assert is_full_disk(RuntimeError(SAFETENSORS_FULL), tmp_path, None)
    monkeypatch.setattr(writes, "free_bytes", lambda path: 100)
    assert is_full_disk(RuntimeError(TORCH_FULL), tmp_path, 1000)  # less free than the save needs
    assert not is_full_disk(RuntimeError(TORCH_FULL), tmp_path, 50)  # room enough: some other failure
    assert not is_full_disk(OSError(errno.EACCES, "Permission denied"), tmp_path, 1000)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_full_disk_during_a_checkpoint_save_is_named_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, processes: int
) -> None:
    """One process removes its half-written checkpoint; with several, another rank may still be writing into it:
    it is kept and named (before: the main process removed it under the other ranks' writes)."""
    previous = tmp_path / "checkpoint-2"
    previous.mkdir()
    (previous / "adapter_model.safetensors").write_bytes(b"w" * 5000)

    def torch_on_a_full_disk(self: GRPOTrainer, model: Any, trial: Any) -> None:
        (tmp_path / "checkpoint-3").mkdir()
        (tmp_path / "checkpoint-3" / "optimizer.pt").write_bytes(b"o" * 64)
        raise RuntimeError(TORCH_FULL)

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", torch_on_a_full_disk)
    monkeypatch.setattr(writes, "free_bytes", lambda path: 10)
    trainer = VisionGRPOTrainer.__new__(VisionGRPOTrainer)  # only what the save reads
    trainer._get_output_dir = lambda trial: str(tmp_path)
    trainer.state = SimpleNamespace(global_step=3)
    trainer.model = torch.nn.Linear(2, 2)
    trainer.is_world_process_zero = lambda: True
    trainer.accelerator = SimpleNamespace(num_processes=processes)
    with pytest.raises(DiskFull, match=r"to write .*/checkpoint-3: the write needed about 5.0 kB and 10 bytes is free"):
        trainer._save_checkpoint(trainer.model, None)
    if processes == 1:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # the half-saved one removed
    else:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
        assert "checkpoint-3 is half-written and kept: another process may still be writing into it" in caplog.text
    assert (previous / "adapter_model.safetensors").read_bytes() == b"w" * 5000


def test_a_full_disk_during_an_export_is_named_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = lora_run(tmp_path / "run", "vision-grpo/tiny-qwen2.5-vl", SHAPES_RECIPE)
    output = tmp_path / "exported"
    real = PreTrainedModel.save_pretrained

    def on_a_full_disk(self: PreTrainedModel, folder: Any, **kwargs: Any) -> None:
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 100)  # what safetensors wrote before the disk filled
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", on_a_full_disk)
    with pytest.raises(DiskFull, match=rf"to write {output}: the write needed about \d+\.\d MB"):
        export_cli.main(["--adapter", str(run), "--output", str(output)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging folder, no lock, no output
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)  # space freed
    assert export_cli.main(["--adapter", str(run), "--output", str(output)]) == output
    assert (output / "model.safetensors").is_file() or list(output.glob("model-*.safetensors"))


def test_a_full_disk_at_the_final_save_is_named(tmp_path: Path) -> None:
    class Trainer:  # what train_and_save calls on a rank that writes no record
        model = torch.nn.Linear(4, 4)
        state = SimpleNamespace(global_step=1)  # trained: the run has weights to save

        def add_callback(self, callback: Any) -> None: ...

        def train(self, resume_from_checkpoint: Any) -> None: ...

        def save_model(self, folder: str) -> None:
            raise SafetensorError(SAFETENSORS_FULL)

    run = RecipeRun.__new__(RecipeRun)
    run.is_main, run.run_dir, run.resume_from = False, tmp_path / "a", None
    with pytest.raises(DiskFull, match=r"to write .*/a: the write needed about 80 bytes"):
        run.train_and_save(Trainer(), processor=None)


def test_a_full_disk_is_named_without_a_traceback_under_a_launcher_wherever_it_was_met() -> None:
    def rows_cache() -> None:  # a DiskFull raised outside vision_grpo/, recipes/, eval/ (the rows cache is in data/)
        raise DiskFull(errno.ENOSPC, "no space left on the device to write x.arrow")

    with pytest.raises(DiskFull) as failed:
        rows_cache()
    assert raised_on_purpose(failed.value)
