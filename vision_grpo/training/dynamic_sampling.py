"""Dynamic sampling (DAPO's): each generation batch filled with groups whose rewards are not all equal.

A group whose G completions score alike has advantage 0 everywhere and teaches nothing; as the policy improves more
groups are so, and the step learns from fewer. With `dynamic_sampling_rounds: R`, after TRL has generated and scored
a generation batch, its groups without signal are replaced by groups with signal from up to R further rounds, each
of as many new prompts as the rank that misses most still misses, generated and scored by TRL's own
`_generate_and_score_completions` (HF generation, vLLM colocate or server alike). The rounds stop once no rank has a
group left to replace, so every rank runs the same rounds; after R rounds the step trains on what it has, the log
says how many groups stayed without signal, and (with `skip_zero_advantage`) those rows skip the training pass.

The prompts of round r at optimizer step s are drawn from the training rows by a generator seeded with (seed, s, r),
the same on every rank, each rank taking its slice: a resumed run draws the prompts the uninterrupted one drew. They
come besides the plain schedule (TRL's sampler, whose epochs are unchanged: an epoch is still every training row
once through it), so a run sees more prompts per epoch; each step logs `dynamic_sampling/rounds`,
`dynamic_sampling/groups_generated`, `dynamic_sampling/groups_kept` (with signal) and
`dynamic_sampling/prompts_consumed` (over all processes), and the manifest's end record `extra_prompts` (the
prompts drawn beyond the schedule). TRL logs its reward metrics for every round's completions, kept or not.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from vision_grpo.training.micro_batches import layout

logger = logging.getLogger(__name__)


def live_groups(advantages: torch.Tensor, group: int) -> list[bool]:
    """Whether each group of `group` consecutive rows has a row with a non-zero advantage (a signal)."""
    return (advantages.view(-1, group) != 0).any(-1).tolist()


def group_rows(groups: list[int], group: int) -> list[int]:
    return [g * group + i for g in groups for i in range(group)]


def join_rows(parts: list[tuple[dict[str, Any], list[int]]], pad_token_id: int) -> dict[str, Any]:
    """One generation batch of the given rows of several (TRL's `_generate_and_score_completions` outputs): prompts
    left-padded and completions right-padded to the widest part, per-row values and images in the rows' order."""
    split = [(split_pixel_values_by_grid(batch), rows) for batch, rows in parts]
    prompt_width = max(batch["prompt_ids"].shape[1] for batch, _ in split)
    completion_width = max(batch["completion_ids"].shape[1] for batch, _ in split)
    out: dict[str, Any] = {}
    for key, value in split[0][0].items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            out[key] = value  # num_items_in_batch: the caller counts it again
            continue
        pieces = [_widened(key, batch, rows, prompt_width, completion_width, pad_token_id) for batch, rows in split]
        out[key] = torch.cat(pieces) if isinstance(pieces[0], torch.Tensor) else [x for p in pieces for x in p]
    return unsplit_pixel_values_by_grid(out)


def _widened(key: str, batch: dict[str, Any], rows: list[int], prompt: int, completion: int, pad: int) -> Any:
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        return [value[r] for r in rows]
    width, own_completion = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    kind = layout(key, value, own_completion)
    value = value[rows]
    fill = pad if key in ("prompt_ids", "completion_ids") else 0
    if kind == "prompt":
        return torch.nn.functional.pad(value, (prompt - width, 0), value=fill)
    if kind == "sequence":
        front = torch.nn.functional.pad(value[:, :width], (prompt - width, 0), value=fill)
        return torch.cat([front, torch.nn.functional.pad(value[:, width:], (0, completion - own_completion))], 1)
    if kind == "completion":
        return torch.nn.functional.pad(value, (0, completion - own_completion), value=fill)
    return value


class DynamicSampling:
    """Mixin over TRL's GRPOTrainer; `configure_dynamic_sampling` is called after GRPOTrainer's `__init__`."""

    def configure_dynamic_sampling(self, rounds: int) -> None:
        self.dynamic_sampling_rounds = rounds
        self.extra_prompts = 0  # over all processes, in this launch (the manifest records it)
        local = self.args.per_device_train_batch_size * self.args.steps_per_generation
        if rounds and local % self.num_generations:
            raise ValueError(
                f"dynamic_sampling_rounds: each process's generation batch ({local} completions) must hold whole "
                f"groups of num_generations ({self.num_generations}); change per_device_train_batch_size or "
                "steps_per_generation"
            )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if not self.dynamic_sampling_rounds or not self.model.training:
            return batch
        group = self.num_generations
        live = live_groups(batch["advantages"], group)
        kept = [(batch, group_rows([g for g, ok in enumerate(live) if ok], group))]
        missing, generated, rounds = live.count(False), len(live), 0
        while rounds < self.dynamic_sampling_rounds and (need := self._most(missing)):
            rounds += 1
            extra = super()._generate_and_score_completions(self._extra_inputs(rounds, need))
            generated += need
            found = [g for g, ok in enumerate(live_groups(extra["advantages"], group)) if ok][:missing]
            kept.append((extra, group_rows(found, group)))
            missing -= len(found)
        if missing:  # the groups without signal that no round replaced stay (their rows skip the training pass)
            kept.append((batch, group_rows([g for g, ok in enumerate(live) if not ok][:missing], group)))
        self._log_rounds(rounds, len(live), generated, len(live) - missing)
        if not rounds:  # nothing joined: TRL's batch as it came
            return batch
        joined = join_rows(kept, self.processing_class.tokenizer.pad_token_id)
        joined["num_items_in_batch"] = self.accelerator.gather(joined["completion_mask"].sum()).sum()
        return joined

    def _most(self, count: int) -> int:
        """The largest `count` of all processes: every rank generates as many groups in a round (TRL gathers the
        rewards of every rank's completions) and takes the same decision."""
        return int(self.accelerator.reduce(torch.tensor(count, device=self.accelerator.device), reduction="max"))

    def _extra_inputs(self, round_: int, groups: int) -> list[dict[str, Any]]:
        """Round `round_`'s prompts for this rank: `groups` training rows (the most any rank misses), each G times,
        drawn by a generator seeded with (seed, optimizer step, round) - the same draw on every rank, each taking its
        slice."""
        total = groups * self.accelerator.num_processes
        dataset = self.train_dataset
        draw = np.random.default_rng([self.args.seed, self.state.global_step, round_])
        chosen = draw.choice(len(dataset), size=total, replace=total > len(dataset)).tolist()
        mine = chosen[self.accelerator.process_index * groups : (self.accelerator.process_index + 1) * groups]
        return [dataset[int(i)] for i in mine for _ in range(self.num_generations)]

    def _log_rounds(self, rounds: int, groups: int, generated: int, kept: int) -> None:
        counts = torch.tensor([groups, generated, kept], dtype=torch.float64, device=self.accelerator.device)
        groups_all, generated_all, kept_all = self.accelerator.reduce(counts, reduction="sum").tolist()
        self.extra_prompts += int(generated_all - groups_all)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(1 + rounds)
        metrics["dynamic_sampling/groups_generated"].append(generated_all)
        metrics["dynamic_sampling/groups_kept"].append(kept_all)
        metrics["dynamic_sampling/prompts_consumed"].append(generated_all)
        if kept_all < groups_all:
            logger.info(
                "dynamic sampling: %d of %d groups with signal after %d extra round(s) (dynamic_sampling_rounds: %d); "
                "the step trains on them",
                kept_all,
                groups_all,
                rounds,
                self.dynamic_sampling_rounds,
            )
