"""The DeepSpeed layout a run is launched with, and the memory of its model states (weights, gradients, optimizer).

The stage is read from what was really launched: `accelerate launch` hands its settings to the processes through
environment variables (accelerate/utils/launch.py `prepare_deepspeed_cmd_env`), from which transformers'
TrainingArguments build the DeepSpeed plugin (accelerate/utils/dataclasses.py `DeepSpeedPlugin.__post_init__`: stage
2 when none is set, a DeepSpeed JSON file winning over the variables); the plan CLI reads the same fields from an
accelerate config file.

The byte counts follow DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`), which tests/test_plan_zero.py calls and holds every ZeRO stage and offload
of a full fine-tune to, but they are not called here: each returns one total for a model whose every parameter trains
in 16 bits, and a plan needs what they do not model: LoRA (frozen weights with no gradient or optimizer state beside
float32 adapters: every shipped recipe for a Qwen model), float32 weights (no master copy), and the parts one by one,
each with the recipe key that shrinks it, which the plan card prints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vision_grpo.plan import formulas as mf
from vision_grpo.plan.parts import Part
from vision_grpo.recipe.arguments import RecipeError


@dataclass(frozen=True)
class Zero:
    """None for `stage`: no DeepSpeed (DDP or one process; torch AdamW keeps its moments in the weights' dtype)."""

    stage: int | None = None
    offload_optimizer: bool = False  # fp32 master weights, fp32 gradients and Adam moments live in CPU (or NVMe) memory
    offload_param: bool = False  # ZeRO-3 only: the 16-bit weight shards too

    def describe(self) -> str:
        if self.stage is None:
            return "no DeepSpeed"
        offloaded = [n for n, on in (("optimizer", self.offload_optimizer), ("weights", self.offload_param)) if on]
        return f"ZeRO {self.stage}" + (f", {' and '.join(offloaded)} offloaded" if offloaded else "")


NO_DEEPSPEED = Zero()


def _offloaded(device: Any) -> bool:
    return str(device or "none").lower() not in ("none", "")


def zero_of_deepspeed_json(config: Mapping[str, Any] | str, where: str) -> Zero:
    """The layout of a DeepSpeed config (a mapping, or the path of its JSON file): `zero_optimization`'s stage and
    its offload devices."""
    if not isinstance(config, Mapping):
        try:
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise RecipeError(f"{where}: cannot read the DeepSpeed config {config} ({error})") from None
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise RecipeError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return Zero(
        stage,
        _offloaded((zero.get("offload_optimizer") or {}).get("device")),
        stage == 3 and _offloaded((zero.get("offload_param") or {}).get("device")),
    )


def zero_of_accelerate_config(content: Mapping[str, Any], path: str) -> Zero:
    """The layout an accelerate config file launches (`deepspeed_config` of a `distributed_type: DEEPSPEED` file)."""
    if content.get("distributed_type") != "DEEPSPEED":
        return Zero()
    fields = content.get("deepspeed_config") or {}
    if fields.get("deepspeed_config_file"):
        return zero_of_deepspeed_json(fields["deepspeed_config_file"], f"--accelerate_config {path}")
    stage = fields.get("zero_stage", 2)  # accelerate's DeepSpeedPlugin default
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise RecipeError(f"--accelerate_config {path}: zero_stage must be 0, 1, 2 or 3, got {stage!r}")
    return Zero(
        stage,
        _offloaded(fields.get("offload_optimizer_device")),
        stage == 3 and _offloaded(fields.get("offload_param_device")),
    )


def launched_zero(training_args: Any) -> Zero:
    """The layout of this launched process: the DeepSpeed plugin transformers' TrainingArguments built from
    `--deepspeed` or from accelerate's variables (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_ZERO_STAGE`,
    `ACCELERATE_DEEPSPEED_OFFLOAD_*_DEVICE`, `ACCELERATE_DEEPSPEED_CONFIG_FILE`), the one the trainer then uses."""
    plugin = getattr(training_args, "deepspeed_plugin", None)
    if plugin is None:
        return Zero()
    return zero_of_deepspeed_json(plugin.deepspeed_config, "the launched DeepSpeed config")


def model_state_parts(
    counts: Mapping[str, int], trainable: int, dtype: str, dtype_bytes: int, peft: bool, processes: int, zero: Zero
) -> list[Part]:
    """Weights, adapters, gradients and optimizer states per GPU rank, as `zero` shards them.

    Without DeepSpeed: weights in the model's dtype, adapters in float32 (PEFT), and torch AdamW's gradients and
    moments in the trainable parameters' dtype. Under DeepSpeed with 16-bit weights, every trainable parameter has a
    16-bit working copy (adapters cast too), a 16-bit gradient (ZeRO 0-2; ZeRO-3 reduces straight into a float32
    partition), a float32 gradient partition, a float32 master copy and two float32 Adam moments: 2 + 18 / N bytes per
    parameter under ZeRO-2, 18 / N under ZeRO-3 plus the largest layer gathered (4 bytes per parameter)."""
    key = "lora_r" if peft else "use_peft"
    lora, total = counts["lora"], counts["total"]
    if zero.stage is None:
        state = mf.FP32 if peft else dtype_bytes
        parts = [
            Part(
                f"weights ({dtype}, {total / 1e9:.2f} B params)",
                total * dtype_bytes,
                "both",
                "accelerate_config: zero3.yaml",
            )
        ]
        if peft:
            parts.append(Part(f"LoRA parameters (float32, {lora / 1e6:.1f} M)", lora * mf.FP32, "both", "lora_r"))
        parts.append(Part("gradients", trainable * state, "train", key))
        parts.append(Part("AdamW states", 2 * trainable * state, "both", key))
        return parts
    stage, n = zero.stage, processes
    half = dtype_bytes < mf.FP32  # DeepSpeed keeps float32 masters only over 16-bit weights
    weight_shard = n if stage == 3 else 1
    on_gpu = 0.0 if zero.offload_param else 1.0
    offload = "offload_param_device: cpu, " if zero.offload_param else ""
    parts = [
        Part(
            f"weights ({dtype}, {total / 1e9:.2f} B params, {zero.describe()})",
            on_gpu * total * dtype_bytes / weight_shard,
            "both",
            "accelerate_config: zero3.yaml" if stage < 3 else key,
            f"{offload}1/{weight_shard} of them" if stage == 3 else "",
        )
    ]
    if peft:
        parts.append(
            Part(
                f"LoRA working copy ({dtype}, {lora / 1e6:.1f} M)",
                on_gpu * lora * dtype_bytes / weight_shard,
                "both",
                "lora_r",
            )
        )
    optimizer_shard = n if stage >= 1 else 1
    on_gpu = 0.0 if zero.offload_optimizer else 1.0
    where = "offload_optimizer_device: cpu" if zero.offload_optimizer else f"1/{optimizer_shard} of them"
    if stage < 3 and half:
        parts.append(
            Part(
                f"gradients ({dtype})",
                on_gpu * trainable * dtype_bytes / (n if stage == 2 else 1),
                "train",
                key,
                "reduced into the CPU partition" if zero.offload_optimizer else "",
            )
        )
    parts.append(
        Part("gradients (float32 partition)", on_gpu * trainable * mf.FP32 / optimizer_shard, "train", key, where)
    )
    if half:
        parts.append(Part("float32 master weights", on_gpu * trainable * mf.FP32 / optimizer_shard, "both", key, where))
    parts.append(Part("AdamW states (float32)", on_gpu * 2 * trainable * mf.FP32 / optimizer_shard, "both", key, where))
    if stage == 3:
        parts.append(
            Part(
                f"ZeRO-3 largest layer gathered ({counts['largest'] / 1e6:.0f} M params)",
                counts["largest"] * 2 * 2,  # its 16-bit weights and gradients, as DeepSpeed's estimator counts it
                "both",
                "accelerate_config",
            )
        )
    return parts
