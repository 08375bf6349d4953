"""Torch's CPU thread count for the entry points when the user has not chosen one (`OMP_NUM_THREADS`).

torch starts one thread per core. On a small machine that also runs other work its threads spin waiting for each
other: with 2 threads on 2 busy cores the tiny recipes ran 10-100x slower (benchmarks/memory_scaling.py), and
commands started by hand, which do not get the Makefile's `OMP_NUM_THREADS=1`, ran 3-20x slower. The default here:
the cores this process may use, shared among the processes of this machine (`LOCAL_WORLD_SIZE`), minus two left for
the data path and everything else, and at least one: 1 thread on a 2-core machine, 62 for one process on 64 cores.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)
CORES_LEFT_FREE = 2


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads(processes: int | None = None) -> int:
    """Threads per process: this process's cores over the local processes (`processes`, else `LOCAL_WORLD_SIZE`),
    minus `CORES_LEFT_FREE`, at least 1."""
    local = processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, usable_cores() // max(1, local) - CORES_LEFT_FREE)


def configure_threads() -> int:
    """Apply the default unless `OMP_NUM_THREADS` is set (then torch already follows it); returns the count used.

    The variable is set too, so that processes started from here (data-loader workers, compilers) follow it.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = default_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    logger.info("torch uses %d CPU thread(s); set OMP_NUM_THREADS to change it", threads)
    return threads
