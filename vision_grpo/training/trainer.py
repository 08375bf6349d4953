"""TRL's GRPOTrainer with what vision-language GRPO needs on top, as small named overrides: vision special tokens
never sampled, vLLM prompts in the form the engine expects (with the logprob-gap guard), each distinct image encoded
and each distinct prompt prefilled and cached once (vision_grpo/models/shared_vision.py, shared_prefill.py), a
training pass that forwards each prompt once per group, without padding or rows that carry no gradient
(training_pass.py), generation batches filled with groups that have a signal (dynamic_sampling.py), the vision
tower's own learning rate, and a data order that survives a resume across epochs.
"""

from __future__ import annotations

import logging
import shutil
import types
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from vision_grpo.models.shared_prefill import share_prefill
from vision_grpo.models.shared_vision import SharedVisionTower, share_vision_tower
from vision_grpo.models.vision import is_vision_parameter, vision_special_token_ids
from vision_grpo.plugins.rewards import RewardPluginError
from vision_grpo.recipe.arguments import RecipeError
from vision_grpo.storage.crash_points import crash_point
from vision_grpo.storage.writes import DiskFull, naming_a_full_disk
from vision_grpo.training.dynamic_sampling import DynamicSampling
from vision_grpo.training.logprob_guard import LogprobGapGuard
from vision_grpo.training.training_pass import GroupedTrainingPass
from vision_grpo.training.vllm_generation import VisionVLLMGeneration

logger = logging.getLogger(__name__)


def check_prompts_per_step(prompts: int, args: Any) -> None:
    """Refuse, before the model loads, a run whose data cannot fill one generation batch: TRL's sampler keeps whole
    batches of `generation_batch_size / num_generations` distinct prompts only, so with fewer prompts every epoch is
    empty and transformers ends the run at step 0 with exit status 0 and an untrained adapter. With `max_steps` set,
    transformers repeats epochs until it is reached, so one full batch is enough; without it, epochs must be > 0."""
    needed = args.generation_batch_size // args.num_generations
    if prompts < needed:
        raise RecipeError(
            f"{prompts} training prompt(s), fewer than the {needed} one generation batch draws (generation_batch_size "
            f"{args.generation_batch_size} / num_generations {args.num_generations}): no step could run. Add training "
            "rows, or lower per_device_train_batch_size or steps_per_generation"
        )
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise RecipeError(f"max_steps {args.max_steps} and num_train_epochs {args.num_train_epochs}: no step to run")


