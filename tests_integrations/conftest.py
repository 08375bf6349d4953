"""Tests against the field's tools outside TRL: lmms-eval (`make test-lmms-eval`) and the experiment trackers
(`make test-trackers`), run in `.venv-integrations` built by `tests_integrations/make_env.sh` (the main suite never
collects them). Offline, isolated caches, one torch thread."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_SESSION_HOME = Path(tempfile.mkdtemp(prefix="vision-grpo-lmms-eval-tests-"))
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HF_HOME": str(_SESSION_HOME / "hf"),
        "VISION_GRPO_CACHE": str(_SESSION_HOME / "vision_grpo"),
    }
)


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
