"""Pieces of `benchmarks/gpu_check.py`: peak GPU memory per phase of a GRPO step, the memory plan's figure for each
phase, parts run in child processes under a time cap, and the entries written as one JSON and one markdown table.

The phases are those of one optimizer step on one GPU: generation (TRL's `_generate_and_score_completions`: the
rollout, its rewards and any log-prob pass over it), the training forward and backward of each micro-batch, the
optimizer step; and the evaluation, a process of its own. Each phase's peak is `torch.cuda.max_memory_allocated`
after `torch.cuda.reset_peak_memory_stats` at its start, so a peak includes what stays allocated through the phase
(weights, optimizer states), as the plan's phase totals do. Without CUDA nothing is measured: the phases are
counted (so the dry run shows the hooks fire) and their figures stay `None`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import REPO, markdown_table

GiB = 2**30
STEP_PHASES = ("generation", "train", "optimizer")
# The seed's evaluation on the PyTRIO sampling service (its write-up, "5. How do I evaluate the base model and
# checkpoint?"): 100 test questions, seed 42, temperature 0.0, 1,024 max tokens, concurrent `sample_async()` calls on
# one sampler; "Base 71.0% 75.0% 2.20 sample/s 48.65s" ("Sampling speed and time depend on the service conditions at
# the time and document this run only").
SEED_SAMPLES_PER_S = 2.20
SEED_EVAL_NOTE = "the seed's eval.py on its sampling service, base model: 100 questions, 1,024 max tokens, 48.65 s"
EVAL_CAPS = {"hf": 120, "vllm": 120}  # seconds: the estimates in benchmarks/gpu_check.py
TABLE_COLUMNS = ("part", "figure", "measured", "reference", "ratio", "note")


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class PhasePeaks:
    """Peak GPU memory (GiB) per phase, the largest over the phase's repetitions; phases counted on any device."""

    def __init__(self) -> None:
        self.peaks: dict[str, float | None] = {}
        self.calls: Counter[str] = Counter()

    def begin(self) -> None:
        if cuda():
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def end(self, phase: str) -> None:
        self.calls[phase] += 1
        if not cuda():
            self.peaks.setdefault(phase, None)
            return
        import torch

        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / GiB
        self.peaks[phase] = max(peak, self.peaks.get(phase) or 0.0)


