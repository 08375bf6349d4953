"""A memory plan as printed: its parts (bytes, the phase each lasts through, the recipe key that changes it first),
the peak per GPU rank over training and generation's phases, and the cards it fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3


CARDS_GIB = (24, 48, 80, 141)


# HF generate's phases, one after the other: the vision tower encodes every image of the call, the prefill runs the
# prompts (their cache built), the decoding grows the cache by the completions. "generate" parts last through the
# prefill and the decoding; "generation" parts last through all three.
GENERATION = ("encode", "prefill", "decode")


PHASES = ("train", *GENERATION)


# The plan's error as measured: each part checked against real and fake tensors on CPU came within 20% of the
# plan (0.92-1.09 of it, `tests/test_plan.py`, `tests/test_prefill_plan.py`, docs/memory.md); no GPU has checked
# the whole against `torch.cuda.max_memory_allocated` yet (`benchmarks/gpu_check.py` does).
PLAN_ERROR = 0.20


@dataclass
class Part:
    name: str
    bytes: float
    phase: str  # "both", "train" (forward + backward of one micro-batch), a GENERATION phase, or "generation"
    key: str  # the recipe key that changes it first
    note: str = ""
    counted: bool = False  # counted from the parameters (weights, gradients, optimizer states), not estimated


@dataclass
class Plan:
    model: str
    sizes: str
    parts: list[Part] = field(default_factory=list)
    vllm_share: float = 0.0  # vllm_gpu_memory_utilization of colocated vLLM: a share of whatever card it runs on
    notes: list[str] = field(default_factory=list)  # printed after the parts: what the plan knows beyond memory

    def in_phase(self, part: Part, phase: str) -> bool:
        return (
            part.phase in ("both", phase)
            or (part.phase == "generate" and phase in ("prefill", "decode"))
            or (part.phase == "generation" and phase in GENERATION)
        )

    def phase_total(self, phase: str) -> float:
        return sum(p.bytes for p in self.parts if self.in_phase(p, phase))

    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_total)

    def total(self, card_bytes: float | None = None) -> float:
        """Peak per rank: the largest phase, training or one of generation's (plus vLLM's share of the card)."""
        peak = self.phase_total(self.peak_phase())
        return peak + (self.vllm_share * card_bytes if card_bytes else 0.0)

    def fits(self, card_bytes: float) -> bool:
        return self.verdict(card_bytes) == "fits"

    def verdict(self, card_bytes: float) -> str:
        """`fits` (even if the estimated parts are `PLAN_ERROR` low), `does not fit` (even if they are that much
        high), or `may not fit` in between. Parts counted from the parameters (and vLLM's share) are exact; the
        others are estimates checked on CPU, each within `PLAN_ERROR` of what it measured."""
        phase = self.peak_phase()
        error = PLAN_ERROR * sum(p.bytes for p in self.parts if self.in_phase(p, phase) and not p.counted)
        total = self.total(card_bytes)
        if total - error > card_bytes:
            return "does not fit"
        return "may not fit" if total + error > card_bytes else "fits"

    def first_key(self, card_bytes: float | None = None) -> str:
        """The recipe key to change first: the one of the largest part of the phase that sets the peak."""
        phase = self.peak_phase()
        candidates = [p for p in self.parts if self.in_phase(p, phase)]
        if self.vllm_share and card_bytes:
            candidates.append(Part("vLLM", self.vllm_share * card_bytes, "both", "vllm_gpu_memory_utilization"))
        return max(candidates, key=lambda p: p.bytes).key

    def lines(self) -> list[str]:
        """The plan as printed: one line per part, the total, and the cards it fits."""
        out = [f"memory plan for {self.model} ({self.sizes}), per GPU rank:"]
        for p in self.parts:
            out.append(f"  {p.name:<44} {p.bytes / GiB:7.2f} GiB  [{p.phase}]  {p.note}".rstrip())
        phases = [
            p for p in PHASES if any(part.phase in (p, "generate", "generation") for part in self.parts) or p == "train"
        ]
        totals = ", ".join(f"{p} {self.phase_total(p) / GiB:.2f}" for p in phases)
        out.append(f"  {f'peak ({self.peak_phase()} phase)':<44} {self.total() / GiB:7.2f} GiB  phases: {totals} GiB")
        if self.vllm_share:
            out.append(f"  + colocated vLLM: vllm_gpu_memory_utilization {self.vllm_share} of the card")
        out += [f"  {note}" for note in self.notes]
        for card in CARDS_GIB:
            verdict = self.verdict(card * GiB)
            if verdict != "fits":
                verdict += f": change `{self.first_key(card * GiB)}` first"
            out.append(f"  {card:>3} GiB card: {self.total(card * GiB) / GiB:6.2f} GiB, {verdict}")
        return out
