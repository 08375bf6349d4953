"""The environment every test suite runs in (tests/, tests_vllm/, tests_integrations/): offline, caches under a new
temporary folder, one torch thread."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def isolate(prefix: str) -> Path:
    """Set this process's environment (its subprocesses inherit it); return the session's temporary home."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # One torch thread per process: the suites run several processes at once on 2 cores, and spinning
            # threads made runs 10-100x slower (benchmarks/memory_scaling.py measures it).
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "HF_HOME": str(home / "hf"),
            "VISION_GRPO_CACHE": os.environ.get("VISION_GRPO_TEST_CACHE", str(home / "vision_grpo")),
        }
    )
    return home