def phase_measured_trainer(peaks: PhasePeaks) -> type:
    """A thin subclass of our trainer that marks the phase boundaries: generation inside `training_step` (TRL
    generates in `_prepare_inputs` on the first micro-step of each generation batch), the rest of `training_step`
    (forward and backward), and the optimizer step between transformers' `on_pre_optimizer_step` and
    `on_optimizer_step` callbacks."""
    from transformers import TrainerCallback

    from vision_grpo.training.trainer import VisionGRPOTrainer

    class OptimizerPhase(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            peaks.begin()

        def on_optimizer_step(self, args, state, control, **kwargs):
            peaks.end("optimizer")

    class PhaseMeasuredTrainer(VisionGRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.add_callback(OptimizerPhase())

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            peaks.begin()
            loss = super().training_step(*args, **kwargs)
            peaks.end("train")
            return loss

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            peaks.begin()
            output = super()._generate_and_score_completions(inputs)
            peaks.end("generation")
            peaks.begin()  # the forward and backward that follow in this training_step count from here
            return output

    return PhaseMeasuredTrainer


def card_bytes() -> int | None:
    if not cuda():
        return None
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def step_plan_phases(plan: Any, card: int | None) -> dict[str, float]:
    """The plan's figure (GiB) for each phase of a GRPO step: generation is its largest HF-generation phase (encode,
    prefill, decode), train its training phase (weights, states, gradients, activations, log-probs), the optimizer
    step what lasts through both plus the gradients (the plan has no optimizer phase of its own; AdamW's temporary
    buffers are not in it). Colocated vLLM adds its share of the card to each, where there is a card."""
    from vision_grpo.plan.parts import GENERATION

    share = plan.vllm_share * card if card else 0.0
    generation = max(plan.phase_total(phase) for phase in GENERATION)
    states = sum(p.bytes for p in plan.parts if p.phase == "both" or p.name == "gradients")
    figures = {"generation": generation, "train": plan.phase_total("train"), "optimizer": states}
    return {phase: (value + share) / GiB for phase, value in figures.items()}


def eval_plan_gib(plan: Any) -> float:
    """The plan's figure (GiB) for the evaluator: the weights plus the largest phase of the HF-generation parts of a
    plan whose micro-batch is the evaluation's batch, each prompt on its own (no training parts: nothing trains)."""
    from vision_grpo.plan.parts import GENERATION

    (weights,) = [p for p in plan.parts if p.name.startswith("weights (")]
    generating = [p for p in plan.parts if p.phase in ("generation", "generate", *GENERATION)]
    largest = max(sum(p.bytes for p in generating if plan.in_phase(p, phase)) for phase in GENERATION)
    return (weights.bytes + largest) / GiB


@dataclass
class PartRun:
    """One part of the check as it went: its cap, its wall seconds, and the reason when it gave no figures."""

    cap_s: float
    wall_s: float | None = None
    skipped: str | None = None


def run_part(script: Path, stage: str, arguments: dict[str, Any], cap_s: float) -> tuple[dict[str, Any], PartRun]:
    """Run one stage of `script` in a fresh process (so GPU-memory figures never mix), its figures coming back on its
    last `STAGE` line. A stage past `cap_s` is killed with its process group (vLLM's engine included) and recorded
    as skipped, as is a stage that fails: the check goes on to the next part and still writes its files."""
    record = PartRun(cap_s=round(cap_s, 1))
    command = [sys.executable, str(script), "--stage", stage, "--stage-args", json.dumps(arguments)]
    start = time.perf_counter()
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True, **pipes)
    try:
        stdout, stderr = process.communicate(timeout=cap_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        record.wall_s, record.skipped = round(time.perf_counter() - start, 1), f"ran past its cap of {cap_s:.0f} s"
        return {}, record
    record.wall_s = round(time.perf_counter() - start, 1)
    lines = [line for line in stdout.splitlines() if line.startswith("STAGE ")]
    if process.returncode != 0 or not lines:
        last = [line for line in stderr.splitlines() if line.strip()][-1:] or ["no output"]
        record.skipped = f"failed (exit {process.returncode}): {last[0][-300:]}"
        print(f"stage {stage} failed:\n{stderr[-4000:]}", file=sys.stderr)
        return {}, record
    return json.loads(lines[-1][len("STAGE ") :]), record


class Budget:
    """The whole check's time limit: each part runs for at most its own cap and what is left of the budget."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds
        self.parts: dict[str, PartRun] = {}

    def run(self, name: str, cap_s: float, work: Callable[[float], tuple[dict[str, Any], PartRun]]) -> dict[str, Any]:
        left = self.deadline - time.perf_counter()
        if left < min(cap_s, 30):
            self.parts[name] = PartRun(cap_s=cap_s, skipped=f"{left:.0f} s left of the time budget")
            return {}
        figures, self.parts[name] = work(min(cap_s, left))
        return figures

    def skip(self, name: str, cap_s: float, reason: str) -> None:
        self.parts[name] = PartRun(cap_s=cap_s, skipped=reason)

    def reason(self, name: str) -> str | None:
        return self.parts[name].skipped

    def as_json(self) -> dict[str, Any]:
        return {name: asdict(part) for name, part in self.parts.items()}


def entry(part: str, figure: str, measured: Any, reference: Any, note: str) -> dict[str, Any]:
    """One row: a measured figure beside its reference (the plan, the other path, the seed) and their ratio."""
    numbers = isinstance(measured, (int, float)) and isinstance(reference, (int, float)) and reference
    ratio = round(measured / reference, 3) if numbers else None
    rounded = [round(value, 3) if isinstance(value, float) else value for value in (measured, reference)]
    return dict(zip(TABLE_COLUMNS, [part, figure, *rounded, ratio, note], strict=True))


def memory_note(measured: float | None, runs: int | None = None) -> str:
    if measured is not None:
        return "reference: the plan; measured: torch.cuda.max_memory_allocated"
    ran = f" (the phase ran {runs} time(s))" if runs is not None else ""
    return f"reference: the plan; measured: none, no GPU{ran}"


def skipped(key: str, budget: Budget) -> str:
    return f"skipped ({key}): {budget.reason(key)}"


def largest_peak(step: dict[str, Any]) -> float | None:
    peaks = list(step["peak_gib"].values())
    return None if None in peaks else max(peaks)


def step_entries(step: dict[str, Any], labels: dict[str, str], budget: Budget) -> list[dict[str, Any]]:
    """Memory per phase of each variant of the seed step (`labels`: part name -> label), then what TRL's training
    pass, sharing the copies and vLLM change against the shared HF step (`train_hf`), as table rows."""
    rows = []
    for key, label in labels.items():
        for phase in STEP_PHASES:
            part, figure, figures = f"memory, seed step, {label}", f"{phase} peak GiB", step.get(key)
            if figures is None:
                rows.append(entry(part, figure, None, None, skipped(key, budget)))
                continue
            measured, runs = figures["peak_gib"][phase], figures["phase_calls"][phase]
            rows.append(entry(part, figure, measured, figures["plan_gib"][phase], memory_note(measured, runs)))
    sharing, vllm = "vision sharing, seed step", "vLLM colocate vs HF generation, seed step"
    packed = "training pass, seed step"
    for key, part, figure, read, note in (
        ("train_hf_trl_pass", packed, "s/step, TRL's pass / packed", lambda f: f["s_per_step"], "TRL's step_time"),
        ("train_hf_trl_pass", packed, "train peak GiB, TRL's pass / packed", lambda f: f["peak_gib"]["train"], ""),
        ("train_hf_per_copy", sharing, "s/step, every copy / shared", lambda f: f["s_per_step"], "TRL's step_time"),
        ("train_hf_per_copy", sharing, "peak GiB, every copy / shared", largest_peak, "largest phase peak"),
        ("train_vllm", vllm, "s/step, vLLM / HF", lambda f: f["s_per_step"], "TRL's step_time"),
    ):
        missing = [k for k in (key, "train_hf") if step.get(k) is None]
        if missing:
            rows.append(entry(part, figure, None, None, skipped(missing[0], budget)))
            continue
        measured = read(step[key])
        note += "" if measured is not None else "; measured: none, no GPU"
        rows.append(entry(part, figure, measured, read(step["train_hf"]), note))
    return rows


def eval_entries(name: str, evals: dict[str, Any], budget: Budget, tokens: int) -> list[dict[str, Any]]:
    """Samples/s of each backend against the seed's 2.20, and the HF evaluator's peak against the plan."""
    rows = []
    for backend in EVAL_CAPS:
        part, figures = f"GeoQA evaluation, {name}, {backend}", evals.get(backend)
        if figures is None:
            rows.append(entry(part, "samples/s vs the seed's", None, None, skipped(f"eval_{backend}:{name}", budget)))
            continue
        here = f"{figures['items']} questions, {tokens} new tokens, {figures['hit_limit_rate']:.0%} at the limit"
        note = f"{SEED_EVAL_NOTE}; here {here}"
        rows.append(entry(part, "samples/s vs the seed's", figures["samples_per_s"], SEED_SAMPLES_PER_S, note))
    part, hf = f"memory, GeoQA evaluation, {name}, hf", evals.get("hf")
    if hf is None:
        rows.append(entry(part, "evaluation peak GiB", None, None, skipped(f"eval_hf:{name}", budget)))
    else:
        rows.append(entry(part, "evaluation peak GiB", hf["peak_gib"], hf["plan_gib"], memory_note(hf["peak_gib"])))
    return rows


def cell(value: Any) -> str:
    """A table cell: `-` for no figure; `|` escaped so that a reason cannot split its row."""
    return "-" if value is None else str(value).replace("|", "\\|")


def markdown(title: str, entries: list[dict[str, Any]]) -> str:
    """The entries as one table, a row each, its cells the JSON's values as written there."""
    rows = [[cell(row[key]) for key in TABLE_COLUMNS] for row in entries]
    return f"# {title}\n\n{markdown_table(TABLE_COLUMNS, rows)}\n"


def write_outputs(out: Path, result: dict[str, Any], title: str) -> tuple[Path, Path]:
    """`gpu_check.json` (everything) and `gpu_check.md` (its entries, one row each) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "gpu_check.json", out / "gpu_check.md"
    paths[0].write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(title, result["entries"]), encoding="utf-8")
    return paths
