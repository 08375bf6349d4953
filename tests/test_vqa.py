"""The generic VQA task: any dataset through recipe keys alone. Answer types and their rewards, the three offline
fixtures in three source forms (parquet, JSONL with an image folder, save_to_disk), multi-image prompts, bad rows
named and counted, and each fixture's recipe training 2 steps and evaluating through the real entry points."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import datasets
import pytest
from conftest import run_script
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset, warn_split_overlap
from vision_grpo.data.task_vqa import VQADataError
from vision_grpo.data.vqa_fixtures import write_fixtures
from vision_grpo.plugins.tasks import task_of
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import get_reward_funcs
from vision_grpo.rewards.vqa import is_correct, last_boxed, read_number

MAX_PIXELS = 168 * 168
FIXTURE_RECIPES = [
    "recipes/vqa/tiny_geometry3k.yaml",
    "recipes/vqa/tiny_clevr_count.yaml",
    "recipes/vqa/tiny_two_image.yaml",
]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    return write_fixtures(tmp_path_factory.mktemp("vqa"))


def recipe_args(recipe: str, fixtures: Path) -> list[str]:
    """The recipe with its `.cache/vqa` paths pointed at this test's fixtures."""
    text = Path(recipe).read_text()
    args = ["--config", recipe]
    for key in ("dataset_name", "vqa_image_folder"):
        line = next((line for line in text.splitlines() if line.startswith(f"{key}:")), None)
        if line:
            value = line.split(":", 1)[1].split("#")[0].strip()
            args += [f"--{key}", str(fixtures / Path(value).relative_to(".cache/vqa"))]
    return args


def task_args(recipe: str, fixtures: Path, *extra: str) -> TaskArguments:
    argv = [*recipe_args(recipe, fixtures), *extra, "--use_cpu", "true"]
    return parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]


@pytest.mark.parametrize(
    ("text", "answer", "kind", "right"),
    [
        ("so x = \\boxed{2\\sqrt{5}}", "2 \\sqrt{5}", "math", True),
        ("x is \\boxed{\\sqrt{20}}", "2 \\sqrt{5}", "math", True),  # equivalent, written differently
        ("x is \\boxed{\\frac{1}{2}}", "0.5", "math", True),
        ("x is \\boxed{3}", "2 \\sqrt{5}", "math", False),
        ("there are \\boxed{4}", "4", "number", True),
        ("there are \\boxed{4.0}", "4", "number", True),
        ("there are 4", "4", "number", False),  # no box: no final answer
        ("\\boxed{B} hmm \\boxed{A}", "A", "choice", True),
        ("\\boxed{ Blue }", "blue", "exact", True),
        ("\\boxed{blue sky}", "blue", "exact", False),
        ("\\boxed{Blue  Sky}", "blue sky", "exact", True),  # doubled space
        ("\\boxed{\uff42\uff4c\uff55\uff45}", "blue", "exact", True),  # full-width letters: another normal form
        ("there are \\boxed{1,234}", "1234", "number", True),
        ("it is \\boxed{\u22123}", "-3", "number", True),  # the Unicode minus sign
        ("it is \\boxed{30\\%}", "30", "number", True),
        ("it is \\boxed{3,5}", "3.5", "number", False),  # a decimal comma is ambiguous: no answer read
    ],
)
def test_each_answer_type_checks_the_final_answer(text: str, answer: str, kind: str, right: bool) -> None:
    assert is_correct(text, answer, kind, tolerance=1e-6) is right
    (reward,) = get_reward_funcs(["vqa_answer"])
    completions = [[{"role": "assistant", "content": text}]]
    assert reward(completions=completions, answer=[answer], answer_type=[kind], tolerance=[1e-6]) == [float(right)]


def test_the_last_box_is_read_with_balanced_braces() -> None:
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}} done") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{\\frac{a}{b") is None  # cut off


def test_geometry3k_from_parquet_keeps_free_form_math_answers(fixtures: Path) -> None:
    rows = get_dataset(task_args(FIXTURE_RECIPES[0], fixtures), "eval", MAX_PIXELS)
    assert len(rows) == 16 and set(rows.column_names) == {
        "id",
        "prompt",
        "images",
        "answer",
        "answer_type",
        "tolerance",
        "options",
    }
    assert any("\\sqrt" in answer for answer in rows["answer"]) and set(rows["answer_type"]) == {"math"}
    assert len(rows[0]["images"]) == 1


