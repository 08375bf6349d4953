"""Which reward plugin is running now, so that a stop signal during one can end it at once.

The reward registry marks every plugin call (`reward_call`); the graceful stop of a run (vision_grpo/run/stopping.py)
asks `current_reward_call` when a signal arrives and `still_running` when the plugin's grace is over: a plugin
stuck in a loop or a network call would never reach the step end where a run otherwise stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# The reward calls running now, innermost last: (name, start time).
_in_reward: list[tuple[str, float]] = []
_lock = threading.Lock()


@contextmanager
def reward_call(name: str) -> Iterator[None]:
    """Mark a reward plugin call: a stop signal during it interrupts the plugin if it has not returned within the
    stop's grace, instead of waiting for a step end that a plugin stuck in a loop would never reach."""
    with _lock:
        _in_reward.append((name, time.monotonic()))
    try:
        yield
    finally:
        with _lock:
            _in_reward.pop()


def current_reward_call() -> tuple[str, float] | None:
    """The reward call running now, as (name, start time on `time.monotonic`), or None."""
    return _in_reward[-1] if _in_reward else None


def still_running(call: tuple[str, float]) -> bool:
    """Whether the call `current_reward_call` returned earlier has not returned yet (calls it made may have)."""
    return any(running is call for running in _in_reward)


class StopRequested(KeyboardInterrupt):
    """A stop signal that could not wait for the step to end (a second signal, or one during a reward call)."""
