"""Ship a trained policy: one standalone model folder that transformers and vLLM load as they load a Hub checkpoint.

    python -m vision_grpo.export --adapter runs/shapes/tiny_cpu/<run> --output exported/shapes-tiny
    python -m vision_grpo.export --adapter <run>/checkpoint-40 --output exported/x --eval results/x.json
    python -m vision_grpo.export --config recipes/geoqa/qwen3_5_4b_lora.yaml --adapter <adapter> --output exported/x

A LoRA adapter is merged into its base (PEFT's `merge_and_unload`) after the base is verified: by content against the
run's manifest (`model_weights`, the sha256 `model_identity` records at training start) and weight by weight as the
evaluator attaches adapters (vision_grpo/evaluation/adapters.py). A full fine-tuned run folder (the demo's GRPO stage)
is re-saved the same way. The model, processor and chat template come from the recipe (the run's own `recipe.yaml`
unless `--config` names one; other recipe keys can be overridden on the command line), so the exported processor resizes
images with the pixel limits training used. The folder holds what a Hub Qwen-VL checkpoint holds: sharded safetensors,
config.json, the base's `generation_config.json` byte for byte (none when the base has none, as Qwen3.5 ships none; a
full fine-tuned run's own), the processor and tokenizer files with the chat template (and `preprocessor_config.json`
where torchvision is missing: vision_grpo/models/processing.py), and a model card (README.md). An SFT run
(recipes/sft.py) exports too: its recipe is read with the trainer's config its manifest names.

The folder is written under a temporary name beside `--output` and renamed at the end, so `--output` never holds
half an export; missing folders above it are made (and removed again if the export fails). `--push_to_hub <repo>`
uploads it with huggingface_hub; it needs the network and a token (`hf auth login`), so it is refused when
HF_HUB_OFFLINE=1, before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
from pathlib import Path

from transformers.utils import cached_file
from trl import GRPOConfig, ModelConfig, SFTConfig

from vision_grpo.evaluation.adapters import AdapterMismatch, check_adapter_dir, load_verified_adapter
from vision_grpo.export.checks import (
    ExportError,
    adapter_weights,
    check_base,
    check_eval_matches,
    check_output_free,
    check_push_possible,
    hold_output,
    is_full_model,
    peft_names,
    read_eval_result,
    run_folder_of,
    shard_size,
    vision_lora_modules,
)
from vision_grpo.export.model_card import SFT_TRAINER, write_model_card
from vision_grpo.export.staging import (
    make_staging,
    marker_of,
    parent_folders,
    remove_staging,
    remove_stale_staging,
)
from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.loading import get_processor, load_model
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.run.locks_and_digests import permissions_as_created
from vision_grpo.run.manifest import read_manifest
from vision_grpo.storage.crash_points import crash_point
from vision_grpo.storage.writes import naming_a_full_disk

logger = logging.getLogger("vision_grpo.export")
GENERATION_CONFIG = "generation_config.json"
# Keys that change nothing in an export but that TRL checks while parsing a recipe: a GPU recipe's bf16 is refused
# on a machine without a GPU, and the export itself never trains.
PARSE_ONLY = ["--bf16", "false", "--use_cpu", "true"]


def copy_generation_config(base: str, revision: str | None, output: Path) -> bool:
    """The base's `generation_config.json` byte for byte, or none when the base ships none (what
    `save_pretrained` may have written in its place is removed: a made-up decoding default would change answers)."""
    (output / GENERATION_CONFIG).unlink(missing_ok=True)
    source = cached_file(base, GENERATION_CONFIG, revision=revision, _raise_exceptions_for_missing_entries=False)
    if source:
        shutil.copyfile(source, output / GENERATION_CONFIG)
    return source is not None


def trainer_config(run_dir: Path) -> type:
    """The config class of the trainer that wrote `run_dir` (its manifest's `trainer`): an SFT run's recipe holds
    SFTConfig keys (`max_length`, ...) that GRPOConfig does not know."""
    manifest = read_manifest(run_dir) or {}
    return SFTConfig if manifest.get("trainer") == SFT_TRAINER else GRPOConfig


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, TaskArguments, GRPOConfig, ModelConfig]:
    """The export's own options; every other argument is a recipe key overriding the recipe (the run's recipe.yaml
    unless `--config` is given), parsed as training parses it."""
    parser = argparse.ArgumentParser(
        prog="python -m vision_grpo.export",
        description="Merge a trained LoRA adapter (or re-save a full fine-tuned run) into a standalone model folder "
        "that transformers and vLLM load with no extra arguments, with a model card. Other --key value arguments "
        "override the recipe (e.g. --model_name_or_path <local copy of the base>).",
        allow_abbrev=False,
    )
    parser.add_argument("--adapter", required=True, help="Run folder or its checkpoint-N (adapter or full model).")
    parser.add_argument("--output", required=True, help="New or empty folder to write the model into.")
    parser.add_argument("--config", help="Recipe (default: the run folder's recipe.yaml).")
    parser.add_argument("--eval", help="eval/evaluate.py result file of these weights: its summary goes in the card.")
    parser.add_argument(
        "--max_shard_size", default="5GB", type=shard_size, help="Largest safetensors file (TB, GB, MB, KB; 5GB)."
    )
    parser.add_argument(
        "--push_to_hub",
        metavar="REPO",
        help="Upload the folder to this Hub repo (huggingface_hub; needs the network and `hf auth login`: "
        "refused when HF_HUB_OFFLINE=1).",
    )
    parser.add_argument("--public", action="store_true", help="Create the Hub repo public (default: private).")
    args, recipe_argv = parser.parse_known_args(argv)
    adapter = Path(args.adapter)
    if adapter.is_file():
        check_adapter_dir(adapter)  # the evaluator's message: pass the folder that holds it
    if not adapter.is_dir():
        raise ExportError(f"--adapter {adapter} does not exist")
    config = args.config or str(run_folder_of(adapter) / "recipe.yaml")
    if args.config and not Path(config).exists():  # the flag's path is wrong, not the adapter
        raise ExportError(
            f"--config {config} does not exist: pass the recipe {adapter} was trained with, or leave --config out to "
            "read the run's own recipe.yaml"
        )
    if not Path(config).exists():
        raise ExportError(f"{adapter} has no recipe.yaml beside it: pass --config with the recipe it was trained with")
    task_args, train_args, model_args = parse_recipe(
        (TaskArguments, trainer_config(run_folder_of(adapter)), ModelConfig),
        ["--config", config, *recipe_argv, *PARSE_ONLY],
    )
    args.config = config
    return args, task_args, train_args, model_args


def export(argv: list[str]) -> Path:
    """Run the export; returns the written folder. `--output` is held by a lock from the first check to the rename."""
    args, task_args, train_args, model_args = parse_args(argv)
    output = Path(args.output)
    check_output_free(output)
    with parent_folders(output), hold_output(output):
        remove_stale_staging(output)  # what an export to it that was killed left
        check_output_free(output)  # again, now that no other export can be writing it
        _export(args, argv, task_args, train_args, model_args)
    logger.info("exported %s to %s", args.adapter, output)
    if args.push_to_hub:
        push(output, args.push_to_hub, private=not args.public)
    return output


def _export(
    args: argparse.Namespace, argv: list[str], task_args: TaskArguments, train_args: GRPOConfig, model_args: ModelConfig
) -> None:
    """The checks that need no model, then the merge, written under a temporary name and renamed to `--output`."""
    adapter, output = Path(args.adapter), Path(args.output)
    check_push_possible(args.push_to_hub)
    run_dir = run_folder_of(adapter)
    manifest = read_manifest(run_dir)
    full = is_full_model(adapter)
    if not full:
        check_adapter_dir(adapter)  # the evaluator's message for a folder without a complete adapter
    eval_result = read_eval_result(Path(args.eval)) if args.eval else None
    if eval_result is not None:
        check_eval_matches(Path(args.eval), eval_result, adapter_weights(adapter, full))
    trust = train_args.trust_remote_code
    if full:
        base_identity = None
        model = load_model(_with_model(model_args, str(adapter)), trust)
        vision_lora: list[str] = []
    else:
        base_identity = check_base(adapter, manifest, model_args)
        vision_lora = vision_lora_modules(adapter)
        if vision_lora:
            logger.warning(
                "%s has LoRA on the vision tower (%d weights): merged into the export; vLLM serves vision-tower LoRA "
                "only as an experimental option, so the merged folder is the way to serve it",
                adapter,
                len(vision_lora),
            )
        model = load_verified_adapter(load_model(model_args, trust), adapter, merge=True)
    processor = get_processor(model_args, task_args, trust)
    staging = make_staging(output)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    try:
        with naming_a_full_disk(output, weights):  # a full disk: named, and the staging folder removed below
            model.save_pretrained(staging, max_shard_size=args.max_shard_size)
        crash_point(f"{output.name}: merged weights saved in the staging folder")
        processor.save_pretrained(staging)  # with `preprocessor_config.json` when image-only (models/processing.py)
        origin = str(adapter) if full else resolve_model_path(model_args.model_name_or_path)
        has_generation_config = copy_generation_config(origin, None if full else model_args.model_revision, staging)
        leftover = peft_names(staging)
        if leftover:
            raise ExportError(f"the merged weights still hold PEFT module names ({', '.join(leftover[:5])}): not saved")
        write_model_card(
            staging,
            export_argv=argv,
            model_args=model_args,
            task_args=task_args,
            train_args=train_args,
            recipe=run_dir / "recipe.yaml" if (run_dir / "recipe.yaml").is_file() else Path(args.config),
            run_dir=run_dir,
            adapter=adapter,
            manifest=manifest,
            base_identity=base_identity,
            full=full,
            vision_lora=bool(vision_lora),
            generation_config=has_generation_config,
            eval_path=Path(args.eval) if args.eval else None,
            eval_result=eval_result,
        )
        permissions_as_created(staging)
        if output.exists():
            output.rmdir()  # empty (checked above)
        crash_point(f"{output.name}: staging folder complete, not yet renamed")
        staging.rename(output)
        marker_of(staging).unlink()
        crash_point(f"{output.name}: renamed into place")
    except BaseException:
        remove_staging(staging)
        raise


def _with_model(model_args: ModelConfig, path: str) -> ModelConfig:
    return dataclasses.replace(model_args, model_name_or_path=path, model_revision=None)


def push(folder: Path, repo: str, private: bool) -> None:
    """Upload the exported folder to the Hub (huggingface_hub's `create_repo` and `upload_folder`)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=f"Export of {folder.name}")
    logger.info("pushed %s to https://huggingface.co/%s", folder, repo)


def main(argv: list[str] | None = None) -> Path:
    try:
        return export(sys.argv[1:] if argv is None else argv)
    except (ExportError, AdapterMismatch, RecipeError) as error:
        if argv is not None:
            raise
        sys.exit(f"export: {error}")
