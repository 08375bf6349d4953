"""The training pass that pays only for signal, as overrides of TRL's GRPOTrainer (mixed into VisionGRPOTrainer).

- `share_prompt_in_training`: every log-prob pass (policy, old policy, reference) forwards each prompt once per group
  (vision_grpo/models/shared_prompt.py); a model or input it does not know keeps TRL's per-copy forward, with one
  warning.
- `balance_micro_batches` and `skip_zero_advantage`: the generation batch is cut into micro-batches by
  vision_grpo/training/micro_batches.py instead of TRL's shuffle-and-split, and each micro-batch's loss carries the
  normaliser TRL would have given it. Rows are left out only where that is exact: `beta: 0`, no entropy bonus and no
  entropy mask (they read every row), advantages one per row.

A micro-batch whose every row was left out runs no forward: its loss is 0 times the trainable parameters' sum, so
the optimizer still sees zero gradients (AdamW's moments and weight decay move exactly as on TRL's path). That
needs one process without DeepSpeed. With several processes every rank runs every micro-batch (DDP reduces the
gradients in the last one's backward, ZeRO-3 gathers parameters in each forward), and with as many rows on every
rank (TRL gathers per-row metrics): a micro-batch is topped up with rows left out, or copies of its rows, all with
advantage 0, so they add nothing to the update.

Logged once per step: `training_pass/positions_computed` (token positions the policy's training forwards computed),
`training_pass/positions_with_signal` (prompt tokens of groups that train and completion tokens of rows that
train), `degenerate_fraction` (groups whose rewards are all equal) and `training_pass/rows_skipped`, each summed (the
fraction: counted) over all processes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vision_grpo.models.shared_prompt import CannotPack, find_groups, pack, unpack
from vision_grpo.training.micro_batches import KNOWN_NORMALISERS, LOSS_SCALE, micro_batches, plan

logger = logging.getLogger(__name__)

# Model inputs the packed forward understands; any other (another family's pixel layout) keeps the per-copy forward.
PACKABLE_INPUTS = frozenset({"pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids"})


class GroupedTrainingPass:
    """Mixin over TRL's GRPOTrainer; `configure_training_pass` is called after GRPOTrainer's `__init__`."""

    def configure_training_pass(self, share_prompt: bool, balance: bool, skip: bool) -> None:
        self.share_prompt_in_training = share_prompt
        self.packing_refused: str | None = None
        known = self.loss_type in KNOWN_NORMALISERS
        if (balance or skip) and not known:
            logger.warning(
                "balance_micro_batches and skip_zero_advantage off: loss_type %r normalises in a way they do not "
                "know (known: %s); TRL's micro-batches",
                self.loss_type,
                ", ".join(sorted(KNOWN_NORMALISERS)),
            )
        self.balance_micro_batches = balance and known
        self.skip_zero_advantage = skip and known and self._rows_without_gradient_can_be_left_out()
        self.empty_runs_nothing = self.accelerator.num_processes == 1 and not self.is_deepspeed_enabled
        self._positions_computed = 0

    def _rows_without_gradient_can_be_left_out(self) -> bool:
        reasons = [
            ("beta is not 0 (the KL term reads every row)", self.beta != 0.0),
            ("an entropy bonus reads every row", self._entropy_bonus_enabled),
            ("top_entropy_quantile < 1 (the entropy mask reads every row)", self.top_entropy_quantile < 1.0),
            ("a router auxiliary loss reads every row", self.aux_loss_enabled),
        ]
        held = [reason for reason, holds in reasons if holds]
        if held:
            logger.info("skip_zero_advantage off: %s", "; ".join(held))
        return not held

    # -- log-probs: each prompt once per group ------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        others = {k for k, v in kwargs.items() if v is not None} - PACKABLE_INPUTS
        others -= {"batch_size", "compute_entropy", "compute_aux_loss"}
        if (
            self.share_prompt_in_training
            and self.packing_refused is None
            and not args
            and not kwargs.get("compute_aux_loss")
            and not others
        ):
            try:
                given = {k: v for k, v in kwargs.items() if v is not None}
                return self._packed_logps(model, input_ids, attention_mask, logits_to_keep, **given)
            except CannotPack as reason:
                self.packing_refused = str(reason)
                logger.warning("prompt sharing in the training pass off: %s; every row forwarded on its own", reason)
        if torch.is_grad_enabled():
            self._positions_computed += input_ids.numel()
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )

    def _packed_logps(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        num_images: list[int] | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's per-row log-probs and entropies, from packed group rows. Chunks are TRL's row ranges, so every
        process runs as many forwards as on TRL's path (ZeRO-3 gathers parameters in each)."""
        rows, width = input_ids.shape[0], input_ids.shape[1] - logits_to_keep
        prompt_ids, completion_ids = input_ids[:, :width], input_ids[:, width:]
        groups = find_groups(
            prompt_ids, attention_mask[:, :width], attention_mask[:, width:], pixel_values, image_grid_thw, num_images
        )
        unwrapped = self.accelerator.unwrap_model(model)
        logps = entropies = None
        batch_size = batch_size or rows
        for start in range(0, rows, batch_size):
            packed = pack(
                unwrapped,
                groups.restricted(range(start, start + batch_size)),
                prompt_ids,
                completion_ids,
                mm_token_type_ids,
                pixel_values,
                image_grid_thw,
                num_images,
            )
            if torch.is_grad_enabled():
                self._positions_computed += packed.positions_computed
            with self.accelerator.autocast():
                outputs = model(**packed.inputs, fused_lm_head=True)
            part = unpack(outputs.log_probs, packed, rows, logits_to_keep)
            logps = part if logps is None else logps + part
            if compute_entropy:
                part = unpack(outputs.entropy, packed, rows, logits_to_keep)
                entropies = part if entropies is None else entropies + part
        return logps, entropies, None

    # -- micro-batches: whole groups, token-balanced, rows without gradient left out ------------------------------

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of one generation batch into micro-batches, with ours in place of its shuffle-and-split."""
        if not self.model.training or not (self.balance_micro_batches or self.skip_zero_advantage):
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = self._micro_batches(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _micro_batches(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        groups = find_groups(
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_mask"],
            batch.get("pixel_values"),
            batch.get("image_grid_thw"),
            batch.get("num_images"),
        )
        skip = self.skip_zero_advantage and batch["advantages"].dim() == 1
        shared = self.share_prompt_in_training and self.packing_refused is None
        count = self.args.steps_per_generation
        chosen = plan(groups, batch["advantages"], count, self.balance_micro_batches, skip, shared)
        device = self.accelerator.device
        rows_each = None
        if not self.empty_runs_nothing:  # every rank runs every micro-batch, with as many rows (TRL's gathers)
            counts = torch.tensor([len(rows) for rows in chosen.rows], device=device)
            rows_each = self.accelerator.gather(counts).view(-1, count).amax(0).clamp(min=1).tolist()
        out = micro_batches(
            batch, chosen, self.loss_type, self.args.per_device_train_batch_size, self.balance_micro_batches, rows_each
        )
        counts = [chosen.degenerate_groups, chosen.groups, chosen.rows_skipped, chosen.signal_positions]
        summed = self.accelerator.reduce(torch.tensor(counts, dtype=torch.float64, device=device), reduction="sum")
        degenerate, total, skipped, signal = summed.tolist()
        metrics = self._metrics["train"]
        metrics["degenerate_fraction"].append(degenerate / max(total, 1.0))
        metrics["training_pass/rows_skipped"].append(skipped)
        metrics["training_pass/positions_with_signal"].append(signal)
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss times the micro-batch's normaliser correction; for a micro-batch without rows, no forward."""
        if LOSS_SCALE not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if inputs["prompt_ids"].shape[0] == 0:
            trainable = [p for p in model.parameters() if p.requires_grad]
            return sum(p.sum() for p in trainable) * 0.0
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * inputs[LOSS_SCALE]

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._step % self.current_gradient_accumulation_steps == 0:
            computed = torch.tensor([float(self._positions_computed)], device=self.accelerator.device)
            self._metrics["train"]["training_pass/positions_computed"].append(
                self.accelerator.reduce(computed, reduction="sum").item()
            )
            self._positions_computed = 0
        return loss