def test_clevr_from_jsonl_reads_images_from_the_image_folder(fixtures: Path) -> None:
    rows = get_dataset(task_args(FIXTURE_RECIPES[1], fixtures), "train", MAX_PIXELS)
    assert len(rows) == 48 and isinstance(rows[0]["image"], Image.Image)
    assert all(answer.isdigit() for answer in rows["answer"])


def test_two_images_fill_the_templates_two_slots_in_order(fixtures: Path) -> None:
    rows = get_dataset(task_args(FIXTURE_RECIPES[2], fixtures), "train", MAX_PIXELS)
    content = rows[0]["prompt"][0]["content"]
    assert [part["type"] for part in content] == ["text", "image", "text", "image", "text"]
    assert content[0]["text"] == "First image: " and content[2]["text"] == "\nSecond image: "
    assert len(rows[0]["images"]) == 2 and set(rows["answer"]) == {"A", "B"}  # option indices became letters


def test_bad_rows_are_named_or_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "mine"
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 40), "white").save(folder / "images" / "ok.png")
    lines = [
        {"id": "good", "image": "ok.png", "question": "How many?", "answer": "3"},
        {"id": "no-image", "image": "missing.png", "question": "How many?", "answer": "3"},
        {"id": "no-number", "image": "ok.png", "question": "How many?", "answer": "three"},
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images")]
    common += ["--vqa_answer_type", "number"]
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), [*common, "--use_cpu", "true"])[0]
    with pytest.raises(VQADataError, match=r"VQA row id='no-image': image file .*missing.png does not exist"):
        get_dataset(args, "train", MAX_PIXELS)
    args.skip_bad_rows = True
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.task_vqa"):
        rows = get_dataset(args, "train", MAX_PIXELS)
    assert rows["id"] == ["good"]
    assert "VQA train: skipped 2 invalid row(s) of 3" in caplog.text
    assert "id='no-number': answer 'three' is not a number" in caplog.text


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("1,234,567", "1234567"),
        ("\u22122.5", "-2.5"),
        ("30%", "30"),
        ("12 cm", "12"),
        ("5\\text{ apples}", "5"),
        ("\uff11\uff12", "12"),
        ("1{,}000", "1000"),
        ("3,5", None),
        ("1,23", None),
        ("nan", None),
        ("1e999", None),
        ("three", None),
    ],
)
def test_a_number_answer_is_read_by_one_documented_rule(text: str, read: str | None) -> None:
    if read is None:
        with pytest.raises(ValueError, match="comma that is not a thousands separator|not a number|not finite"):
            read_number(text)
    else:
        assert read_number(text) == read


