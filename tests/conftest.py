"""Shared test set-up: offline, isolated caches, the embedded tiny model, and a runner for the real entry points."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import preloaded
import pytest

REPO = Path(__file__).resolve().parent.parent
# Isolated from the user's caches, and nothing may reach the network.
_SESSION_HOME = Path(tempfile.mkdtemp(prefix="vision-grpo-tests-"))
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # One torch thread per process: the suite runs several processes at once on 2 cores, and spinning threads
        # made runs 10-100x slower (benchmarks/memory_scaling.py measures it).
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HF_HOME": str(_SESSION_HOME / "hf"),
        "VISION_GRPO_CACHE": os.environ.get("VISION_GRPO_TEST_CACHE", str(_SESSION_HOME / "vision_grpo")),
    }
)


# The embedded replicas, one per Qwen-VL family; end-to-end tests are parametrised over them.
FAMILY_MODELS = ["vision-grpo/tiny-qwen2.5-vl", "vision-grpo/tiny-qwen3-vl", "vision-grpo/tiny-qwen3.5"]


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The embedded tiny VLM, built once per test session through the same resolver the recipes use."""
    from vision_grpo.modeling import TINY_MODEL, resolve_model_path

    return Path(resolve_model_path(TINY_MODEL))


def run_script(args: list[str], timeout: float = 600, env: dict[str, str] | None = None, check: bool = True):
    """Run `python <args>` from the repository root (as a user would) and return the completed process."""
    process = preloaded.run(args, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout)
    if check and process.returncode != 0:
        raise AssertionError(
            f"{args} failed ({process.returncode}):\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
        )
    return process


# `make test` runs `pytest -n 2 --dist loadgroup`. A file's tests share its module-scoped fixtures (trained runs,
# written fixtures), so by default they stay on one worker, which builds each fixture once. In these files the
# tests are independent end-to-end runs, each a minute or so: spread over the workers, except the tests that share
# one parametrised module fixture, kept together per parameter. (test_families.py is not spread: its recorded
# trainings, one per parameter, were built twice when its tests were.)
SPREAD_FILES = {"test_resume.py", "test_distributed.py", "test_vqa.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        file = item.path.name
        if file not in SPREAD_FILES:
            item.add_marker(pytest.mark.xdist_group(file))
            continue
        callspec = getattr(item, "callspec", None)
        for name in item.fixturenames:
            definitions = item._fixtureinfo.name2fixturedefs.get(name)
            if definitions and definitions[-1].scope == "module" and callspec and name in callspec.params:
                item.add_marker(pytest.mark.xdist_group(f"{file}::{name}[{callspec.id}]"))
                break
