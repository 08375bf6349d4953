"""Shared pieces of the benchmark scripts: offline environment, measured subprocesses, per-step times, tables.

Every figure is measured side by side in one invocation and reported as medians and ratios, because the machines
this runs on are shared: absolute seconds move with the load, ratios of interleaved runs much less.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "shapes" / "tiny_cpu.yaml"
# Nothing may reach the network; tokenizers' thread pool would compete with torch's for the same cores.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(OFFLINE_ENV)


def child_figures(work: Callable[..., dict[str, Any]], *args: Any, what: str) -> dict[str, Any]:
    """`work(*args)` in a process of its own, forked from this one, and the figures it returns. Its peak memory is
    its own (a forked process's peak RSS starts at what it maps, not at this process's peak) and it starts with this
    process's imports, so a benchmark that imports its libraries before its first child spares each child the
    seconds of importing them again. A failure ends the benchmark naming `what`, after the child's traceback."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            return pool.submit(work, *args).result()
        except Exception as error:  # the child's own, or BrokenProcessPool where it died
            traceback.print_exception(error)
            sys.exit(f"{what} failed (above)")


def real_size_config(published: str, replica: str) -> Any:
    """The config `published` (a copy of a Hub config.json in vision_grpo/plan/model_configs/, the one the memory plan
    reads) in the class of the embedded replica `replica`, with the replica's token ids: the replica's tokenizer,
    template and processor then drive a model of the real dimensions (random weights, nothing downloaded; every id
    of the replica's tokenizer lies inside the real vocabulary)."""
    text, vision, ids = _published(published, replica)
    return _config(ids, text, vision)


