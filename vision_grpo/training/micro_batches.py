"""A generation batch cut into micro-batches that pay only for signal: whole groups, token-balanced, each cut to its
own longest prompt and completion, rows without gradient left out - and the loss normalised as TRL's would be.

TRL shuffles the generation batch and splits it into equal micro-batches that keep the whole batch's width, so a
micro-batch pads every completion to the longest of 64 and holds a prompt's copies in different micro-batches
(where they cannot share the prompt's forward, vision_grpo/models/shared_prompt.py). Here:

- `balance`: each group's rows go to one micro-batch, groups spread over the micro-batches longest first, each to
  the least loaded (load: the tokens its forward computes), and each micro-batch is cut to its own widths.
- `skip`: a row whose advantage is exactly 0 is left out. With `beta: 0` and no entropy term it adds exactly 0 to the
  loss and its gradient, so leaving it out changes nothing but the normalisers, which `loss_scale` restores: a
  micro-batch's loss is multiplied by (its rows / per_device_train_batch_size) where TRL divides by the rows it holds
  (grpo, sapo, luspo, dr_grpo), by (its tokens / the tokens its left-out rows had beside them) for bnpo, and by 1
  where TRL divides by the generation batch's tokens (dapo, cispo, vespo). The update is then the one TRL's equal
  micro-batches give - up to float summation order - for every loss type but bnpo, whose per-micro-batch token
  normaliser depends on which rows share a micro-batch (in TRL, on a random shuffle).

TRL's shuffle draws a permutation from torch's global generator; it is drawn here too (and used where `balance` is
off), so the generator's state - and with it the next generation's samples - is the same on every path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from vision_grpo.models.shared_prompt import Groups

# Keys TRL lays out over the prompt, and over prompt + completion; any other tensor as wide as the completion is
# per completion token (`layout`).
PROMPT_WIDE = ("prompt_ids", "prompt_mask")
SEQUENCE_WIDE = ("mm_token_type_ids", "token_type_ids")
ROWS_NORMALISED = frozenset({"grpo", "sapo", "luspo", "dr_grpo"})
TOKENS_NORMALISED = frozenset({"bnpo"})
BATCH_NORMALISED = frozenset({"dapo", "cispo", "vespo"})
KNOWN_NORMALISERS = ROWS_NORMALISED | TOKENS_NORMALISED | BATCH_NORMALISED
LOSS_SCALE = "loss_scale"  # the key a micro-batch carries its normaliser correction in


@dataclass(frozen=True)
class Plan:
    """Which rows each micro-batch trains on (`rows`) and held before the skip (`had`), and what the generation
    batch had in it (for the step's log)."""

    rows: list[list[int]]
    had: list[list[int]]
    spare: list[int]  # rows in no micro-batch (left out)
    groups: int
    degenerate_groups: int
    signal_positions: int  # prompt tokens of groups that train + completion tokens of rows that train

    @property
    def rows_skipped(self) -> int:
        return len(self.spare)


def plan(groups: Groups, advantages: torch.Tensor, count: int, balance: bool, skip: bool, shared_prompt: bool) -> Plan:
    """The micro-batches' rows. `groups` come from `find_groups` over the generation batch."""
    permutation = torch.randperm(len(groups.completion_len)).tolist()  # TRL's shuffle: same draw on every path
    zero = (advantages == 0).tolist()
    trains = [not (skip and z) for z in zero]
    live = [[r for r in rows if not zero[r]] for rows in groups.rows]
    signal = sum(p for rows, p in zip(live, groups.prompt_len, strict=True) if rows)
    signal += sum(groups.completion_len[r] for rows in live for r in rows)
    if balance:
        had = _balanced(groups, trains, count, shared_prompt)
    else:
        size = len(permutation) // count
        had = [permutation[i * size : (i + 1) * size] for i in range(count)]
    rows = [[r for r in mb if trains[r]] for mb in had]
    spare = [r for r in range(len(trains)) if not trains[r]]
    return Plan(rows, had, spare, len(groups.rows), sum(not rows for rows in live), signal)


def _balanced(groups: Groups, trains: list[bool], count: int, shared_prompt: bool) -> list[list[int]]:
    """Whole groups (their rows that train) spread over `count` micro-batches, the costliest first, each to the least
    loaded; each micro-batch lists its groups' rows, those left out included (`Plan.had`)."""
    pieces = [(rows, p) for rows, p in zip(groups.rows, groups.prompt_len, strict=True) if any(trains[r] for r in rows)]
    cost = [_cost([r for r in rows if trains[r]], p, groups.completion_len, shared_prompt) for rows, p in pieces]
    had: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for k in sorted(range(len(pieces)), key=lambda k: -cost[k]):
        target = load.index(min(load))
        had[target].extend(pieces[k][0])
        load[target] += cost[k]
    return had


def _cost(rows: list[int], prompt_len: int, completion_len: list[int], shared_prompt: bool) -> int:
    """Token positions the rows of one group add to their micro-batch's forward."""
    if shared_prompt:
        return prompt_len + sum(1 + completion_len[r] for r in rows)
    return len(rows) * (prompt_len + max(completion_len[r] for r in rows))


def padded(chosen: Plan, rows_each: list[int]) -> tuple[list[list[int]], list[set[int]]]:
    """Each micro-batch brought to `rows_each[k]` rows, as TRL's per-row metric gathers need on several processes:
    first with rows left out (advantage 0), then with copies of rows whose advantage the micro-batch sets to 0 (the
    positions returned). A copy adds nothing to the loss; the normalisers count it (`loss_scale` corrects that)."""
    spare = list(chosen.spare)
    out, zeroed = [], []
    for rows, target in zip(chosen.rows, rows_each, strict=True):
        rows = list(rows)
        while len(rows) < target and spare:
            rows.append(spare.pop())
        copies = set(range(len(rows), target))
        source = rows or [0]
        rows += [source[i % len(source)] for i in range(target - len(rows))]
        out.append(rows)
        zeroed.append(copies)
    return out, zeroed


def layout(key: str, value: torch.Tensor, completion_width: int) -> str:
    """How a per-row tensor of TRL's generation batch is laid out: over the `prompt` (left-padded), the `sequence`
    (prompt + completion), the `completion` (right-padded), or one value per `row`."""
    if key in PROMPT_WIDE:
        return "prompt"
    if key in SEQUENCE_WIDE:
        return "sequence"
    return "completion" if value.dim() > 1 and value.shape[1] == completion_width else "row"


def take(batch: dict[str, Any], rows: list[int], cut: bool, zeroed: set[int] = frozenset()) -> dict[str, Any]:
    """The micro-batch of `rows` (a list, possibly empty), cut to its own longest prompt and completion if `cut`,
    with the advantage of the positions in `zeroed` set to 0. `batch` has its pixel values split per row (TRL's
    `split_pixel_values_by_grid`)."""
    total = batch["prompt_ids"].shape[0]
    index = torch.tensor(rows, dtype=torch.long, device=batch["prompt_ids"].device)
    width, completion_width = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    keep_prompt, keep_completion = width, completion_width
    if cut and rows:
        keep_prompt = int(batch["prompt_mask"][index].sum(-1).max())
        keep_completion = max(1, int(batch["completion_mask"][index].sum(-1).max()))
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total:
            kind = layout(key, value, completion_width)
            value = value[index]
            if kind == "prompt":
                value = value[:, width - keep_prompt :]
            elif kind == "sequence":
                value = value[:, width - keep_prompt : width + keep_completion]
            elif kind == "completion":
                value = value[:, :keep_completion]
        elif isinstance(value, list) and len(value) == total:
            value = [value[r] for r in rows]
        out[key] = value
    if zeroed:
        out["advantages"] = out["advantages"].clone()
        out["advantages"][sorted(zeroed)] = 0.0
    return unsplit_pixel_values_by_grid(out) if rows else out


def loss_scale(loss_type: str, batch: dict[str, Any], rows: list[int], had: list[int], nominal_rows: int) -> float:
    """What multiplies the loss TRL computes on `rows` so that it is the loss of the micro-batch of `nominal_rows`
    rows that held them (module docstring); `had` are the rows the micro-batch held before the skip."""
    if loss_type in ROWS_NORMALISED:
        return len(rows) / nominal_rows
    if loss_type in TOKENS_NORMALISED:
        tokens = batch["completion_mask"].sum(-1)
        kept, held = float(tokens[rows].sum()), float(tokens[had].sum())
        return kept / held if held else 1.0
    if loss_type in BATCH_NORMALISED:
        return 1.0
    raise ValueError(f"loss_type {loss_type!r}: its normaliser is not known here, so rows cannot be left out")


def micro_batches(
    batch: dict[str, Any],
    chosen: Plan,
    loss_type: str,
    nominal_rows: int,
    cut: bool,
    rows_each: list[int] | None = None,
) -> list[dict[str, Any]]:
    """The generation batch as the micro-batches of `chosen` (module docstring), each with its `LOSS_SCALE`,
    padded to `rows_each` rows where given (several processes); an empty one has no rows and runs nothing."""
    rows, zeroed = padded(chosen, rows_each) if rows_each is not None else (chosen.rows, [set()] * len(chosen.rows))
    split = split_pixel_values_by_grid(batch)
    out = []
    for these, copies, had in zip(rows, zeroed, chosen.had, strict=True):
        micro = take(split, these, cut, copies)
        micro[LOSS_SCALE] = loss_scale(loss_type, batch, these, had, nominal_rows) if these else 0.0
        out.append(micro)
    return out
