"""The evaluation's own options (`EvalArguments`), parsed with the recipe's by `eval/evaluate.py` and
`eval/pass_at_k.py`; everything else (model, data, prompt, pixels) comes from the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IMAGE_CONTROLS = ("none", "blank", "shuffled")


BACKENDS = ("hf", "vllm")


@dataclass
class EvalArguments:
    """Evaluation options; everything else (model, data, prompt, pixels) comes from the recipe."""

    output: str = field(default="results/eval.json", metadata={"help": "Result JSON (written atomically)."})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter or checkpoint folder to apply."})
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "Merge the adapter into the weights (faster; vLLM backend: instead of vLLM's LoRA)."},
    )
    batch_size: int = field(default=8, metadata={"help": "Prompts generated together (left padding)."})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "Default: the recipe's max_completion_length (GeoQA recipes: 1024)."}
    )
    limit: int | None = field(default=None, metadata={"help": "Evaluate only the first N examples."})
    resume: bool = field(default=False, metadata={"help": "Continue from `<output>.partial.jsonl`."})
    overwrite: bool = field(
        default=False, metadata={"help": "Replace an existing `<output>` and drop an interrupted run's records."}
    )
    image_control: str = field(
        default="none", metadata={"help": "`none`, `blank` (white canvas) or `shuffled` (another item's image)."}
    )
    bucket_by_length: bool = field(
        default=True, metadata={"help": "Batch prompts of similar length (less padding); false: dataset order."}
    )
    device_map: str | None = field(
        default=None,
        metadata={"help": "`auto`: spread a model too large for one GPU over all (one process). Default: one device."},
    )
    backend: str = field(
        default="hf",
        metadata={"help": "`hf` (transformers generate) or `vllm` (needs vLLM): the same prompts, records, summary."},
    )
    write_held_out: str | None = field(
        default=None,
        metadata={
            "help": "Write the held-out rows for lmms-eval (and a VLMEvalKit TSV for GeoQA) into this folder and "
            "stop; no model is loaded (docs/evaluation.md)."
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "vLLM backend: processes that share one engine (tensor parallel); it must divide the number of "
            "processes, and each group of this many evaluates its own share of the rows."
        },
    )

    def __post_init__(self) -> None:
        if self.image_control not in IMAGE_CONTROLS:
            raise ValueError(f"image_control must be one of {IMAGE_CONTROLS}, got {self.image_control!r}")
        for name in ("batch_size", "max_new_tokens", "limit", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map must be `auto` or unset, got {self.device_map!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError(
                f"--tensor_parallel_size {self.tensor_parallel_size} splits a vLLM engine: pass --backend vllm "
                "(the HF backend holds one whole model per process)"
            )
        if self.resume and self.overwrite:
            raise ValueError("--resume keeps an interrupted run's records and --overwrite drops them: pass one")
