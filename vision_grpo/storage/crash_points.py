"""Crash points for tests: a process that stops dead at the k-th durable write, as a power cut or SIGKILL would.

`crash_point(name)` marks a moment just after a write became durable (or just before a rename makes it visible).
Unset (always, outside tests) it costs one global read. `VISION_GRPO_CRASH_LOG=<file>` appends each point's name to
the file as it is passed, so a test counts the points of an uninterrupted run; `VISION_GRPO_CRASH_AT=<k>` kills
the process with SIGKILL at the k-th point (1-based): no `finally`, no atexit, no flush, as a real crash.
"""

from __future__ import annotations

import os
import signal

CRASH_AT = int(os.environ.get("VISION_GRPO_CRASH_AT", "0") or 0)
CRASH_LOG = os.environ.get("VISION_GRPO_CRASH_LOG") or None
ENABLED = bool(CRASH_AT or CRASH_LOG)
passed = 0


def crash_point(name: str) -> None:
    """Count one durable write named `name`; log it, and SIGKILL this process if it is the one to crash at."""
    if not ENABLED:
        return
    global passed
    passed += 1
    if CRASH_LOG is not None:
        fd = os.open(CRASH_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {passed} {name}\n".encode())
        finally:
            os.close(fd)
    if passed == CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)
