"""A graceful stop on SIGINT/SIGTERM for every entry point's trainer, agreed by all ranks at a step boundary.

Launchers differ: torchrun's agent (`accelerate launch` with a multi-process config) sends the signal it gets on to
its workers and waits for them; accelerate's plain launcher forwards nothing and dies of a SIGTERM at once, and
`vision_grpo.run.launched` then sends the worker SIGTERM (the entry points import it first).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from accelerate import Accelerator
from transformers import TrainerCallback

from vision_grpo.plugins.reward_calls import StopRequested, current_reward_call, still_running

logger = logging.getLogger(__name__)

# How long a reward plugin running when the first signal arrives may take to return before the run stops at once.
# Long enough for any healthy call (a batch of math_verify checks takes well under a second), short enough that a
# plugin stuck in a loop or a network call does not hold a run a user asked to stop.
REWARD_STOP_GRACE_S = 10.0


class GracefulStop(TrainerCallback):
    """On SIGINT/SIGTERM: finish the current step, save a checkpoint, stop. A second signal stops at once.

    A signal that arrives while a reward plugin runs asks for the same graceful stop, and gives the plugin
    `REWARD_STOP_GRACE_S` to return: a plugin stuck in a loop or a network call would never reach the step end, so
    if that call is still running then, the run stops at once (it then resumes from its last checkpoint). Without
    the grace a Ctrl-C that happened to land in a healthy reward call lost the step's checkpoint.

    With several processes the request is agreed at every step boundary (accelerate's `set_trigger` on a rank that
    was asked, `check_trigger` on all: a sum over the ranks), so all stop after the same step even when the signal
    reached only one of them or reached them during different steps; a rank that stopped alone would leave the
    others waiting in their next collective forever. One process needs no collective and syncs no device for it.
    `accelerator`: the trainer's (`trainer.accelerator`), which holds the trigger.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.requested = False
        # The reward call whose grace ran out: the grace timer re-sends the signal to interrupt it.
        self._overdue: tuple[str, float] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, frame) -> None:
        if self._overdue is not None:
            overdue, self._overdue = self._overdue, None
            if still_running(overdue):
                name, since = overdue
                raise StopRequested(
                    f"signal {signum} during reward `{name}`, still running {REWARD_STOP_GRACE_S:g} s later "
                    f"(running for {time.monotonic() - since:.0f} s): stopping at once; the run resumes from its "
                    "last checkpoint"
                )
            return  # the call returned meanwhile: the graceful stop goes on
        if self.requested:
            raise StopRequested(f"signal {signum} again: stopping at once, without saving")
        self.requested = True
        if running := current_reward_call():
            logger.warning(
                "signal %d during reward `%s`: saving a checkpoint after this step if it returns within %g s, "
                "otherwise stopping at once",
                signum,
                running[0],
                REWARD_STOP_GRACE_S,
            )
            timer = threading.Timer(REWARD_STOP_GRACE_S, self._interrupt_if_still_running, (running, signum))
            timer.daemon = True
            timer.start()
            return
        logger.warning("signal %d: saving a checkpoint after this step, then stopping", signum)

    def _interrupt_if_still_running(self, running: tuple[str, float], signum: int) -> None:
        """The grace timer: a handler runs only in the main thread, so the signal is sent again to get there."""
        if still_running(running):
            self._overdue = running
            os.kill(os.getpid(), signum)

    def on_step_end(self, args, state, control, **kwargs):
        if self.agreed():
            control.should_save = True
            control.should_training_stop = True
        return control

    def agreed(self) -> bool:
        """Whether any process was asked to stop."""
        if self.accelerator.num_processes == 1:
            return self.requested
        if self.requested:
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()
