"""The model card (README.md) of an exported policy: Hub model-card format, YAML metadata, via huggingface_hub.

Every figure in it is read from a file: the run's manifest (base weights, dataset, steps, git commit), the run's
resolved recipe (its sha256, the rewards and their weights) and, when given, an eval/evaluate.py result (accuracy
with its n, format rate, the decoding config). A figure a file does not hold is written as unknown, never guessed.
A merged LoRA export records the adapter merged into it, as given and by content (`merged_adapter`,
`merged_adapter_weights`): the evaluator then refuses that adapter on this folder, which would count it twice.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from vision_grpo.evaluation.adapters import MERGED_ADAPTER, MERGED_ADAPTER_WEIGHTS, adapter_digest
from vision_grpo.run.locks_and_digests import content_digest

SFT_TRAINER = "SFTTrainer"  # the manifest's `trainer` of a recipes/sft.py run

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ origin }}

## Training

| | |
|---|---|
| Base model | `{{ base }}` (revision `{{ revision }}`) |
| Recipe | `{{ recipe }}` (sha256 of the run's resolved recipe `{{ recipe_sha256 }}`) |
| Dataset | `{{ dataset }}` |
| Training steps | {{ steps }} |
| Rewards (weight) | {{ rewards }} |
| Code | git commit `{{ commit }}` |

Reproduce the run (from that commit):

```bash
{{ train_command }}
```

and this folder:

```bash
{{ export_command }}
```
{% if eval %}
## Evaluation

From `{{ eval.file }}` ({{ eval.backend }} backend, greedy decoding, at most {{ eval.max_new_tokens }} new tokens,
decoding config `{{ eval.decoding_json }}`):

| n | accuracy | format rate |
|---|---|---|
| {{ eval.n }} | {{ eval.accuracy }} | {{ eval.format_rate }} |
{% else %}
## Evaluation

Not evaluated at export: pass `--eval <result of eval/evaluate.py>` to put its figures here.
{% endif %}
## Use

```python
from transformers import AutoModelForImageTextToText, AutoProcessor

model = AutoModelForImageTextToText.from_pretrained("<this folder or repo>")
processor = AutoProcessor.from_pretrained("<this folder or repo>")
```

or `vllm serve <this folder or repo>`. The processor holds the pixel limits the policy was trained with.
"""


def training_steps(adapter: Path, run_dir: Path, manifest: dict[str, Any] | None) -> int | None:
    """A checkpoint's step (its trainer_state.json), else the step the run ended at (its manifest)."""
    state = adapter / "trainer_state.json"
    if adapter != run_dir and state.is_file():
        return json.loads(state.read_text(encoding="utf-8"))["global_step"]
    return (manifest or {}).get("global_step")


def eval_summary(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The figures of a result file the card shows, as that file holds them."""
    summary, metadata = result["summary"], result["metadata"]
    return {
        "file": str(path),
        "n": summary["n"],
        "accuracy": summary["accuracy"],
        "format_rate": summary["format_rate"],
        "backend": metadata.get("backend"),
        "max_new_tokens": metadata.get("max_new_tokens"),
        "decoding": metadata.get("generation_config"),
        "image_control": metadata.get("image_control"),
        "dataset": metadata.get("dataset"),
    }


def write_model_card(
    folder: Path,
    *,
    export_argv: list[str],
    model_args: Any,
    task_args: Any,
    train_args: Any,
    recipe: Path,
    run_dir: Path,
    adapter: Path,
    manifest: dict[str, Any] | None,
    base_identity: dict[str, Any] | None,
    full: bool,
    vision_lora: bool,
    generation_config: bool,
    eval_path: Path | None,
    eval_result: dict[str, Any] | None,
) -> Path:
    """Write `folder/README.md` and return its path."""
    manifest = manifest or {}
    supervised = manifest.get("trainer") == SFT_TRAINER
    if supervised:  # an SFT run trains on target answers: no reward took part
        rewards = {}
    else:
        weights = train_args.reward_weights or [1.0] * len(task_args.reward_funcs)
        rewards = dict(zip(task_args.reward_funcs, weights, strict=True))
    steps = training_steps(adapter, run_dir, manifest)
    train_argv = manifest.get("argv")
    entry = "recipes/sft.py" if supervised else "recipes/train.py"
    train_command = f"python {entry} " + shlex.join(train_argv) if train_argv is not None else "(not recorded)"
    evaluation = eval_summary(eval_path, eval_result) if eval_result is not None else None
    card_data = ModelCardData(
        base_model=model_args.model_name_or_path,
        library_name="transformers",
        pipeline_tag="image-text-to-text",
        tags=["vision-grpo-recipes", "sft" if supervised else "grpo", "full-fine-tune" if full else "lora-merged"],
        base_model_revision=model_args.model_revision,
        base_model_weights=base_identity or manifest.get("model_weights"),
        recipe=manifest.get("recipe") or str(recipe),
        recipe_sha256=content_digest([recipe]),
        dataset=manifest.get("dataset"),
        training_steps=steps,
        rewards=rewards,
        vision_tower_lora_merged=vision_lora,
        git_commit=(manifest.get("git") or {}).get("commit"),
        generation_config_from_base=generation_config,
        eval=evaluation,
        # None (left out of the card) for a full fine-tune: its run holds no adapter.
        **{
            MERGED_ADAPTER: None if full else str(adapter),
            MERGED_ADAPTER_WEIGHTS: None if full else adapter_digest(adapter),
        },
    )
    if full:
        origin = f"Full fine-tune of `{model_args.model_name_or_path}` (run `{adapter}`), re-saved for serving."
    else:
        origin = f"The LoRA adapter `{adapter}` merged into `{model_args.model_name_or_path}`."
        if vision_lora:
            origin += " The adapter had LoRA on the vision tower, merged here as well."
    card = ModelCard.from_template(
        card_data,
        template_str=TEMPLATE,
        title=f"{run_dir.name} ({'full fine-tune' if full else 'merged LoRA'})",
        origin=origin,
        base=model_args.model_name_or_path,
        revision=model_args.model_revision or "not pinned",
        recipe=card_data.recipe,
        recipe_sha256=card_data.recipe_sha256,
        dataset=json.dumps(manifest.get("dataset"), default=str),
        steps=steps if steps is not None else "not recorded",
        rewards=", ".join(f"`{name}` ({weight})" for name, weight in rewards.items()) or "none (supervised)",
        commit=card_data.git_commit or "not recorded",
        train_command=train_command,
        export_command="python -m vision_grpo.export " + shlex.join(export_argv),
        eval={**evaluation, "decoding_json": json.dumps(evaluation["decoding"])} if evaluation else None,
    )
    path = folder / "README.md"
    card.save(path)
    return path