def _one_file_task(tmp_path: Path, lines: list[dict], kind: str, *extra: str) -> TaskArguments:
    folder = tmp_path / "mine"
    (folder / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 40), "white").save(folder / "images" / "ok.png")
    (folder / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images")]
    return parse_recipe((TaskArguments, GRPOConfig, ModelConfig), [*argv, "--vqa_answer_type", kind, *extra])[0]


def test_every_gold_answer_the_check_accepts_is_one_a_completion_can_match(tmp_path: Path) -> None:
    """The pass stores each gold answer read by the scorer's own rule: `1,234` matches `\\boxed{1234}` (before, the
    pass accepted `1,234` and the scorer could not read it: no completion could ever be right), and an ambiguous
    `3,5` is refused naming its row instead of being trained on as 35."""
    answers = {"sep": "1,234", "minus": "\u22123", "percent": "30%", "unit": "12 cm"}
    boxes = {"sep": "1234", "minus": "-3", "percent": "30", "unit": "12"}
    lines = [{"id": key, "image": "ok.png", "question": "How many?", "answer": value} for key, value in answers.items()]
    args = _one_file_task(tmp_path, lines, "number", "--use_cpu", "true")
    rows = get_dataset(args, "train", MAX_PIXELS)
    task = task_of(args)
    for row in rows:
        assert task.score(row, f"so \\boxed{{{boxes[row['id']]}}}")["correct"], row
    lines.append({"id": "comma", "image": "ok.png", "question": "How long?", "answer": "3,5"})
    args = _one_file_task(tmp_path, lines, "number", "--use_cpu", "true")
    with pytest.raises(VQADataError, match=r"id='comma': answer '3,5' holds a comma that is not a thousands sep"):
        get_dataset(args, "train", MAX_PIXELS)


@pytest.mark.parametrize(("image", "reason"), [([], "an empty image list"), (["ok.png", None], "position 2 of its 2")])
def test_a_row_without_an_image_is_refused_by_the_pass_or_skipped(tmp_path: Path, image: list, reason: str) -> None:
    """An empty image list passed the check as a text-only row and failed later in the processor."""
    lines = [
        {"id": "good", "image": ["ok.png"], "question": "How many?", "answer": "3"},
        {"id": "bad", "image": image, "question": "How many?", "answer": "3"},
    ]
    args = _one_file_task(tmp_path, lines, "number", "--use_cpu", "true")
    with pytest.raises(VQADataError, match=rf"VQA row id='bad': no image.*{re.escape(reason)}"):
        get_dataset(args, "train", MAX_PIXELS)
    args.skip_bad_rows = True
    assert get_dataset(args, "train", MAX_PIXELS)["id"] == ["good"]


def test_a_choice_task_without_choices_fails_before_loading() -> None:
    with pytest.raises(RecipeError, match="vqa_answer_type: choice needs `vqa_choices_column`"):
        TaskArguments(task="vqa", vqa_answer_type="choice")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", FIXTURE_RECIPES)
def test_each_fixture_recipe_trains_and_evaluates(recipe: str, fixtures: Path, tmp_path: Path) -> None:
    args = recipe_args(recipe, fixtures)
    run_script(["recipes/train.py", *args, "--max_steps", "2", "--output_dir", str(tmp_path), "--run_name", "r"])
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["global_step"] == 2 and manifest["task"] == "vqa"
    assert manifest["dataset"]["vqa_answer_type"] in ("math", "number", "choice")
    output = tmp_path / "eval.json"
    run_script(["eval/evaluate.py", *args, "--adapter", str(tmp_path / "r"), "--limit", "4", "--output", str(output)])
    result = json.loads(output.read_text())
    assert len(result["records"]) == 4 and set(result["summary"]["rewards"]) == {"vqa_answer", "vqa_format"}


def test_a_prompt_template_file_is_read_and_a_broken_one_named(fixtures: Path, tmp_path: Path) -> None:
    template = tmp_path / "prompt.jinja"
    template.write_text("Q: {{ question }} <image> Answer in \\boxed{}.")
    args = task_args(FIXTURE_RECIPES[1], fixtures, "--vqa_prompt_template", str(template))
    content = get_dataset(args, "eval", MAX_PIXELS)[0]["prompt"][0]["content"]
    assert [part["type"] for part in content] == ["text", "image", "text"] and content[0]["text"].startswith("Q: How")
    template.write_text("{{ question ")
    with pytest.raises(RecipeError, match="vqa_prompt_template: not a valid Jinja template"):
        task_args(FIXTURE_RECIPES[1], fixtures, "--vqa_prompt_template", str(template))


ATTACK = "{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"


@pytest.mark.parametrize("as_file", [False, True])
def test_a_prompt_template_cannot_run_code(fixtures: Path, tmp_path: Path, as_file: bool) -> None:
    marker = tmp_path / "ran"
    template = ATTACK.format(marker=marker) + " {{ question }}"
    if as_file:
        (tmp_path / "attack.jinja").write_text(template)
        template = str(tmp_path / "attack.jinja")
    with pytest.raises(RecipeError, match=r"vqa_prompt_template: refused by the Jinja sandbox .*__init__"):
        task_args(FIXTURE_RECIPES[1], fixtures, "--vqa_prompt_template", template)
    assert not marker.exists()


def test_a_template_refused_on_a_row_is_never_skipped_as_a_bad_row(fixtures: Path, tmp_path: Path) -> None:
    """A branch the recipe check's stand-in values do not take is refused when a row takes it, skip_bad_rows or not."""
    marker = tmp_path / "ran"
    template = "{% if question.startswith('How') %}" + ATTACK.format(marker=marker) + "{% endif %}{{ question }}"
    args = task_args(FIXTURE_RECIPES[1], fixtures, "--vqa_prompt_template", template, "--skip_bad_rows", "true")
    with pytest.raises(ValueError, match=r"vqa_prompt_template: refused by the Jinja sandbox"):
        get_dataset(args, "train", MAX_PIXELS)
    assert not marker.exists()


def test_a_five_option_row_scores_its_fifth_letter_in_the_reward_and_the_evaluator(tmp_path: Path) -> None:
    """Options past D: the letters are the row's own (A-E here), both in the training reward and the task's scoring."""
    folder = tmp_path / "five"
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 40), "white").save(folder / "images" / "a.png")
    options = ["one", "two", "three", "four", "five"]
    lines = [{"id": "q", "image": "a.png", "question": "Which?", "options": options, "answer": 4}]
    (folder / "test.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images")]
    argv += ["--vqa_choices_column", "options", "--vqa_answer_type", "choice", "--use_cpu", "true"]
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    (row,) = get_dataset(args, "eval", MAX_PIXELS)
    assert row["answer"] == "E" and "E. five" in row["prompt"][0]["content"][-1]["text"]
    (reward,) = get_reward_funcs(["vqa_answer"])
    columns = {key: [row[key]] for key in ("answer", "answer_type", "tolerance", "options")}
    texts = ["so \\boxed{E}", "\\boxed{E} or rather \\boxed{F}", "\\boxed{D}"]  # F is no option of this row
    assert reward(completions=[[{"role": "assistant", "content": t}] for t in texts[:1]], **columns) == [1.0]
    for text, right in zip(texts, [True, True, False], strict=True):
        assert reward(completions=[[{"role": "assistant", "content": text}]], **columns) == [float(right)]
        scored = task_of(args).score(row, text)
        assert (scored["correct"], scored["prediction"]) == (right, "E" if right else "D")


