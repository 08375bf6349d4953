"""Our held-out sets in lmms-eval: the tasks of eval/lmms_eval_tasks/ over the rows `eval/evaluate.py
--write_held_out` writes, run by lmms-eval 0.7's own model class for each family (qwen2_5_vl, qwen3_vl, qwen3_5, as
the command `--write_held_out` prints names them), give each example the answer text and the score
`eval/evaluate.py` gives it, for a LoRA adapter (qwen2_5_vl loads it through transformers' PEFT integration) and for
its merged export (`python -m vision_grpo.export`).

One difference is lmms-eval's and stays: its Qwen classes resize every image to the patch grid with Pillow
(qwen-vl-utils) before the processor, which would otherwise resize it with torch; an image already on the grid is
resized by neither. Examples whose image is on the grid must agree exactly; the others may differ where the model
is near a tie (their pixels differ by about one grey level), and are counted. The shapes images (224 px) are on
every family's grid, most GeoQA fixture diagrams are not.

The adapter is a short SFT on counting, so its answers depend on the image (a random adapter's near-tied logits
would test bf16 rounding, not the pipelines). Our evaluator runs in bf16 one prompt at a time, as lmms-eval's
classes do (they load bfloat16 whatever the checkpoint). The held-out sets are small (GeoQA: the first 24 rows of the
fixed subset).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets
import pytest
from conftest import run_python
from transformers import AutoImageProcessor

# Tiny replica -> the lmms-eval model class of its family, and the recipe keys of its real recipes (Qwen3.5's GeoQA
# recipe turns thinking off; the command passes that on as `enable_thinking=False`).
FAMILIES = {
    "vision-grpo/tiny-qwen2.5-vl": ("qwen2_5_vl", []),
    "vision-grpo/tiny-qwen3-vl": ("qwen3_vl", []),
    "vision-grpo/tiny-qwen3.5": ("qwen3_5", ["--chat_template_kwargs", '{"enable_thinking": false}']),
}
PIXELS = [f"--min_pixels={3136}", f"--max_pixels={224 * 224}"]
# The counting set of recipes/shapes/tiny_sft.yaml, drawn at 224 px: a multiple of 28 and of 32, every family's grid.
SHAPES = ["--shapes_layout", "single", "--shapes_canvas", "224", "--shapes_min_count", "1", "--shapes_max_count", "3"]
SHAPES += ["--shapes_fixed_size", "true"]
SFT = ["recipes/sft.py", "--config", "recipes/shapes/tiny_sft.yaml", *SHAPES, "--use_peft", "true", "--lora_r", "32"]
SFT += ["--lora_alpha", "64", "--max_steps", "200", "--learning_rate", "5e-3", "--per_device_train_batch_size", "16"]
SFT += ["--report_to", "none", *PIXELS]


def case(family: str, form: str, task: str) -> pytest.param:
    """One comparison; a family's cases share a worker (`make test-lmms-eval` runs two), so it trains once."""
    name = f"{family.split('tiny-')[1]}-{form}-{task}"
    return pytest.param(family, form, task, id=name, marks=pytest.mark.xdist_group(family))


# The embedded default on both tasks in both forms; the other families' exports on the counting set (on their grid
# too, so a difference could not hide behind resizing). lmms-eval's qwen3_vl and qwen3_5 classes read the folder's
# config.json before loading, which an adapter folder does not have ("Unrecognized model"): they take exports only.
QWEN2_5 = "vision-grpo/tiny-qwen2.5-vl"
CASES = [case(QWEN2_5, form, task) for form in ("adapter", "export") for task in ("shapes", "geoqa")]
CASES += [case(family, "export", "shapes") for family in list(FAMILIES)[1:]]


@pytest.fixture(scope="module")
def models(request, tmp_path_factory) -> dict[str, object]:
    """A LoRA adapter of the family's replica trained to count, its merged export, and a cache of held-out sets."""
    root = tmp_path_factory.mktemp("models")
    family = request.param
    run_python([*SFT, "--model_name_or_path", family, "--output_dir", str(root), "--run_name", "sft"])
    adapter, export = root / "sft", root / "export"
    run_python(["-m", "vision_grpo.export", "--adapter", str(adapter), "--output", str(export)])
    return {"family": family, "adapter": adapter, "export": export, "root": root, "held_out": {}}


