"""An exported policy in a real (CPU) vLLM: the folder `python -m vision_grpo.export` writes, loaded by vLLM with no
extra arguments, gives the greedy records transformers gives for the unmerged adapter; and vLLM's own LoRA support
(`eval/evaluate.py --backend vllm --adapter`, not merged) gives them too.

The adapter has random non-zero LoRA weights (tests/lora_runs.py), so its answers differ from the base model's and
a merge or a LoRA that did not apply would show. The recipe's pixel limits are other than the replica's; the exported
folder is evaluated without them, so it must carry them in its processor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import RECIPE, REPO, check, run_python

sys.path.insert(0, str(REPO / "tests"))  # the run builders shared with tests/test_export.py
from lora_runs import PIXELS, lora_run  # noqa: E402

REPLICA = "vision-grpo/tiny-qwen2.5-vl"
COMMON = ["eval/evaluate.py", "--config", RECIPE, "--limit", "8", "--max_new_tokens", "16"]
RECIPE_PIXELS = [f"--{key}={value}" for key, value in PIXELS.items()]


@pytest.fixture(scope="module")
def exported(replica, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export")
    run_dir = lora_run(root / "run", REPLICA, RECIPE)
    output = root / "exported"
    check(run_python(["-m", "vision_grpo.export", "--adapter", str(run_dir), "--output", str(output)]))
    return run_dir, output


def evaluate(root: Path, name: str, args: list[str]) -> dict:
    path = root / f"{name.replace(' ', '_')}.json"
    check(run_python([*COMMON, *args, "--output", str(path)]))
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def hf_adapter(exported, tmp_path_factory) -> dict:
    """Transformers' greedy records of the unmerged adapter: what every vLLM path must reproduce."""
    run_dir, _ = exported
    args = [*RECIPE_PIXELS, "--adapter", str(run_dir), "--backend", "hf"]
    return evaluate(tmp_path_factory.mktemp("hf"), "hf adapter", args)


@pytest.fixture(scope="module")
def results(exported, hf_adapter, tmp_path_factory) -> dict[str, dict]:
    run_dir, output = exported
    runs = {
        "hf base": [*RECIPE_PIXELS, "--backend", "hf"],
        "vllm exported": ["--model_name_or_path", str(output), "--backend", "vllm"],
        "vllm adapter unmerged": [*RECIPE_PIXELS, "--adapter", str(run_dir), "--backend", "vllm"],
    }
    root = tmp_path_factory.mktemp("results")
    return {"hf adapter": hf_adapter, **{name: evaluate(root, name, args) for name, args in runs.items()}}


def test_the_adapter_changes_the_answers(results) -> None:
    texts = lambda name: [record["text"] for record in results[name]["records"]]  # noqa: E731
    assert texts("hf adapter") != texts("hf base")


def test_vllm_serves_the_exported_folder_as_transformers_answers(results) -> None:
    assert results["vllm exported"]["records"] == results["hf adapter"]["records"]
    assert results["vllm exported"]["metadata"]["max_pixels"] == PIXELS["max_pixels"]


def test_vllm_lora_serves_the_unmerged_adapter_as_transformers_answers(results) -> None:
    assert results["vllm adapter unmerged"]["metadata"]["merged"] is False
    assert results["vllm adapter unmerged"]["records"] == results["hf adapter"]["records"]


def test_plain_transformers_loads_the_folder_with_no_arguments(exported) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, output = exported
    processor = AutoProcessor.from_pretrained(output)  # with torchvision here: the full processor, video part too
    assert processor.image_processor.size["longest_edge"] == PIXELS["max_pixels"]
    AutoModelForImageTextToText.from_pretrained(output)
