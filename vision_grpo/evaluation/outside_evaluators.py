"""Our held-out sets for the field's evaluators, written by `eval/evaluate.py --write_held_out DIR`.

lmms-eval: `DIR/rows.parquet` holds the rows our evaluator generates for, as it reads them (the prompt messages our
prompt builder made, each image as our normalisation left it, stored losslessly as PNG, the columns the task scores
with), and `DIR/vision_grpo_<task>.yaml` binds them to the task shipped in eval/lmms_eval_tasks/, whose utils module
is `doc_to_messages` and `process_results` below: lmms-eval renders our prompt and scores with the task's own
`score` (the reward's parser), so no second copy of either exists.

VLMEvalKit: for GeoQA also `DIR/GeoQA_vision_grpo.tsv`, a custom multiple-choice TSV (index, image as base64,
question, A-D, answer) that VLMEvalKit scores as it is; it builds its own prompt from those columns.
"""

from __future__ import annotations

import base64
import csv
import io
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import yaml
from transformers import AutoConfig

from vision_grpo.data import geoqa, get_dataset
from vision_grpo.data.prompts_and_images import fill_image
from vision_grpo.evaluation.batches import chunks, images_of, rows_at
from vision_grpo.evaluation.evaluator import default_max_new_tokens
from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.loading import get_processor, max_pixels_of
from vision_grpo.plugins.tasks import get_task
from vision_grpo.rewards.boxed_option import OPTION_LETTERS
from vision_grpo.storage.writes import replaced_atomically

# The task definition lmms-eval reads through the YAML written beside the rows, which includes it; one for every task
# (its functions dispatch on the rows' `task` column).
LMMS_EVAL_TASK = Path(__file__).resolve().parents[2] / "eval" / "lmms_eval_tasks" / "vision_grpo.yaml"
# lmms-eval 0.7's model class for each family (by `model_type`); those in THINKING_SWITCH take `enable_thinking`.
LMMS_EVAL_MODELS = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_5": "qwen3_5"}
THINKING_SWITCH = {"qwen3_vl", "qwen3_5"}
ROWS_FILE = "rows.parquet"
VLMEVALKIT_TSV = "GeoQA_vision_grpo.tsv"
WRITE_BATCH = 64  # rows decoded and encoded at a time: memory holds one batch's images, whatever the split's size


def png(image: Any) -> dict[str, Any]:
    """An image as datasets stores it, encoded as PNG: lossless, whatever format the source had (datasets would
    re-encode a JPEG-decoded image as JPEG)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def _stored(row: dict[str, Any], task: str) -> dict[str, Any]:
    images = images_of(row)
    key = "image" if "image" in row else "images"
    encoded = [png(each) for each in images] if isinstance(images, list) else png(images)
    return {**row, key: encoded, "task": task}


def _features(dataset: datasets.Dataset, row: dict[str, Any]) -> datasets.Features:
    """The split's own column types, the image(s) as datasets' Image, and the task's name (the scorer to use)."""
    features = {key: dataset.features[key] for key in row if key in dataset.features and key not in ("image", "images")}
    if "image" in row:
        features["image"] = datasets.Image()
    else:
        features["images"] = datasets.List(datasets.Image())
    features["task"] = datasets.Value("string")
    return datasets.Features(features)


def write_rows(dataset: datasets.Dataset, task: str, path: Path) -> int:
    """`dataset`'s rows as our evaluator reads them, one batch at a time, into the parquet file `path` (written
    atomically: an interrupted write leaves no partial file under the name). Returns the number of rows."""
    with replaced_atomically(path) as temporary:
        writer = None
        try:
            for indices in chunks(range(len(dataset)), WRITE_BATCH):
                rows = rows_at(dataset, indices)
                stored = [_stored(row, task) for row in rows]
                table = datasets.Dataset.from_list(stored, features=_features(dataset, rows[0])).data.table
                writer = writer or pq.ParquetWriter(temporary, table.schema)
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
    return len(dataset)


def write_task_yaml(folder: Path, task: str, max_new_tokens: int) -> Path:
    """`folder/vision_grpo_<task>.yaml`: the shipped task with these rows and the recipe's generation length."""
    binding = {
        "include": str(LMMS_EVAL_TASK),
        "task": f"vision_grpo_{task}",
        "dataset_kwargs": {"data_files": {"test": str((folder / ROWS_FILE).resolve())}},
        "generation_kwargs": {"max_new_tokens": max_new_tokens, "temperature": 0, "do_sample": False, "num_beams": 1},
    }
    path = folder / f"vision_grpo_{task}.yaml"
    path.write_text(yaml.safe_dump(binding, sort_keys=False), encoding="utf-8")
    return path


