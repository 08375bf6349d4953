"""The training forward with each prompt once per group: a group's prompt and its completions packed into one row.

TRL scores every completion row as `[left padding, prompt, completion, right padding]`, so a group of G completions
carries its prompt (1,217 tokens for a GeoQA diagram, 961 of them image tokens) through the language model G times,
forward, recompute and backward. Here the rows of one prompt become one packed row

    [prompt[:-1] | prompt[-1], completion 1 | prompt[-1], completion 2 | ... | right padding]

with a block mask: the prompt attends causally to itself; each segment attends to the prompt and, causally, to its
own tokens; a padding position only to itself. The prompt's last token opens every segment (its hidden state
predicts the segment's first token, and one position can carry only one label), so a segment is exactly what the
per-copy row computes after the prompt. Positions are the model's own 3D rope positions of the prompt
(`get_rope_index`), and each segment continues from the prompt's last text position as the per-copy row does.
Qwen3.5's Gated DeltaNet layers get the same rows, cut by `PrefixContinuation` (prefix_states.py) into the prompts
and the segments, each segment continuing from its prompt's convolution and recurrent states.

Nothing is cached between calls: the packed row is one ordinary forward, so activation checkpointing recomputes it
as it recomputes any other (transformers' checkpointed layers return no cache in training, which rules out a
prefill-then-continue design under checkpointing), and gradients reach every trainable parameter through the shared
prompt - the sum over the group's completions that the per-copy rows accumulate, in another summation order.

What it does not know (another attention implementation than sdpa or eager, a layer type other than full and
linear attention, inputs beyond Qwen-VL's pixel values and grids, a completion mask with holes) raises `CannotPack`;
the trainer then keeps the per-copy forward, with one warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vision_grpo.models.prefix_states import PrefixLayout, install_prefix_continuation
from vision_grpo.models.shared_vision import distinct_images

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
IMPLEMENTATIONS = frozenset({"sdpa", "eager"})


class CannotPack(ValueError):
    """These inputs or this model cannot be packed by group; the per-copy forward runs instead."""


@dataclass(frozen=True)
class Groups:
    """Which rows show the same prompt: `rows[g]` lists group g's rows in order; `prompt_len[g]` its prompt's tokens;
    `completion_len[i]` row i's completion tokens (its completion mask is ones, then zeros)."""

    rows: list[list[int]]
    prompt_len: list[int]
    completion_len: list[int]

    def restricted(self, keep: range | list[int]) -> Groups:
        """The same groups, each with only its rows in `keep`; groups left without rows are dropped."""
        kept = set(keep)
        pairs = [([r for r in rows if r in kept], p) for rows, p in zip(self.rows, self.prompt_len, strict=True)]
        pairs = [(rows, p) for rows, p in pairs if rows]
        return Groups([rows for rows, _ in pairs], [p for _, p in pairs], self.completion_len)

    @property
    def packed_len(self) -> list[int]:
        """Each group's packed row: prompt[:-1], then per completion its prompt's last token and the completion."""
        return [
            p - 1 + sum(1 + self.completion_len[i] for i in rows)
            for rows, p in zip(self.rows, self.prompt_len, strict=True)
        ]


def _ones_then_zeros(mask: torch.Tensor) -> torch.Tensor:
    """Each row's count of leading ones, refusing a row whose ones are not one leading block."""
    counts = mask.sum(-1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] < counts[:, None]
    if not torch.equal(mask.bool(), expected):
        raise CannotPack("a completion mask with holes")
    return counts


def _image_starts(num_images: list[int] | None, rows: int) -> list[int]:
    """Where each row's images start among the batch's (row i's are `starts[i]:starts[i + 1]`)."""
    starts = [0]
    for count in num_images or [0] * rows:
        starts.append(starts[-1] + count)
    return starts


def find_groups(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    num_images: list[int] | None,
) -> Groups:
    """The rows with the same prompt tokens and the same images (bit for bit), in order of first appearance."""
    if not torch.equal(prompt_mask.flip(-1).cumprod(-1).flip(-1), prompt_mask.long()):
        raise CannotPack("a prompt mask that is not left padding")
    prompt_len = prompt_mask.sum(-1).tolist()
    if min(prompt_len) < 2:
        raise CannotPack("a prompt of fewer than two tokens")
    image_of_slot = distinct_images(pixel_values, image_grid_thw).inverse if image_grid_thw is not None else []
    starts = _image_starts(num_images, prompt_ids.shape[0])
    if image_grid_thw is not None and starts[-1] != image_grid_thw.shape[0]:
        raise CannotPack("num_images does not add up to the images")
    keys: dict[tuple, int] = {}
    rows: list[list[int]] = []
    for row in range(prompt_ids.shape[0]):
        tokens = prompt_ids[row, prompt_ids.shape[1] - prompt_len[row] :]
        key = (tuple(tokens.tolist()), tuple(image_of_slot[starts[row] : starts[row + 1]]))
        group = keys.setdefault(key, len(rows))
        if group == len(rows):
            rows.append([])
        rows[group].append(row)
    return Groups(rows, [prompt_len[r[0]] for r in rows], _ones_then_zeros(completion_mask).tolist())


@dataclass(frozen=True)
class Packed:
    """The model inputs of packed rows, and where each completion token's score lies in them."""

    inputs: dict[str, Any]
    source: torch.Tensor  # flat index into the packed rows of each scored token
    target: torch.Tensor  # flat index into the per-copy [rows, completion width] output of the same token

    @property
    def positions_computed(self) -> int:
        return int(self.inputs["input_ids"].numel())


