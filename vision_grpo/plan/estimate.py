"""Building the memory plan of a recipe: the model's config only (never its weights), its parameters counted on the
meta device, and the per-part formulas of vision_grpo/plan/formulas.py applied to the recipe's sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from vision_grpo.models.gated_deltanet import GatedDeltaNetPath, gated_deltanet_path
from vision_grpo.plan import formulas as mf
from vision_grpo.plan.parts import GiB, Part, Plan
from vision_grpo.plan.zero import NO_DEEPSPEED, Zero, model_state_parts, zero_of_accelerate_config
from vision_grpo.recipe.arguments import RecipeError

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"
DEFAULT_PROMPT_TEXT_TOKENS = 256  # an assumption, printed with the plan: system prompt + question, without images
DEFAULT_IMAGE_PIXELS = 1003520  # transformers' Qwen2-VL image processor cap, used when a recipe sets no max_pixels
# The GeoQA seed's measured mean completion (tokens): what a packed group's training forward holds per completion.
DEFAULT_EXPECTED_COMPLETION = 279


def model_config(name: str) -> Any:
    """The transformers config of `name`, never its weights: a local folder, a shipped copy, or the HF cache."""
    from transformers import AutoConfig

    from vision_grpo.models.embedded import EMBEDDED_MODELS, resolve_model_path

    if name in EMBEDDED_MODELS or Path(name).expanduser().is_dir():
        return AutoConfig.from_pretrained(resolve_model_path(name))
    shipped = SHIPPED_CONFIGS / f"{name.replace('/', '--')}.json"
    if shipped.is_file():
        return AutoConfig.from_pretrained(shipped)
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as error:
        raise RecipeError(
            f"memory plan: no config for model `{name}` (not a local folder, not in {SHIPPED_CONFIGS}, not in the "
            f"Hugging Face cache): download its config.json or pass a local folder ({error})"
        ) from None


@contextlib.contextmanager
def _without_zero3_init() -> Iterator[None]:
    """Under a ZeRO-3 launch transformers partitions and initialises every model it builds, which fails on the meta
    device ("Cannot copy out of meta tensor"); counting parameters needs the plain module tree, so the HF DeepSpeed
    config is set aside (transformers keeps it as a module-level reference) while it is built."""
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def parameter_counts(config: Any, lora_rank: int, lora_on_vision: bool, targets: list[str] | None) -> dict[str, int]:
    """Parameters of the whole model, of its vision tower and of the LoRA adapters, counted on the meta device."""
    from transformers import AutoModelForImageTextToText

    from vision_grpo.models.vision import is_vision_parameter

    with torch.device("meta"), _without_zero3_init():
        model = AutoModelForImageTextToText.from_config(config)
    output = model.get_output_embeddings()
    counts = {"total": sum(p.numel() for p in model.parameters()), "vision": 0, "lora": 0}
    # ZeRO-3 gathers one module's own parameters at a time; DeepSpeed's estimator takes the largest
    counts["largest"] = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    counts["vision"] = sum(p.numel() for n, p in model.named_parameters() if is_vision_parameter(n))
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        if is_vision_parameter(name) and not lora_on_vision:
            continue
        if targets and name.rsplit(".", 1)[-1] not in targets:
            continue
        counts["lora"] += lora_rank * (module.in_features + module.out_features)
    return counts


def accelerate_layout(path: str | None, num_processes: int | None) -> tuple[int, Zero]:
    """(processes, DeepSpeed layout) from an accelerate config file; `--num_processes` wins over the file."""
    zero, processes = Zero(), 1
    if path:
        content = accelerate_config(Path(path))
        zero = zero_of_accelerate_config(content, path)
        if content.get("distributed_type") != "NO":
            processes = _config_int(path, "num_processes", content.get("num_processes", 1), 1)
    return (num_processes or processes), zero


def accelerate_config(path: Path) -> dict[str, Any]:
    """The accelerate config file as a mapping, or a RecipeError naming `--accelerate_config` and the file."""
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise RecipeError(
            f"--accelerate_config {path}: cannot read it ({error.strerror}); pass a config file, e.g. "
            "accelerate_configs/ddp.yaml"
        ) from None
    except yaml.YAMLError as error:
        raise RecipeError(f"--accelerate_config {path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(content, dict):
        raise RecipeError(
            f"--accelerate_config {path} must be a mapping of keys to values (as `accelerate config` writes it), "
            f"got {type(content).__name__}"
        )
    return content


def _config_int(path: str, key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RecipeError(f"--accelerate_config {path}: {key} must be an integer of at least {low}, got {value!r}")
    return value


def image_pixels(task_args: Any, override: int | None) -> tuple[int, str]:
    """Pixels per image and where that figure came from."""
    if override is not None:
        return override, "--image_pixels"
    if task_args.task == "shapes" and not (task_args.max_pixels and task_args.max_pixels < task_args.shapes_canvas**2):
        return task_args.shapes_canvas**2, f"shapes_canvas {task_args.shapes_canvas}px"
    if task_args.max_pixels:
        return task_args.max_pixels, "max_pixels"
    return DEFAULT_IMAGE_PIXELS, "no max_pixels in the recipe: transformers' default cap; set max_pixels"


def build_plan(
    task_args: Any,
    training_args: Any,
    model_args: Any,
    num_processes: int = 1,
    zero: Zero = NO_DEEPSPEED,
    pixels: int | None = None,
    prompt_text_tokens: int = DEFAULT_PROMPT_TEXT_TOKENS,
    images_per_prompt: int = 1,
    generation_batch_set: bool = False,
    deltanet: GatedDeltaNetPath | None = None,
    expected_completion: int = DEFAULT_EXPECTED_COMPLETION,
    dead_group_share: float = 0.0,
) -> Plan:
    """The plan of one recipe (its three parsed dataclasses) on `num_processes` ranks laid out as `zero`. Qwen3.5's
    Gated DeltaNet layers are counted on the `deltanet` path; None: the path they take on this machine.

    With `share_prompt_in_training` a micro-batch holds whole groups, each packed as one row of its prompt and its
    completions (vision_grpo/models/shared_prompt.py), cut to their lengths: the train phase counts
    `expected_completion` tokens per completion (a group whose completions all reach the limit needs more: the
    activations' note says how much). `dead_group_share` (groups whose rewards are all equal, left out of the
    training pass) changes the training tokens per step, not the peak of a micro-batch."""
    config = model_config(model_args.model_name_or_path)
    if getattr(config, "vision_config", None) is None:
        raise RecipeError(
            f"memory plan: {model_args.model_name_or_path} is a text-only model ({type(config).__name__}, no "
            "vision_config): these recipes train vision-language models; set model_name_or_path to a Qwen-VL one"
        )
    shape = mf.shape_of(config)
    peft = bool(model_args.use_peft)
    rank = model_args.lora_r if peft else 0
    counts = parameter_counts(config, rank, task_args.lora_on_vision, model_args.lora_target_modules)
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(model_args.dtype), 2)
    vision_trains = (peft and task_args.lora_on_vision) or (not peft and task_args.vision_tower != "freeze")
    trainable = counts["lora"] if peft else counts["total"] - (0 if vision_trains else counts["vision"])

    pixels, pixels_from = image_pixels(task_args, pixels)
    patches, image_tokens = mf.image_tokens(shape, pixels)
    batch, completion = training_args.per_device_train_batch_size, training_args.max_completion_length
    prompt = prompt_text_tokens + images_per_prompt * image_tokens
    group = training_args.num_generations
    packed = bool(task_args.share_prompt_in_training)
    expected = min(expected_completion, completion) if packed else completion
    groups = -(-batch // group)  # whole groups per micro-batch (training_pass.py)
    tokens = groups * (prompt + group * (1 + expected)) if packed else batch * (prompt + completion)
    worst = groups * (prompt + group * (1 + completion)) if packed else tokens
    scored = groups * group * expected if packed else batch * completion
    if generation_batch_set:
        generated = training_args.generation_batch_size // num_processes
    else:
        generated = batch * training_args.steps_per_generation
    # With `share_prompt_copies` the tower encodes a prompt's G copies once (vision_grpo/models/shared_vision.py):
    # TRL's sampler keeps the copies together, so n sequences hold ceil(n / G) distinct prompts.
    share = task_args.share_prompt_copies
    distinct_generated, distinct_batch = (
        (-(-n // training_args.num_generations) if share else n) for n in (generated, batch)
    )

    path_from = "--gated_deltanet_path" if deltanet else "detected here"
    deltanet = deltanet or gated_deltanet_path()
    if packed:
        step = round((1 - dead_group_share) * tokens * training_args.steps_per_generation)
        micro = (
            f"micro-batch {groups} group(s) of {group}, each packed as {prompt} prompt [{image_tokens} image tokens "
            f"at {pixels} px, {pixels_from}; {prompt_text_tokens} text, assumed] + {group} x (1 + {expected} "
            f"completion, expected; limit {completion}) = {tokens} tokens; {step} training tokens per generation "
            f"batch with {dead_group_share:.0%} of groups without signal"
        )
    else:
        micro = (
            f"micro-batch {batch} x ({prompt} prompt [{image_tokens} image tokens at {pixels} px, {pixels_from}; "
            f"{prompt_text_tokens} text, assumed] + {completion} completion) tokens"
        )
    plan = Plan(
        model=model_args.model_name_or_path,
        sizes=f"{micro}, {generated} sequences generated at once, {num_processes} process(es), {zero.describe()}"
        + (f", Gated DeltaNet layers: {deltanet} ({path_from})" if "linear_attention" in shape.layer_types else ""),
    )
    states = model_state_parts(counts, trainable, str(model_args.dtype), dtype_bytes, peft, num_processes, zero)
    plan.parts.extend(dataclasses.replace(part, counted=True) for part in states)  # exact, not estimated
    if zero.stage == 3 and not training_args.use_vllm and training_args.ds3_gather_for_generation:
        # TRL's `unwrap_model_for_generation` gathers every ZeRO-3 shard for HF generation
        gathered = counts["total"] * dtype_bytes * (1 - (0 if zero.offload_param else 1) / num_processes)
        plan.parts.append(Part("weights gathered for generation", gathered, "generation", "ds3_gather_for_generation"))

    layers = [mf.text_layer_bytes_per_token(shape, t, rank, i == 0, deltanet) for i, t in enumerate(shape.layer_types)]
    gc = bool(training_args.activation_checkpointing)

    def activations(n: int, checkpointing: bool) -> float:
        if checkpointing:
            return len(layers) * n * shape.hidden * mf.BF16 + max(layers) * n
        return sum(layers) * n + counts["lora"] * mf.BF16  # + autocast's bf16 copies of the adapters

    worst_note = f"; completions all at the limit: {activations(worst, gc) / GiB:.2f} GiB" if worst > tokens else ""
    plan.parts.append(
        Part(
            f"activations ({'with' if gc else 'without'} activation checkpointing)",
            activations(tokens, gc),
            "train",
            "per_device_train_batch_size" if gc else "activation_checkpointing",
            f"{'without' if gc else 'with'} it: {activations(tokens, not gc) / GiB:.2f} GiB{worst_note}",
        )
    )
    if packed:  # sdpa's boolean block mask and the bf16 bias it becomes
        length = tokens // groups
        plan.parts.append(Part("packed rows' block mask", groups * length**2 * (1 + mf.BF16), "train", "max_pixels"))
    if vision_trains:
        vision_patches = distinct_batch * images_per_prompt * patches
        block = mf.vision_block_bytes_per_patch(shape, rank)
        vision = (
            shape.vision_depth * vision_patches * shape.vision_hidden * mf.BF16 + block * vision_patches
            if gc
            else shape.vision_depth * block * vision_patches
        )
        plan.parts.append(Part(f"vision tower activations ({vision_patches} patches)", vision, "train", "max_pixels"))
    elif share and zero.stage != 3 and not training_args.use_vllm:  # the step's features, kept for its later passes
        kept = distinct_generated * images_per_prompt * image_tokens * mf.cached_bytes_per_image_token(shape)
        plan.parts.append(
            Part(f"vision features kept for the step ({distinct_generated} prompts)", kept, "both", "max_pixels")
        )
    kept, transient = mf.head_bytes(shape, scored, lm_head_trains=not peft)
    plan.parts.append(
        Part(
            f"log-probs: TRL fused head, vocabulary {shape.vocab}",
            kept + transient,
            "train",
            "per_device_train_batch_size",
            f"kept {kept / GiB:.2f} + tile and backward {transient / GiB:.2f}; full logits would be "
            f"{batch * (prompt + completion) * shape.vocab * mf.FP32 / GiB:.1f} GiB in float32",
        )
    )
    if training_args.use_vllm and training_args.vllm_mode == "colocate":
        plan.vllm_share = training_args.vllm_gpu_memory_utilization
    elif not training_args.use_vllm:
        # HF generation with `share_prompt_copies`: the tower encodes each distinct image once and, without LoRA
        # dropout, the prefill runs once per distinct prompt, its cache then copied to the G rows - or, with
        # `share_decode_cache`, kept once per prompt and expanded by one layer at a time while it attends
        # (vision_grpo/models/shared_prefill.py); the float32 pixel patches of every copy (TRL's inputs) stay alive.
        prefilled = distinct_generated if share and not (peft and model_args.lora_dropout > 0) else generated
        once = prefilled < generated and task_args.share_decode_cache
        state = generated * mf.linear_state_bytes_per_sequence(shape)
        kv = mf.kv_cache_bytes_per_token(shape)
        prompts, completions = (prefilled if once else generated) * prompt * kv, generated * completion * kv
        key, why = "steps_per_generation", "fewer sequences per generate call (or use_vllm)"
        held = f"{prefilled} prompts once" if once else f"{generated} sequences"
        plan.parts.append(Part(f"generation cache, prompts ({held})", prompts + state, "generate", key, why))
        plan.parts.append(Part("generation cache, completions", completions, "decode", key, why))
        if once:
            full_layers = sum(t == "full_attention" for t in shape.layer_types)
            expanded = generated * (prompt + completion) * kv / max(1, full_layers)
            plan.parts.append(Part("decode: one layer's prompt cache expanded to its rows", expanded, "decode", key))
        pixels = 3 * shape.temporal_patch * shape.patch**2
        copied_pixels = (distinct_generated if prefilled < generated else 0) * mf.FP32 * pixels  # the prefill's rows
        per_patch = (
            generated * mf.FP32 * pixels
            + copied_pixels
            + (prefilled - distinct_generated) * mf.BF16 * pixels  # bf16 casts of copies the tower skips
            + distinct_generated * mf.vision_prefill_bytes_per_patch(shape)
        )
        encode = images_per_prompt * patches * per_patch
        plan.parts.append(
            Part(
                f"vision tower, encoding the call's images ({distinct_generated} distinct of {generated})",
                encode,
                "encode",
                "max_pixels",
            )
        )
        image_bytes = images_per_prompt * image_tokens * mf.image_bytes_per_image_token(shape)
        others = images_per_prompt * patches * ((generated - prefilled) * mf.FP32 * pixels + copied_pixels)
        language = prefilled * (mf.prefill_bytes_per_sequence(shape, prompt, peft, deltanet) + image_bytes) + others
        language += counts["lora"] * mf.BF16  # + autocast's bf16 copies of the adapters
        plan.parts.append(
            Part(
                f"generation prefill (language model, {prefilled} of {generated} sequences)",
                language,
                "prefill",
                "steps_per_generation",
            )
        )
    rounds = task_args.dynamic_sampling_rounds
    if rounds:
        extra = mf.expected_extra_groups(dead_group_share, rounds)
        plan.notes.append(
            f"dynamic sampling: up to {rounds} more generate calls a step, each no larger than the first (the "
            f"memory above is per call); with {dead_group_share:.0%} of groups without signal (--dead_group_share), "
            f"{extra:.0%} more groups generated on average, in {rounds} call(s) at most: that much more generation "
            "time where a call's time follows its groups (vLLM), less where it follows its longest completion (HF)"
        )
    return plan
