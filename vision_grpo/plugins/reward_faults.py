"""What a reward plugin did wrong on which completions, and the time limit of one call.

A plugin may misbehave on some rows only: raise on a malformed answer, return NaN or inf from a division, a string
from a parser, a list of the wrong length, or hang on a network call. TRL would turn None into NaN, a NaN reward
into a NaN advantage for the whole group, or wait for ever. Each fault is found here with the completion it belongs
to, so that the message names the row (`id`), the completion and the value, and so that a recipe with
`reward_faults: skip` can drop exactly those completions from the step (vision_grpo/plugins/rewards.py,
`_calculate_rewards` in vision_grpo/training/trainer.py) instead of the whole run.
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

SHOWN = 5  # faults quoted in a message; the rest are counted
# The signal that interrupts a reward call past its time limit. Not SIGALRM: `math_verify` (the VQA rewards) sets
# its own alarm inside every call, which would cancel ours.
TIMEOUT_SIGNAL = signal.SIGUSR1


class RewardTimeout(BaseException):
    """A reward call past `reward_timeout`; a BaseException, so that a plugin's `except Exception` cannot swallow
    it."""


@dataclass(frozen=True)
class FaultPolicy:
    """A recipe's `reward_faults` (`fail`: the step stops naming the fault; `skip`: the faulty completions get no
    reward and no advantage, counted) and `reward_timeout` (seconds a call may take; 0: no limit)."""

    skip: bool = False
    timeout: float = 0.0


FAIL = FaultPolicy()  # any fault stops the caller; no time limit (the default outside a recipe)


@dataclass(frozen=True)
class Fault:
    """One thing a reward did wrong: on completion `index`, or (index None) on the whole call."""

    index: int | None
    what: str  # `returned nan`
    why: str = ""  # `rewards must be finite (None marks 'no reward')`
    error: BaseException | None = None  # what the plugin raised, for the traceback


def value_fault(index: int, value: Any) -> Fault | None:
    """What is wrong with one returned value, or None: a reward is a finite real number, or None ("not mine")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Fault(index, f"returned {value!r}", "rewards must be numbers or None")
    if not math.isfinite(value):
        return Fault(index, f"returned {value}", "rewards must be finite (None marks 'no reward')")
    return None


def call_faults(
    call: Callable[..., Any], completions: Sequence[Any], columns: dict[str, Any], timeout: float
) -> tuple[list[float | None], list[Fault]]:
    """Call a reward on a batch: its values (None where it faulted) and its faults. A call that raises is repeated
    one completion at a time, to find the rows it fails on (a plugin's side effects then happen twice for those
    rows); a call past its time limit or returning the wrong number of values faults as a whole."""
    n = len(completions)
    try:
        with time_limit(timeout):
            values = call(completions, columns)
    except RewardTimeout:
        return [None] * n, [Fault(None, f"took more than {timeout:g} s (reward_timeout) and was stopped")]
    except Exception as error:
        return _row_by_row(call, completions, columns, timeout, error)
    if not isinstance(values, (list, tuple)) or len(values) != n:
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        return [None] * n, [Fault(None, f"returned {count} values for {n} completions")]
    faults = [fault for i, value in enumerate(values) if (fault := value_fault(i, value)) is not None]
    faulty = {fault.index for fault in faults}
    return [None if i in faulty or v is None else float(v) for i, v in enumerate(values)], faults


def _row_by_row(
    call: Callable[..., Any], completions: Sequence[Any], columns: dict[str, Any], timeout: float, error: Exception
) -> tuple[list[float | None], list[Fault]]:
    n = len(completions)
    values: list[float | None] = []
    faults = []
    for i in range(n):
        row = {key: v[i : i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for key, v in columns.items()}
        one, row_faults = call_faults(call, completions[i : i + 1], row, timeout) if n > 1 else ([None], [])
        values += one
        faults += [Fault(i, fault.what, fault.why, fault.error) for fault in row_faults]
    if not faults:  # it fails on the batch only (or on one completion): the fault is the call's
        return [None] * n, [Fault(None, f"raised {type(error).__name__}: {error}", error=error)]
    return values, faults


def describe(faults: Sequence[Fault], ids: Sequence[Any] | None, n: int) -> str:
    """The faults as a message names them, the first few: `returned nan for row id=1-2 (completion 3 of 8): rewards
    must be finite …`."""

    def where(index: int | None) -> str:
        if index is None:
            return f"on rows id={_ids(ids, range(n))}"
        return f"for row id={_ids(ids, [index])} (completion {index} of {n})"

    shown = "; ".join(f"{f.what} {where(f.index)}" + (f": {f.why}" if f.why else "") for f in faults[:SHOWN])
    return shown + (f"; and {len(faults) - SHOWN} more" if len(faults) > SHOWN else "")


def _ids(ids: Sequence[Any] | None, indices: Sequence[int]) -> str:
    named = dict.fromkeys(str(ids[i]) if ids is not None and i < len(ids) else f"#{i}" for i in indices)
    listed = list(named)
    return ", ".join(listed[:SHOWN]) + (f" and {len(listed) - SHOWN} more" if len(listed) > SHOWN else "")


# The message of the call whose time ran out, set by its watcher under `_timer_lock` just before it signals the
# main thread; the handler raises it there. Cleared when the call ends, so a signal that arrives late raises nothing.
_expired: str | None = None
_timer_lock = threading.RLock()  # reentrant: the handler may run while the main thread holds it
_handler_installed = False


def _on_timeout_signal(signum: int, frame: Any) -> None:
    global _expired
    with _timer_lock:
        message, _expired = _expired, None
    if message is not None:
        raise RewardTimeout(message)


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the body with `RewardTimeout` after `seconds` (0: no limit). A watcher thread signals the main
    thread, which breaks a blocking system call (a network read) as well as a Python loop; a C call that holds the
    GIL cannot be interrupted. Off the main thread (where Python runs no signal handlers) there is no limit."""
    global _expired, _handler_installed
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _handler_installed:  # installed once and kept: restoring the default would let a late signal kill us
        signal.signal(TIMEOUT_SIGNAL, _on_timeout_signal)
        _handler_installed = True
    done = threading.Event()
    main = threading.main_thread().ident

    def watch() -> None:
        global _expired
        if not done.wait(seconds):
            with _timer_lock:
                if not done.is_set():
                    _expired = f"past {seconds:g} s"
                    signal.pthread_kill(main, TIMEOUT_SIGNAL)

    watcher = threading.Thread(target=watch, name="reward-time-limit", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with _timer_lock:
            done.set()
            _expired = None
        watcher.join()
