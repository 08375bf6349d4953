"""Deciding once for every process of a launch: the main process decides (a check, a run name, records read from
disk) and every rank gets its answer or its error, so no two ranks decide differently on a shared folder.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from accelerate import PartialState
from accelerate.utils import broadcast_object_list


def decided_by_main_process(check: Callable[[], None]) -> None:
    """Run `check` on the main process only; if it raised, every process raises too, so no rank starts (or waits
    for a main process that has left) and no two ranks decide differently on a shared folder.

    Every exception is forwarded, whatever its type: the main process re-raises its own, the others one of the same
    type and message (a `RuntimeError` naming the type, where that type cannot be rebuilt from its message).
    """
    problem = None
    raised: BaseException | None = None
    if PartialState().is_main_process:
        try:
            check()
        except BaseException as error:  # any failure must reach the other ranks, or they wait for ever
            raised, problem = error, (type(error), _picklable(error.args, str(error)), str(error))
    problem = from_main_process(problem)
    if raised is not None:
        raise raised
    if problem:
        kind, args, message = problem
        try:
            rebuilt = kind(*args)
        except Exception:  # a type that cannot be rebuilt from its arguments
            rebuilt = RuntimeError(f"{kind.__name__}: {message}")
        raise rebuilt


def _picklable(args: tuple, message: str) -> tuple:
    """An exception's arguments, or its message alone where they cannot be sent to the other ranks."""
    try:
        pickle.dumps(args)
    except Exception:
        return (message,)
    return args


def from_main_process(value: Any) -> Any:
    """`value` as the main process has it, on every process (the run name here, resumed records in evaluation)."""
    if PartialState().num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]