def scaled_config(published: str, replica: str, width: int, depth: int) -> Any:
    """`real_size_config` with every width divided by `width` (hidden, MLP and vision widths; heads too, at least
    one, each of the real head size; one key-value head) and every depth by `depth` (layer types and the vision
    tower's full-attention and deepstack layers keep their relative places), and the replica's vocabulary: a model
    whose parts keep the real model's proportions at a size a CPU runs."""
    text, vision, ids = _published(published, replica)
    layers = text["num_hidden_layers"] // depth
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    text.update(_divided(text, ("hidden_size", "intermediate_size", "num_attention_heads"), width))
    text.update(_divided(text, ("linear_num_key_heads", "linear_num_value_heads"), width))
    text.update(num_key_value_heads=1, num_hidden_layers=layers, max_position_embeddings=16384, head_dim=head_dim)
    text["vocab_size"] = ids.text_config.vocab_size
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    vision.update(_divided(vision, ("hidden_size", "intermediate_size", "num_heads"), width))
    vision.update(depth=vision["depth"] // depth, out_hidden_size=text["hidden_size"])
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if key in vision:
            vision[key] = sorted({i // depth for i in vision[key]})
    return _config(ids, text, vision)


def _published(published: str, replica: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The text and vision sections of a shipped Hub config copy, and the replica's config (for its token ids)."""
    from transformers import AutoConfig

    from vision_grpo.models.embedded import resolve_model_path

    real = json.loads((REPO / "vision_grpo/plan/model_configs" / f"{published}.json").read_text())
    text = {**real.get("text_config", real)}  # Qwen2.5-VL's copy keeps the text keys at the top level
    return text, dict(real["vision_config"]), AutoConfig.from_pretrained(resolve_model_path(replica))


def _divided(section: dict[str, Any], keys: tuple[str, ...], by: int) -> dict[str, int]:
    return {key: max(1, section[key] // by) for key in keys if key in section}


def _config(ids: Any, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """A config of the replica's class from `text` and `vision`, with the replica's special-token ids."""
    text.update({key: getattr(ids.text_config, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return type(ids)(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=text.get("tie_word_embeddings", False),
        **{key: getattr(ids, key) for key in tokens},
    )


@dataclass
class Measured:
    """A finished subprocess: exit status, wall seconds, peak resident memory of it and its children, CPU seconds."""

    returncode: int
    wall_s: float
    peak_rss_mib: float
    cpu_s: float
    output: str
    started: float  # epoch seconds just before the start, comparable with TensorBoard's wall times
    cpu_samples: list[tuple[float, float]]  # (epoch seconds, CPU seconds used so far) of the process itself
    rss_samples: list[tuple[float, float]]  # (epoch seconds, VmRSS MiB) of the process itself, every 50 ms

    def cpu_at(self, wall_time: float) -> float:
        """CPU seconds the process had used at epoch time `wall_time`, interpolated between samples."""
        import numpy as np

        times, cpu = zip(*self.cpu_samples, strict=True)
        return float(np.interp(wall_time, times, cpu))

    def rss_at(self, wall_time: float) -> float:
        """VmRSS (MiB) of the last sample taken at or before epoch time `wall_time`: resident memory then, unlike
        the peak, which a long run's growth would hide behind its first start's high-water mark."""
        taken = [rss for when, rss in self.rss_samples if when <= wall_time]
        if not taken:
            raise ValueError(f"no RSS sample at or before {wall_time}: the process started after it")
        return taken[-1]


def _status_mib(pid: int, key: str) -> float | None:
    """A memory figure of process `pid` from /proc/<pid>/status, in MiB; None once the process is gone.

    `VmRSS` is resident memory now. `VmHWM`, unlike `ru_maxrss`, is the high-water mark of the memory image started
    by exec: a child forked from a large parent (a long pytest session) does not report the parent's peak as its own;
    being a high-water mark, a reading taken any time after the peak holds it.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (all its threads), from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_measured(args: Sequence[str], timeout: float = 900, env: dict[str, str] | None = None) -> Measured:
    """Run `python <args>` from the repository root; its own rusage comes from `wait4`, so figures of one child
    never mix with another's (RUSAGE_CHILDREN would keep the largest child of the whole session).

    The child's CPU time is sampled every 50 ms, so CPU seconds per training step can be read off against the
    step times in its logs: on a loaded machine CPU time moves much less than wall time."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"vision-grpo-bench-{os.getpid()}-{time.monotonic_ns()}.log"
    with log.open("w+", encoding="utf-8") as sink:
        started = time.time()
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        samples: list[tuple[float, float]] = [(started, 0.0)]
        rss_samples: list[tuple[float, float]] = []
        peak_mib = 0.0
        while True:
            cpu, rss = _cpu_seconds(process.pid), _status_mib(process.pid, "VmRSS")
            if cpu is not None:
                samples.append((time.time(), cpu))
            if rss is not None:
                rss_samples.append((time.time(), rss))
            peak_mib = max(peak_mib, _status_mib(process.pid, "VmHWM") or 0.0)
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.05)
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
        wall = time.perf_counter() - start
        sink.seek(0)
        output = sink.read()
    log.unlink()
    # Fallback for a child that ended before its first reading: ru_maxrss (KiB on Linux), which can include the
    # memory of the process it was forked from.
    peak_mib = peak_mib or usage.ru_maxrss / 1024
    cpu_total = usage.ru_utime + usage.ru_stime
    return Measured(process.returncode, wall, peak_mib, cpu_total, output, started, samples, rss_samples)


def check(measured: Measured, what: str) -> Measured:
    """Fail with the end of the output when a benchmarked command failed: a failed run has no figures."""
    if measured.returncode != 0:
        raise RuntimeError(f"{what} failed ({measured.returncode}):\n{measured.output[-4000:]}")
    return measured


@dataclass
class StepLog:
    """Per-step figures of one training run, read back from its TensorBoard events."""

    wall_times: list[float]  # epoch seconds at which each step's metrics were logged, in step order
    step_times: list[float]  # TRL's `step_time`: seconds inside `training_step` (generation + backward)
    tokens: list[float]  # TRL's `num_tokens`: prompt and completion tokens seen so far (the work done)

    def step_periods(self) -> list[float]:
        """Wall seconds between consecutive logged steps: everything a step costs (data, callbacks, logging)."""
        return [b - a for a, b in zip(self.wall_times, self.wall_times[1:], strict=False)]

    def first_step_start(self) -> float:
        """Epoch seconds at which the first step began: its log time minus its own duration."""
        return self.wall_times[0] - self.step_times[0]


def read_step_log(run_dir: Path) -> StepLog:
    """Step figures from every TensorBoard event file under `run_dir` (needs `logging_steps: 1`)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    by_step: dict[int, tuple[float, float]] = {}
    tokens: dict[int, float] = {}
    for path in sorted(run_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "train/step_time":
                    by_step[event.step] = (event.wall_time, _scalar(value))
                elif value.tag == "train/num_tokens":
                    tokens[event.step] = _scalar(value)
    if not by_step:
        raise RuntimeError(f"no `train/step_time` events under {run_dir}; is TensorBoard logging on every step?")
    steps = sorted(by_step)
    return StepLog([by_step[s][0] for s in steps], [by_step[s][1] for s in steps], [tokens.get(s) for s in steps])


def _scalar(value: Any) -> float:
    """A TensorBoard scalar, whether written as a simple value or as a tensor (both forms exist)."""
    if value.HasField("tensor"):
        from tensorboard.util import tensor_util

        return float(tensor_util.make_ndarray(value.tensor))
    return float(value.simple_value)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub table; floats with three significant digits (the noise here is larger than that)."""

    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(name: str, figures: dict[str, Any], json_path: str | None) -> None:
    """Print a benchmark's figures as one `RESULT` JSON line (for run_all and tests); also write them if asked, in a
    folder made if missing (`--json results/x.json` on a fresh clone, which has no results/)."""
    print(f"RESULT {name} " + json.dumps(figures, sort_keys=True))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(figures, indent=1, sort_keys=True), encoding="utf-8")


def machine() -> str:
    """CPU count and model, for the README table's 'machine' column."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}"
