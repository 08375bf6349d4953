"""`recipes/train.py`, run unchanged, with a callback that records what each process holds after every step.

The entry point takes no callbacks, so this swaps `GracefulStop` (which it always installs) for a subclass that
keeps its behaviour and records, per process: parameter checksums at the start and after each optimizer step,
the optimizer's parameter groups (learning rate, which parameters), the distributed set-up, and the logs.
It also records the token ids every generation started from and produced (`generation` events), the ids of the
rows each process generated held-out completions for (`evaluator_generation`) and the held-out records each
process summarized (`holdout_records`), and with
`$VISION_GRPO_TEST_FORCE_VISION_TOKENS` set it adds a large bias to the vision special tokens' logits, so a model
that is not prevented from sampling them does.
Usage is the entry point's: `python tests/recording/train_recorded.py --config <recipe> [--key value ...]`.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from recorder import FORCE_ENV, GLOO_ONLY_ENV, force_vision_tokens, parameter_checksums, record

from vision_grpo.evaluation.evaluator import Evaluator
from vision_grpo.models import loading
from vision_grpo.models.vision import is_vision_parameter
from vision_grpo.run import stopping
from vision_grpo.training import holdout, trainer

ENTRY_POINT = Path(__file__).resolve().parents[2] / "recipes" / "train.py"


def _param_groups(optimizer, model) -> list[dict]:
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [
        {
            "lr": group["lr"],
            "vision_tower": bool(group.get("vision_tower")),
            "names": sorted(names[id(parameter)] for parameter in group["params"] if id(parameter) in names),
        }
        for group in optimizer.param_groups
    ]


class RecordingStop(stopping.GracefulStop):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        record(
            "begin",
            checksums=parameter_checksums(model, is_vision_parameter),
            trainable=sorted(name for name, parameter in model.named_parameters() if parameter.requires_grad),
        )
        return super().on_train_begin(args, state, control, model=model, **kwargs)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        from accelerate import PartialState

        record(
            "step",
            step=state.global_step,
            checksums=parameter_checksums(model, is_vision_parameter),
            param_groups=_param_groups(optimizer, model),
            optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__,
            distributed_type=str(PartialState().distributed_type),
            activation_checkpointing=bool(getattr(model, "is_activation_checkpointing", False)),
        )
        return super().on_step_end(args, state, control, model=model, optimizer=optimizer, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        record("log", step=state.global_step, logs=logs)


def _recorded_generation(original):
    def generate(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
        completion_ids, logprobs = original(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs)
        record("generation", prompt_ids=[list(map(int, ids)) for ids in prompt_ids], completion_ids=completion_ids)
        return completion_ids, logprobs

    return generate


def _recorded_evaluator_generation(original):
    def generate(self, rows, images, max_new_tokens, sampling=None):
        record("evaluator_generation", ids=[row["id"] for row in rows])
        return original(self, rows, images, max_new_tokens, sampling)

    return generate


def _recorded_summary(original):
    def summarize(records):
        record("holdout_records", records=records)
        return original(records)

    return summarize


def _forcing(original):
    def load_model(*args, **kwargs):
        return force_vision_tokens(original(*args, **kwargs))

    return load_model


if __name__ == "__main__":
    stopping.GracefulStop = RecordingStop
    trainer.VisionGRPOTrainer._generate_single_turn = _recorded_generation(
        trainer.VisionGRPOTrainer._generate_single_turn
    )
    Evaluator.generate = _recorded_evaluator_generation(Evaluator.generate)
    holdout.summarize = _recorded_summary(holdout.summarize)
    if os.environ.get(GLOO_ONLY_ENV):
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel on first use (minutes of C++ on
        # 2 cores, in every fresh CI clone) that only CPU runs ever use; without it, DeepSpeed falls back to
        # torch.distributed's gloo, as it does on any platform where the kernel cannot be built.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if os.environ.get(FORCE_ENV):
        loading.load_model = _forcing(loading.load_model)
    sys.argv = [str(ENTRY_POINT), *sys.argv[1:]]
    runpy.run_path(str(ENTRY_POINT), run_name="__main__")