class VisionGRPOTrainer(DynamicSampling, GroupedTrainingPass, GRPOTrainer):
    """TRL's GRPOTrainer; with `vision_lr_scale` the vision tower's parameters get their own learning rate,
    generation never samples a vision special token, and the training pass pays only for signal
    (vision_grpo/training/training_pass.py).

    TRL suppresses only `image_token_id`: a sampled `<|vision_start|>` or `<|video_pad|>` reaches the training forward
    pass inside the completion, where Qwen-VL models read it as the start of an image or video that has no features.
    """

    def __init__(
        self,
        *args: Any,
        vision_lr_scale: float | None = None,
        logprob_guard: LogprobGapGuard | None = None,
        share_prompt_copies: bool = True,
        share_decode_cache: bool = True,
        share_prompt_in_training: bool = True,
        balance_micro_batches: bool = True,
        skip_zero_advantage: bool = True,
        dynamic_sampling_rounds: int = 0,
        skip_reward_faults: bool = False,
        reward_outage_steps: int = 3,
        **kwargs: Any,
    ) -> None:
        self.vision_lr_scale = vision_lr_scale
        self.skip_reward_faults = skip_reward_faults
        self.reward_outage_steps = reward_outage_steps
        self.skipped_completions = 0  # over all processes, in this launch (the manifest records it)
        self.skipped_steps = 0  # steps whose every completion was skipped: no update (the manifest records it)
        self.outage = 0  # such steps in a row, up to the latest generation
        self.scored_this_step = False  # some completion of this step's generation (any round) scored
        super().__init__(*args, **kwargs)
        self.configure_training_pass(share_prompt_in_training, balance_micro_batches, skip_zero_advantage)
        self.configure_dynamic_sampling(dynamic_sampling_rounds)
        if share_prompt_copies:  # after super(): PEFT's adapters are in place, so "frozen" means frozen
            zero3 = getattr(self.accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3
            shared = share_vision_tower(self.model, reuse_across_passes=not zero3)
            self.add_callback(StepScopedFeatures(shared))
            if not self.use_vllm:  # vLLM gets each prompt once with n = G instead (VisionPromptEngine)
                share_prefill(self.model, share_decode_cache)
        if not self.use_vllm:  # vLLM samples with its own logits processing
            already = self.generation_kwargs.get("suppress_tokens") or []
            suppressed = sorted(set(already) | set(vision_special_token_ids(self._tokenizer)))
            self.generation_kwargs["suppress_tokens"] = suppressed
            self.generation_config.suppress_tokens = suppressed
        else:  # un-expanded prompts into the engine, vision tokens biased away, the logprob gap guarded
            VisionVLLMGeneration.of(self.vllm_generation, self.processing_class, share_prompt_copies)
            self.add_callback(logprob_guard or LogprobGapGuard())

    def _save_checkpoint(self, model, trial):
        """The save, with a full disk named (`DiskFull`: the folder, about how much a checkpoint needs, what is
        free) instead of torch's `unexpected pos 64 vs 0`. One process: the half-written folder is removed, so the
        space it took is free again. Several: another rank may still be writing into it (DeepSpeed's shards), so it
        stays, named; without its `trainer_state.json` (written last), `--resume_from_checkpoint last` skips it and
        finds the previous checkpoint either way."""
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        existed = folder.exists()
        try:
            with naming_a_full_disk(folder, checkpoint_bytes(folder.parent, self.model)):
                super()._save_checkpoint(model, trial)
            crash_point(f"{folder.name} saved by the Trainer, no checksums yet")
        except DiskFull:
            if not existed and self.accelerator.num_processes == 1:
                shutil.rmtree(folder, ignore_errors=True)
            elif not existed and self.is_world_process_zero():
                logger.warning(
                    "%s is half-written and kept: another process may still be writing into it. Delete it once the "
                    "run has stopped; `--resume_from_checkpoint last` skips it",
                    folder,
                )
            raise

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards, with every reward NaN for a completion that a reward's fault skipped (`reward_faults:
        skip`): TRL leaves a completion with no reward out of its group's baseline and gives it advantage 0, where
        one reward's number beside another's skip would still move the policy. The skips are counted over all
        processes (the mask is gathered), and whether any completion was scored is noted for the step's outage
        count (`_generate_and_score_completions`)."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        refuse_infinite_totals(rewards_per_func, self.reward_weights, self.reward_func_names)
        if not self.skip_reward_faults:  # a fault has already stopped the step: nothing to mask or gather
            return rewards_per_func
        rounds = {id(r): r for f in self.reward_funcs if (r := getattr(f, "reward_round", None)) is not None}
        skipped = [False] * len(prompts)
        for scoring in rounds.values():
            skipped = [a or b for a, b in zip(skipped, scoring.take_skipped() or skipped, strict=True)]
        mask = gather(torch.tensor(skipped, dtype=torch.long, device=rewards_per_func.device)).bool()
        count = int(mask.sum())
        self.skipped_completions += count
        self._metrics["train" if self.model.training else "eval"]["rewards/skipped_completions"].append(count)
        self.scored_this_step |= not mask.all()
        rewards_per_func[mask] = torch.nan
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        """A step's generation (with dynamic sampling, every round of it: those call TRL's method directly). Under
        `reward_faults: skip`, a step none of whose completions any reward scored is an outage step: no update
        (`leave_out_during_outages`), counted; `reward_outage_steps` of them in a row stop the run."""
        self.scored_this_step = False
        batch = super()._generate_and_score_completions(inputs)
        if not self.skip_reward_faults or not self.model.training:
            return batch
        self.outage = 0 if self.scored_this_step else self.outage + 1
        self._metrics["train"]["rewards/skipped_step"].append(float(self.outage > 0))
        if self.outage >= self.reward_outage_steps or (self.outage and self.is_deepspeed_enabled):
            why = (
                "DeepSpeed steps its own optimizer, so such a step cannot be left out"
                if self.is_deepspeed_enabled
                else f"{self.outage} step(s) in a row (reward_outage_steps: {self.reward_outage_steps})"
            )
            raise RewardPluginError(
                "a reward's faults skipped every completion of a step (reward_faults: skip), "
                f"{why}: the reward looks down; the warnings above name it, its rows and values"
            )
        self.skipped_steps += int(self.outage > 0)
        return batch

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        return EpochSeededSampler.of(sampler) if isinstance(sampler, RepeatSampler) else sampler

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        leave_out_during_outages(optimizer, self)
        if self.vision_lr_scale is not None:
            split_vision_param_group(optimizer, self.model if model is None else model, self.vision_lr_scale)
        return optimizer


def leave_out_during_outages(optimizer: torch.optim.Optimizer, trainer: VisionGRPOTrainer) -> None:
    """Make `optimizer.step` do nothing while the latest generation's completions were all skipped by a reward's
    faults (`trainer.outage`); the learning-rate schedule and the step count go on. A bound method, as torch's
    schedulers wrap `step.__func__`."""
    original = optimizer.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return None if trainer.outage else original(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)


def refuse_infinite_totals(rewards_per_func: torch.Tensor, weights: torch.Tensor, names: list[str]) -> None:
    """Stop on a completion whose weighted reward total is not finite although every reward returned a finite
    value (`1e308` with weight 2): TRL's sum would give its group NaN advantages. Names the reward whose weighted
    value is largest on the first such completion (the step's gathered rows, in order)."""
    weighted = rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)
    totals = weighted.nansum(dim=1)
    bad = (~torch.isfinite(totals)).nonzero().flatten().tolist()
    if not bad:
        return
    row = bad[0]
    column = int(weighted[row].nan_to_num(0.0, posinf=float("inf"), neginf=float("inf")).abs().argmax())
    raise RewardPluginError(
        f"reward `{names[column]}`: its value {rewards_per_func[row, column].item():g} times its weight "
        f"{weights[column].item():g} makes the weighted total of completion {row} of the step "
        f"{totals[row].item()} ({len(bad)} completion(s) so). TRL adds rewards in float32 (largest 3.4e38): scale "
        "the reward or its weight down"
    )


def checkpoint_bytes(run_dir: Path, model: Any) -> int:
    """About what a checkpoint takes: the newest one in `run_dir` already saved, else three times the trainable
    weights (the weights or adapter, and AdamW's two moments)."""
    saved = sorted(
        (p for p in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if saved:
        return sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file())
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class StepScopedFeatures(TrainerCallback):
    """Scopes the frozen tower's feature cache to one optimizer step: filled by the step's first pass (generation),
    read by its later ones (old policy, reference, policy), emptied at its end - so evaluation between steps and
    the next step never see it, and it holds one step's distinct images at most."""

    def __init__(self, towers: list[SharedVisionTower]) -> None:
        self.caches = [tower.cache for tower in towers if tower.cache is not None]

    def on_step_begin(self, args, state, control, **kwargs):
        for cache in self.caches:
            cache.active = True

    def on_step_end(self, args, state, control, **kwargs):
        for cache in self.caches:
            cache.active = False
            cache.clear()


def split_vision_param_group(optimizer: Any, model: Any, scale: float) -> None:
    """Move trainable vision-tower parameters into groups whose learning rate is `scale` times the others'.

    Idempotent: the Trainer may call `create_optimizer` twice for one optimizer (DeepSpeed does), and scaling the
    vision groups again would give them `scale**2`.
    """
    vision_ids = {id(p) for n, p in model.named_parameters() if is_vision_parameter(n) and p.requires_grad}
    if not vision_ids:
        raise ValueError("vision_tower: scaled_lr, but the model has no trainable vision-tower parameters")
    for group in list(optimizer.param_groups):
        if group.get("vision_tower"):
            continue
        vision = [p for p in group["params"] if id(p) in vision_ids]
        if not vision:
            continue
        group["params"] = [p for p in group["params"] if id(p) not in vision_ids]
        optimizer.add_param_group({**group, "params": vision, "lr": group["lr"] * scale, "vision_tower": True})


class EpochSeededSampler(RepeatSampler):
    """TRL's RepeatSampler whose shuffle of epoch k is drawn from `seed + k`, whenever that epoch starts.

    TRL's sampler draws each epoch's order from one generator seeded once, so a run resumed in epoch k>0 gets a fresh
    generator and repeats epoch 0's order. The Trainer calls `set_epoch` at every epoch start (resumed or not);
    reseeding there makes the order a function of (seed, epoch). Epoch 0 keeps TRL's order exactly.
    """

    @classmethod
    def of(cls, sampler: RepeatSampler) -> EpochSeededSampler:
        sampler.__class__ = cls
        return sampler

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed + epoch)
