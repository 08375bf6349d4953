"""The generic VQA task: any dataset through recipe keys alone. Answer types and their rewards, the three offline
fixtures in three source forms (parquet, JSONL with an image folder, save_to_disk), multi-image prompts, bad rows
named and counted, and each fixture's recipe training 2 steps and evaluating through the real entry points."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import run_script
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.task_vqa import VQADataError
from vision_grpo.data.vqa_fixtures import write_fixtures
from vision_grpo.plugins.tasks import task_of
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import get_reward_funcs
from vision_grpo.rewards.vqa import is_correct, last_boxed

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