def test_rows_shared_by_the_training_and_evaluation_splits_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shared ids, and shared (question, image) pairs under other ids, are warned about when the evaluation split
    loads, with their counts and a few ids; images are compared by content when the cells hold bytes."""
    folder = tmp_path / "split"
    (folder / "images").mkdir(parents=True)
    for colour in ("white", "black", "red"):
        Image.new("RGB", (40, 40), colour).save(folder / "images" / f"{colour}.png")

    def line(row_id: str, image: str, question: str) -> dict:
        return {"id": row_id, "image": image, "question": question, "answer": "3"}

    train = [line("t1", "white.png", "How many?"), line("t2", "black.png", "How many?"), line("t3", "red.png", "Q?")]
    test = [line("t1", "red.png", "Other?"), line("e2", "black.png", "How many?"), line("e3", "red.png", "How many?")]
    for name, lines in (("train", train), ("test", test)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(each) + "\n" for each in lines))
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images")]
    args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig), [*argv, "--vqa_answer_type", "number", "--use_cpu", "true"]
    )[0]
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data"):
        get_dataset(args, "eval", MAX_PIXELS)
    assert "1 of 3 evaluation row(s) share their id with a training row (e.g. ids 't1')" in caplog.text
    assert "1 of 3 evaluation row(s) share their question and image with a training row (e.g. ids 'e2')" in caplog.text


def test_the_overlap_of_encoded_images_is_by_content() -> None:
    def encoded(colour: str) -> dict:
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), colour).save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}

    features = datasets.Features(
        {"id": datasets.Value("string"), "q": datasets.Value("string"), "image": datasets.Image()}
    )
    train = datasets.Dataset.from_dict({"id": ["a"], "q": ["x"], "image": [encoded("white")]}, features=features)
    same = datasets.Dataset.from_dict(
        {"id": ["b", "c"], "q": ["x", "x"], "image": [encoded("white"), encoded("red")]}, features=features
    )
    assert warn_split_overlap(train, same, "id", "q", "image", "here") == (0, 1)