def _rope_index(model: Any) -> Any:
    for module in model.modules():
        if hasattr(module, "get_rope_index") and hasattr(module, "rope_deltas"):
            return module.get_rope_index
    raise CannotPack("no module computes Qwen-VL's rope positions")


def _block_mask(segment: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, L, L]: causal; a prompt key (segment 0) is seen by every later query of its row, any other key only
    by its own segment; a padding query (segment -1) sees itself, so no softmax row is empty."""
    length = segment.shape[1]
    index = torch.arange(length, device=segment.device)
    causal = index[None, :] <= index[:, None]
    same = segment[:, None, :] == segment[:, :, None]
    allowed = causal[None] & ((segment[:, None, :] == 0) | same) & (segment[:, :, None] >= 0)
    allowed |= torch.eye(length, dtype=torch.bool, device=segment.device)[None]
    allowed = allowed[:, None]
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segment.device).masked_fill(~allowed, torch.finfo(dtype).min)


def pack(
    model: Any,
    groups: Groups,
    prompt_ids: torch.Tensor,
    completion_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    num_images: list[int] | None,
) -> Packed:
    """The packed rows of `groups` (see the module docstring), ready for the model's fused log-prob head."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in IMPLEMENTATIONS:
        raise CannotPack(f"attention implementation {implementation!r} (the block mask needs sdpa or eager)")
    layer_types = set(getattr(config.get_text_config(), "layer_types", None) or ["full_attention"])
    if not layer_types <= ATTENTION_LAYERS | {"linear_attention"}:
        raise CannotPack(f"layer types {sorted(layer_types - ATTENTION_LAYERS)}")
    if image_grid_thw is not None and mm_token_type_ids is None:
        raise CannotPack("no mm_token_type_ids to place the image positions")
    rope_index = _rope_index(model)
    device, width = prompt_ids.device, prompt_ids.shape[1]
    completion_width = completion_ids.shape[1]
    lengths = groups.packed_len
    rows, length = len(groups.rows), max(lengths)
    ids = prompt_ids.new_zeros(rows, length)
    types = prompt_ids.new_zeros(rows, length)
    positions = prompt_ids.new_zeros(3, rows, length)
    segment = torch.full((rows, length), -1, dtype=torch.long, device=device)
    shift_labels = torch.full((rows, length), -100, dtype=torch.long, device=device)
    starts = _image_starts(num_images, prompt_ids.shape[0])
    image_rows: list[int] = []
    source: list[torch.Tensor] = []
    target: list[torch.Tensor] = []
    for g, (members, p) in enumerate(zip(groups.rows, groups.prompt_len, strict=True)):
        first = members[0]
        tokens = prompt_ids[first, width - p :]
        token_types = mm_token_type_ids[first, width - p : width] if mm_token_type_ids is not None else None
        images = list(range(starts[first], starts[first + 1]))
        image_rows.extend(images)
        if token_types is not None:
            grid = image_grid_thw[images] if images else None
            prompt_positions = rope_index(tokens[None], mm_token_type_ids=token_types[None], image_grid_thw=grid)[0]
            prompt_positions = prompt_positions[:, 0]
        else:
            prompt_positions = torch.arange(p, device=device).expand(3, p)
        ids[g, : p - 1] = tokens[:-1]
        if token_types is not None:
            types[g, : p - 1] = token_types[:-1]
        positions[:, g, : p - 1] = prompt_positions[:, :-1]
        segment[g, : p - 1] = 0
        at, last_position = p - 1, prompt_positions[:, -1:]
        for j, row in enumerate(members, start=1):
            c = groups.completion_len[row]
            span = slice(at, at + 1 + c)
            ids[g, at] = tokens[-1]
            ids[g, at + 1 : at + 1 + c] = completion_ids[row, :c]
            positions[:, g, span] = last_position + torch.arange(1 + c, device=device)
            segment[g, span] = j
            shift_labels[g, at : at + c] = completion_ids[row, :c]
            source.append(g * length + at + torch.arange(c, device=device))
            target.append(row * completion_width + torch.arange(c, device=device))
            at += 1 + c
    mask = _block_mask(segment, implementation, model.dtype)
    inputs: dict[str, Any] = {"input_ids": ids, "position_ids": positions, "shift_labels": shift_labels}
    if "linear_attention" in layer_types:
        refused = install_prefix_continuation(model)
        if refused:
            raise CannotPack(refused)
        layout = PrefixLayout.of(segment)
        inputs["attention_mask"] = {kind: mask if kind in ATTENTION_LAYERS else layout for kind in layer_types}
    else:
        inputs["attention_mask"] = mask
    if mm_token_type_ids is not None:
        inputs["mm_token_type_ids"] = types
    if image_grid_thw is not None and image_rows:
        pieces = pixel_values.split(image_grid_thw.prod(-1).tolist())
        inputs["pixel_values"] = torch.cat([pieces[i] for i in image_rows])
        inputs["image_grid_thw"] = image_grid_thw[image_rows]
    return Packed(inputs, torch.cat(source), torch.cat(target))


def unpack(values: torch.Tensor | None, packed: Packed, rows: int, width: int) -> torch.Tensor | None:
    """Per-token values of the packed rows laid out as TRL's per-copy `[rows, completion width]`, zero where a row
    has no completion token (as TRL's fused head gives there)."""
    if values is None:
        return None
    flat = values.new_zeros(rows * width).index_put((packed.target,), values.reshape(-1)[packed.source])
    return flat.view(rows, width)