@pytest.fixture(scope="module")
def geoqa_fixture(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("geoqa") / "geoqa.parquet"
    run_python(["-m", "vision_grpo.data.geoqa_fixture", "--output", str(path)])
    return path


def recipe(task: str, family: str, geoqa: Path) -> list[str]:
    """The recipe arguments `eval/evaluate.py` gets for `task` on `family`'s replica."""
    common = ["--model_name_or_path", family, *PIXELS, *FAMILIES[family][1], "--max_new_tokens", "24"]
    if task == "shapes":
        held_out = ["--shapes_eval_seed", "2", "--shapes_eval_size", "24"]
        return ["--config", "recipes/shapes/tiny_cpu.yaml", *common, *SHAPES, *held_out]
    return ["--config", "recipes/geoqa/tiny_cpu.yaml", *common, "--dataset_name", str(geoqa), "--limit", "24"]


def held_out(models: dict, task: str, args: list[str]) -> tuple[Path, dict]:
    """The family's held-out set of `task` as `--write_held_out` writes it (once per family and task)."""
    if task not in models["held_out"]:
        folder = models["root"] / f"held_out_{task}"
        written = json.loads(run_python(["eval/evaluate.py", *args, "--write_held_out", str(folder)]).stdout)
        models["held_out"][task] = folder, written
    return models["held_out"][task]


def rows_of(folder: Path) -> datasets.Dataset:
    return datasets.load_dataset("parquet", data_files={"test": str(folder / "rows.parquet")})["test"]


def lmms_eval_samples(written: dict, pretrained: Path, task: str, output: Path) -> list[dict]:
    """lmms-eval's logged samples, in the rows' order, run as the command `--write_held_out` printed says (on the
    CPU). `--verbosity DEBUG`: lmms-eval 0.7 exits 0 on an error otherwise."""
    model_args = written["lmms_eval_model_args"].replace("<model>", str(pretrained)) + ",device=cpu,device_map=cpu"
    args = ["-m", "lmms_eval", "--model", written["lmms_eval_model"], "--model_args", model_args]
    args += ["--include_path", str(Path(written["lmms_eval_task"]).parent), "--tasks", f"vision_grpo_{task}"]
    args += ["--batch_size", "1", "--log_samples", "--output_path", str(output), "--verbosity", "DEBUG"]
    run_python(args, cwd=output.parent)
    (samples,) = output.rglob(f"*_samples_vision_grpo_{task}.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return sorted(rows, key=lambda row: row["doc_id"])


def on_grid(size: tuple[int, int], pretrained: Path) -> bool:
    """Whether an image of `size` is on the processor's patch grid: neither lmms-eval nor the processor resizes it."""
    processor = AutoImageProcessor.from_pretrained(pretrained)
    grid = processor.patch_size * processor.merge_size
    return all(side % grid == 0 for side in size)


@pytest.mark.parametrize(("models", "form", "task"), CASES, indirect=["models"])
def test_lmms_eval_gives_our_answers_and_scores(models, geoqa_fixture, task, form, tmp_path) -> None:
    family = models["family"]
    args = recipe(task, family, geoqa_fixture)
    folder, written = held_out(models, task, args)
    assert written["lmms_eval_model"] == FAMILIES[family][0]
    rows = rows_of(folder)
    if task == "geoqa":
        with open(folder / "GeoQA_vision_grpo.tsv", encoding="utf-8", newline="") as file:
            tsv = list(csv.DictReader(file, delimiter="\t"))  # as VLMEvalKit reads it (quoted newlines and all)
        assert [row["id"] for row in tsv] == rows["id"]
        assert all(row["answer"] in "ABCD" and row["question"] and row["D"] for row in tsv)

    model = ["--adapter", str(models["adapter"])] if form == "adapter" else ["--model_name_or_path", str(models[form])]
    ours_file = tmp_path / "ours.json"
    run_python(
        ["eval/evaluate.py", *args, *model, "--dtype", "bfloat16", "--batch_size", "1", "--output", str(ours_file)]
    )
    ours = json.loads(ours_file.read_text())
    samples = lmms_eval_samples(written, models[form], task, tmp_path / "lmms_eval")

    assert [record["id"] for record in ours["records"]] == rows["id"] and len(samples) == len(rows)
    grid = [on_grid(image.size, models["export"]) for image in rows["image"]]
    differing = []
    for sample, record, same_pixels in zip(samples, ours["records"], grid, strict=True):
        answer = sample["filtered_resps"]
        # lmms-eval's default filter strips whitespace around the answer before scoring; the scorer ignores it.
        same = (answer if isinstance(answer, str) else answer[0]) == record["text"].strip()
        same &= sample["accuracy"] == float(record["correct"])
        same &= sample["format_rate"] == float(record["prediction"] is not None)
        assert same or not same_pixels, f"{record['id']}: lmms-eval {answer!r}, ours {record['text']!r}"
        differing += [] if same else [record["id"]]
    print(f"{family} {form} {task}: {sum(grid)} of {len(grid)} on the grid, off-grid differing: {differing}")
    if task == "shapes":  # every image on the grid, and a model that answers, some right, some not
        assert all(grid) and 0 < ours["summary"]["accuracy"] < 1
