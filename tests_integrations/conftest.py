"""Tests against the field's tools outside TRL: lmms-eval (`make test-lmms-eval`) and the experiment trackers
(`make test-trackers`), run in `.venv-integrations` built by `tests_integrations/make_env.sh` (the main suite never
collects them). Offline, isolated caches, one torch thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO / "tests"))  # the suites' shared environment (appended: this folder's modules win)
from isolated_env import isolate  # noqa: E402

isolate("vision-grpo-integration-tests-")


def run_python(
    args: list[str], cwd: Path = REPO, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python <args>` (from the repository root unless `cwd`, with `env` added), failing with its output."""
    process = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if process.returncode != 0:
        raise AssertionError(
            f"{args} failed ({process.returncode}):\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
        )
    return process
