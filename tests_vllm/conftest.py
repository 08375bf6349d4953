"""Real-vLLM tests (`make test-vllm`, run in `.venv-vllm` built by `tests_vllm/make_env.sh`; the main suite never
collects them). Offline, isolated caches, one torch thread, a small CPU KV cache; vLLM engines start in the
entry points' own processes, so each test module starts as few as it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "tests"))  # the suites' shared environment (appended: this folder's modules win)
from isolated_env import isolate  # noqa: E402

_SESSION_HOME = isolate("vision-grpo-vllm-tests-")
os.environ.update(
    {
        # GiB of KV cache; without it the CPU backend reserves a fraction of all RAM.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # vLLM's compile cache too: nothing carried over from an earlier session.
        "VLLM_CACHE_ROOT": str(_SESSION_HOME / "vllm"),
        # What vLLM's own CPU CI sets: the model runs under dynamo with the eager backend instead of compiling C++
        # kernels with inductor (the same ops, so the same greedy tokens; a GPU run compiles for CUDA anyway).
        "VLLM_CPU_CI_ENV": "1",
        # The engine core in the entry point's own process, as TRL's colocate mode runs it, instead of a second
        # process that imports torch and vLLM again. Together they shorten each engine start.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
)
RECIPE = "recipes/shapes/tiny_cpu_vllm_colocate.yaml"
# Prefix of a `run_python` command: the entry point runs with transformers' weight loading refused.
WITHOUT_HF_WEIGHTS = "tests_vllm/without_hf_weights.py"


@pytest.fixture(scope="session")
def replica() -> Path:
    """The embedded Qwen2.5-VL replica. Saved where torchvision is missing, it ships `preprocessor_config.json` as Hub
    checkpoints do (vision_grpo/models/processing.py), so vLLM's AutoProcessor loads it with a video processor."""
    from vision_grpo.models.embedded import TINY_MODEL, resolve_model_path

    return Path(resolve_model_path(TINY_MODEL))


def run_python(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    """`python <args>` from the repository root, output captured (not checked: some tests expect a failure)."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


def check(process: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if process.returncode != 0:
        raise AssertionError(f"{process.args} failed ({process.returncode}):\n{process.stderr[-6000:]}")
    return process