def write_vlmevalkit_tsv(dataset: datasets.Dataset, task_args: Any, path: Path) -> int:
    """GeoQA's held-out rows as a VLMEvalKit custom multiple-choice TSV: the question and its four options from the
    source rows, the image as our evaluator shows it (PNG, base64), the answer letter."""
    source = geoqa.load_split(
        task_args.dataset_name, task_args.dataset_revision, "eval", task_args.geoqa_test_rows or None
    )
    by_id = {str(row_id): position for position, row_id in enumerate(source["id"])}
    with replaced_atomically(path) as temporary, open(temporary, "x", encoding="utf-8", newline="") as file:
        writer = csv.writer(file, delimiter="\t")
        writer.writerow(["index", "id", "image", "question", *OPTION_LETTERS, "answer"])
        for indices in chunks(range(len(dataset)), WRITE_BATCH):
            for index, row in zip(indices, rows_at(dataset, indices), strict=True):
                raw = source[by_id[row["id"]]]
                image = base64.b64encode(png(row["image"])["bytes"]).decode("ascii")
                answer = OPTION_LETTERS[int(row["label"])]
                writer.writerow([index, row["id"], image, raw["subject"], *raw["choices"], answer])
    return len(dataset)


def write_held_out(folder: Path, task_args: Any, train_args: Any, model_args: Any, eval_args: Any) -> dict:
    """Write the recipe's held-out rows for lmms-eval (and VLMEvalKit for GeoQA) into `folder`; no model is loaded.

    Returns what was written and the lmms-eval command that evaluates the recipe's model on them with the pixel
    limits and generation length of `eval/evaluate.py`.
    """
    if not LMMS_EVAL_TASK.is_file():  # the package installed without its repository
        raise FileNotFoundError(f"{LMMS_EVAL_TASK} is missing: write held-out sets from a clone of the repository")
    processor = get_processor(model_args, task_args, train_args.trust_remote_code)
    model, arguments = lmms_eval_model(model_args, processor, train_args)  # an unknown family fails before writing
    folder.mkdir(parents=True, exist_ok=True)
    dataset = get_dataset(task_args, "eval", max_pixels_of(processor))
    if eval_args.limit:
        dataset = dataset.select(range(min(eval_args.limit, len(dataset))))
    task = task_args.task
    rows = write_rows(dataset, task, folder / ROWS_FILE)
    max_new_tokens = eval_args.max_new_tokens or default_max_new_tokens(task_args, train_args)
    written = {"rows": rows, "lmms_eval_rows": str(folder / ROWS_FILE)}
    written["lmms_eval_task"] = str(write_task_yaml(folder, task, max_new_tokens))
    if task == "geoqa":
        write_vlmevalkit_tsv(dataset, task_args, folder / VLMEVALKIT_TSV)
        written["vlmevalkit_tsv"] = str(folder / VLMEVALKIT_TSV)
    written.update({"lmms_eval_model": model, "lmms_eval_model_args": arguments})
    written["lmms_eval_command"] = (
        f"lmms-eval --model {model} --model_args {arguments} --include_path {folder} "
        f"--tasks vision_grpo_{task} --batch_size 1 --log_samples --output_path <folder>"
    )
    return written


def lmms_eval_model(model_args: Any, processor: Any, train_args: Any) -> tuple[str, str]:
    """lmms-eval's model class for the recipe's family and its `--model_args` (with a `<model>` placeholder for
    `pretrained`): the recipe's pixel limits and thinking switch, so lmms-eval prompts as `eval/evaluate.py` does."""
    model_type = AutoConfig.from_pretrained(resolve_model_path(model_args.model_name_or_path)).model_type
    if model_type not in LMMS_EVAL_MODELS:
        known = ", ".join(LMMS_EVAL_MODELS)
        raise ValueError(f"no lmms-eval model class is known for model type `{model_type}` (known: {known})")
    size = processor.image_processor.size
    arguments = f"pretrained=<model>,min_pixels={size['shortest_edge']},max_pixels={size['longest_edge']}"
    thinking = (train_args.chat_template_kwargs or {}).get("enable_thinking")
    if thinking is not None and model_type in THINKING_SWITCH:
        arguments += f",enable_thinking={thinking}"
    return LMMS_EVAL_MODELS[model_type], arguments


def doc_to_messages(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """lmms-eval's chat messages for a row: our prompt messages with the row's image(s) in their slots (as PIL
    images: lmms-eval's chat models take them as they are, with no lossy re-encoding)."""
    messages = fill_image(doc["prompt"], images_of(doc))
    return [
        {
            "role": message["role"],
            "content": [
                {"type": "image", "url": part["image"]} if part["type"] == "image" else part
                for part in message["content"]
            ],
        }
        for message in messages
    ]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lmms-eval's per-example metrics from the task's own `score`: accuracy and whether an answer was parsed."""
    score = get_task(doc["task"]).score(doc, results[0])
    return {"accuracy": float(score["correct"]), "format_rate": float(score["prediction"] is not None)}


def doc_to_visual(doc: dict[str, Any]) -> list[Any]:
    """The row's image(s), for lmms-eval's simple (non-chat) model classes, which put them before the text."""
    images = images_of(doc)
    return images if isinstance(images, list) else [images]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict | None = None) -> str:
    """The prompt's text, for lmms-eval's simple model classes (the chat classes use `doc_to_messages`)."""
    return "".join(part["text"] for message in doc["prompt"] for part in message["content"] if part["type"] == "text")
