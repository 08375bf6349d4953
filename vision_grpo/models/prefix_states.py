"""Qwen3.5's Gated DeltaNet layers on packed group rows: each completion continues from its prompt's states.

A linear-attention layer is a recurrence, so the block mask that serves the attention layers (shared_prompt.py) means
nothing to it. On a packed row it runs twice, through the layer's own forward and so through the same kernels (the
flash-linear-attention chunked rule and causal-conv1d on a GPU, transformers' torch fallback elsewhere): once over
the prompts, which yields each prompt's convolution window and recurrent state, and once over the completion
segments, each starting from its prompt's states - what the per-copy row computes after its prompt.

The states travel in `PrefixStates`, which answers the few cache calls the layer makes. transformers' own cache
copies new states into the old tensors in place (`update_recurrent_state`), which autograd refuses once the old
tensor is saved for backward; here every state is a new tensor, so gradients flow from the segments back into the
prompt. Nothing is kept between calls, so activation checkpointing recomputes the layer like any other.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Linear-attention modules whose forward takes `(hidden_states, cache=, attention_mask=)` and reads and writes its
# states only through the calls `PrefixStates` answers (checked against the per-copy rows in tests).
CONTINUABLE = frozenset({"Qwen3_5GatedDeltaNet"})


@dataclass(frozen=True)
class PrefixLayout:
    """Where a packed batch's prompts and segments lie, as flat indices into its `rows * length` positions (the index
    `rows * length` names a zero row: padding). Prompts are left-padded, segments right-padded, like the rows the
    layer's forward expects with their 2D masks."""

    prompt_index: torch.Tensor  # [rows, longest prompt]
    prompt_mask: torch.Tensor
    segment_index: torch.Tensor  # [segments, longest segment]
    segment_mask: torch.Tensor
    segment_row: torch.Tensor  # [segments]: the packed row (so the prompt) of each segment

    @classmethod
    def of(cls, segment: torch.Tensor) -> PrefixLayout:
        """From the packed rows' segment ids (0 prompt, 1.. completions, -1 padding)."""
        rows, length = segment.shape
        pad = rows * length
        flat = torch.arange(pad, device=segment.device).view(rows, length)
        prompts = [flat[r][segment[r] == 0] for r in range(rows)]
        pieces, owner = [], []
        for r in range(rows):
            for j in range(1, int(segment[r].max()) + 1):
                pieces.append(flat[r][segment[r] == j])
                owner.append(r)
        prompt_index, prompt_mask = _padded(prompts, pad, left=True)
        segment_index, segment_mask = _padded(pieces, pad, left=False)
        return cls(prompt_index, prompt_mask, segment_index, segment_mask, torch.tensor(owner, device=segment.device))


def _padded(pieces: list[torch.Tensor], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in pieces)
    index = torch.full((len(pieces), longest), pad, dtype=torch.long, device=pieces[0].device)
    mask = torch.zeros(len(pieces), longest, dtype=torch.long, device=pieces[0].device)
    for i, piece in enumerate(pieces):
        span = slice(longest - len(piece), longest) if left else slice(0, len(piece))
        index[i, span], mask[i, span] = piece, 1
    return index, mask


class PrefixStates:
    """The cache calls a Gated DeltaNet forward makes, answered out of place (see the module docstring)."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None) -> None:
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # never the in-place one-token convolution update

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 1, **_: Any
    ) -> torch.Tensor:
        full = conv_states if self.conv is None else torch.cat([self.conv, conv_states], dim=-1)
        self.conv = F.pad(full, (max(0, conv_kernel_size - full.shape[-1]), 0))[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, **_: Any) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states

    def rows(self, index: torch.Tensor) -> PrefixStates:
        return PrefixStates(self.conv[index], self.recurrent[index])


def _continuing_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer's forward; on packed rows (a `PrefixLayout` as the mask) run over prompts, then segments."""
    layout = kwargs.get("attention_mask")
    if not isinstance(layout, PrefixLayout):
        return self.per_row_forward(hidden_states, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "cache", "cache_params")}
    rows, length, size = hidden_states.shape
    flat = torch.cat([hidden_states.reshape(rows * length, size), hidden_states.new_zeros(1, size)])
    states = PrefixStates()
    prompts = self.per_row_forward(flat[layout.prompt_index], cache=states, attention_mask=layout.prompt_mask, **kwargs)
    segments = self.per_row_forward(
        flat[layout.segment_index],
        cache=states.rows(layout.segment_row),
        attention_mask=layout.segment_mask,
        **kwargs,
    )
    out = prompts.new_zeros(rows * length + 1, size)
    for index, mask, values in (
        (layout.prompt_index, layout.prompt_mask, prompts),
        (layout.segment_index, layout.segment_mask, segments),
    ):
        keep = mask.bool()
        out = out.index_put((index[keep],), values[keep])
    return out[:-1].view(rows, length, size)


def install_prefix_continuation(model: Any) -> str | None:
    """Give every linear-attention module of `model` the packed-row path (idempotent), or say why not: a
    linear-attention module it does not know, or none at all (the caller keeps the per-copy forward)."""
    modules = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    unknown = sorted({type(m).__name__ for m in modules} - CONTINUABLE)
    if unknown or not modules:
        return f"linear-attention layers it does not know ({', '.join(unknown) or 'none found'})"
    for module in modules:
        if "per_row_forward" not in vars(module):
            module.per_row_forward = module.forward
            module.forward = types.MethodType(_continuing_forward, module)
    return None
