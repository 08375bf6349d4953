"""`eval/evaluate.py --backend vllm` against the HF backend on the embedded replica: the same records and summary.

The recipe's pixel limits are overridden so that the processor upscales the 140-px images (49 image tokens, not
the checkpoint's 25): vLLM matches only if those limits reach it, and only if the prompt enters un-expanded (the
backend refuses any engine prompt that is not the evaluator's, token for token). The vLLM run has transformers'
weight loading refused (tests_vllm/without_hf_weights.py): the engine holds the only copy of the weights."""

from __future__ import annotations

import json

import pytest
from conftest import RECIPE, WITHOUT_HF_WEIGHTS, check, run_python

PIXELS = ["--min_pixels", "40000", "--max_pixels", "50176"]
COMMON = ["eval/evaluate.py", "--config", RECIPE, *PIXELS, "--limit", "12", "--max_new_tokens", "16"]
TIMING = ("samples_per_s", "total_seconds")


@pytest.fixture(scope="module")
def results(replica, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for backend in ("hf", "vllm"):
        output = root / f"{backend}.json"
        guard = [WITHOUT_HF_WEIGHTS] if backend == "vllm" else []
        process = check(run_python([*guard, *COMMON, "--backend", backend, "--output", str(output)]))
        out[backend] = json.loads(output.read_text())
        out[backend]["stdout"] = process.stdout
    return out


def test_vllm_backend_gives_the_hf_backend_records(results) -> None:
    hf, vllm = results["hf"]["records"], results["vllm"]["records"]
    assert len(hf) == 12
    assert vllm == hf


def test_vllm_backend_gives_the_hf_backend_summary(results) -> None:
    strip = lambda summary: {k: v for k, v in summary.items() if k not in TIMING}  # noqa: E731
    assert strip(results["vllm"]["summary"]) == strip(results["hf"]["summary"])


def test_the_backend_is_recorded(results) -> None:
    assert results["hf"]["metadata"]["backend"] == "hf"
    assert results["vllm"]["metadata"]["backend"] == "vllm"


def test_the_vllm_backend_ran_with_hf_weights_refused(results) -> None:
    """The guard was in place (it reports the peak on exit) and the run still finished."""
    assert "peak_rss_kib=" in results["vllm"]["stdout"]
    assert results["vllm"]["metadata"]["dtype"] == "float32"  # the engine's dtype: the recipe's
