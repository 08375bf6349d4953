"""A graceful stop on SIGINT/SIGTERM for every entry point's trainer, agreed by all ranks at a step boundary.

Launchers differ: torchrun's agent (`accelerate launch` with a multi-process config) sends the signal it gets on to
its workers and waits for them; accelerate's plain launcher forwards nothing and dies of a SIGTERM at once, and
`vision_grpo.run.launched` then sends the worker SIGTERM (the entry points import it first).
"""

from __future__ import annotations

import logging
import signal
import time

from accelerate import Accelerator
from transformers import TrainerCallback

from vision_grpo.plugins.reward_calls import StopRequested, current_reward_call

logger = logging.getLogger(__name__)


class GracefulStop(TrainerCallback):
    """On SIGINT/SIGTERM: finish the current step, save a checkpoint, stop. A second signal stops at once, and so
    does the first one while a reward plugin runs (the run then ends at its last checkpoint).

    With several processes the request is agreed at every step boundary (accelerate's `set_trigger` on a rank that
    was asked, `check_trigger` on all: a sum over the ranks), so all stop after the same step even when the signal
    reached only one of them or reached them during different steps; a rank that stopped alone would leave the
    others waiting in their next collective forever. One process needs no collective and syncs no device for it.
    `accelerator`: the trainer's (`trainer.accelerator`), which holds the trigger.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.requested = False

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, frame) -> None:
        if self.requested:
            raise StopRequested(f"signal {signum} again: stopping at once, without saving")
        if running := current_reward_call():
            name, since = running
            raise StopRequested(
                f"signal {signum} during reward `{name}` (running for {time.monotonic() - since:.0f} s): stopping at "
                "once; the run resumes from its last checkpoint"
            )
        logger.warning("signal %d: saving a checkpoint after this step, then stopping", signum)
        self.requested = True

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
