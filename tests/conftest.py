"""Shared test set-up: offline, isolated caches, the embedded tiny model, and a runner for the real entry points."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import preloaded
import pytest
from isolated_env import isolate

REPO = Path(__file__).resolve().parent.parent
# Isolated from the user's caches, and nothing may reach the network.
isolate("vision-grpo-tests-")


# `make test` hands whole files to two workers (`--dist loadfile --no-loadscope-reorder`) in collection order: these
# files, the longest, first, so that the short ones fill the end and both workers finish together. Only a scheduling
# hint: a file not named here runs after them in its usual place, and a wrong guess costs time, never a result.
LONGEST_FILES = (
    "test_families.py",
    "test_benchmarks_smoke.py",
    "test_resume.py",
    "test_distributed.py",
    "test_evaluate.py",
    "test_demo.py",
    "test_vision_tower.py",
    "test_vqa.py",
    "test_signals.py",
    "test_gpu_check.py",
    "test_offline.py",
    "test_bad_inputs.py",
    "test_compare_runs.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests keep their order


# The embedded replicas, one per Qwen-VL family; end-to-end tests are parametrised over them.
FAMILY_MODELS = ["vision-grpo/tiny-qwen2.5-vl", "vision-grpo/tiny-qwen3-vl", "vision-grpo/tiny-qwen3.5"]


@pytest.fixture(autouse=True)
def environment_as_it_was() -> Iterator[None]:
    """Each test starts from the session's environment: an entry point called in-process sets variables for its
    own process (`TENSORBOARD_LOGGING_DIR` in `prepare_run_dir`), and left in this worker they reached every later
    subprocess (a benchmark's bare-TRL run logged into an earlier test's folder)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The embedded tiny VLM, built once per test session through the same resolver the recipes use."""
    from vision_grpo.models.embedded import TINY_MODEL, resolve_model_path

    return Path(resolve_model_path(TINY_MODEL))


def entry_point(relative: str) -> ModuleType:
    """An entry-point script of the repository (`eval/compare.py`, ...) loaded as a module, without running its
    `__main__` block: the entry points are files users run, not modules of the package."""
    spec = importlib.util.spec_from_file_location(Path(relative).stem, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(args: list[str], timeout: float = 600, env: dict[str, str] | None = None, check: bool = True):
    """Run `python <args>` from the repository root (as a user would) and return the completed process."""
    process = preloaded.run(args, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout)
    if check and process.returncode != 0:
        raise AssertionError(
            f"{args} failed ({process.returncode}):\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
        )
    return process
