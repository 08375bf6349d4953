"""HF generation that prefills each distinct prompt once and copies its cache to the prompt's G samples.

TRL hands `generate` G consecutive copies of each prompt, and the prefill - the heaviest phase of a GeoQA step in
the memory plan - runs once per copy. Here each run of identical rows (the same ids, mask and pixels) is prefilled
once, all but its last token; the cache is copied to the run's rows and `generate` goes on from there: it feeds every
row's last prompt token, samples and decodes as before. The sampling is TRL's (the same logits processors, one draw
per row and step, in the same order), so with equal logits the same seed gives the same completions; the logits
differ from the per-copy prefill's by float round-off only (another batch size, the last token on its own), which
tests/test_shared_prefill.py measures.

Dropout active during generation (TRL samples in training mode, so `lora_dropout` > 0 applies) would give the G
samples one shared mask on the prompt instead of one each - a change of their joint distribution - so while any
dropout is active the per-copy `generate` runs (the GPU recipes set `lora_dropout: 0.0`).

With `share_cache` (the default) the prompt's keys and values stay once per prompt for the whole decode
(`SharedPrefixLayer`): each row keeps only its own completion's, and a layer expands the prompt part to its rows only
while it attends, so the persistent cache is D prompts + G x completion tokens instead of G x (prompt + completion).
The attention sees the same tensors, so the samples are the same; the expansion is one broadcast copy per layer and
decoding step, about the copy a row-per-copy cache makes when it appends (benchmarks/training_pass_costs.py times both).
Gated DeltaNet's states are per row and small: copied as before.

Only caches whose layers it knows are copied (attention keys and values, Gated DeltaNet's conv and recurrent
states); anything else, or rows it cannot map to their images, keeps the per-copy `generate`, with one warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from vision_grpo.models.shared_vision import distinct_images, towers

logger = logging.getLogger(__name__)

# Cache layers whose whole state is rows of tensors in these attributes (transformers' cache_utils).
COPYABLE_LAYERS = {
    "DynamicLayer": ("keys", "values"),
    "LinearAttentionLayer": ("conv_states", "recurrent_states"),
    "LinearAttentionAndFullAttentionLayer": ("keys", "values", "conv_states", "recurrent_states"),
}


class CannotShare(ValueError):
    """These inputs or this cache cannot be shared; the per-copy generate runs instead."""


def _images_per_row(inputs: dict[str, Any], merge: int) -> list[list[int]]:
    """The indices of each row's images, in order: the processor lays a row's image tokens out image by image, one
    token per `merge` patches."""
    grid = inputs.get("image_grid_thw")
    rows = inputs["input_ids"].shape[0]
    if grid is None:
        return [[] for _ in range(rows)]
    if inputs.get("mm_token_type_ids") is None:
        raise CannotShare("no mm_token_type_ids to tell which tokens are images")
    tokens = (grid.prod(-1) // merge).tolist()
    per_row = (inputs["mm_token_type_ids"] == 1).sum(-1).tolist()
    layout, image = [], 0
    for count in per_row:
        own = []
        while count > 0 and image < len(tokens):
            own.append(image)
            count -= tokens[image]
            image += 1
        if count != 0:
            raise CannotShare("the image tokens of a row do not add up to whole images")
        layout.append(own)
    if image != len(tokens):
        raise CannotShare("more images than image tokens")
    return layout


@dataclass(frozen=True)
class Runs:
    """Runs of identical consecutive rows: `first[k]` is run k's first row, `rows[i]` the run row i belongs to."""

    first: list[int]
    rows: list[int]


def copy_runs(inputs: dict[str, Any], merge: int) -> tuple[Runs, list[list[int]]]:
    """The runs of rows with the same ids, mask and images (bit for bit, as `distinct_images` decides), and each
    row's image indices."""
    layout = _images_per_row(inputs, merge)
    grid = inputs.get("image_grid_thw")
    image = distinct_images(inputs["pixel_values"], grid).inverse if grid is not None else []
    ids, mask = inputs["input_ids"], inputs["attention_mask"]

    def same(a: int, b: int) -> bool:
        return (
            torch.equal(ids[a], ids[b])
            and torch.equal(mask[a], mask[b])
            and [image[i] for i in layout[a]] == [image[i] for i in layout[b]]
        )

    first, rows = [], []
    for row in range(ids.shape[0]):
        if not first or not same(first[-1], row):
            first.append(row)
        rows.append(len(first) - 1)
    return Runs(first, rows), layout


def distinct_inputs(inputs: dict[str, Any], runs: Runs, layout: list[list[int]]) -> dict[str, Any]:
    """The generate inputs of each run's first row only, all but the last token (which `generate` feeds itself)."""
    chosen = torch.tensor(runs.first)
    keys = ("input_ids", "attention_mask", "mm_token_type_ids")
    out = {key: inputs[key][chosen, :-1] for key in keys if key in inputs}
    images = [i for row in runs.first for i in layout[row]]
    if images:
        grid = inputs["image_grid_thw"]
        pieces = inputs["pixel_values"].split(grid.prod(-1).tolist())
        out["pixel_values"] = torch.cat([pieces[i] for i in images])
        out["image_grid_thw"] = grid[images]
    return out


class SharedPrefixLayer(DynamicLayer):
    """A full-attention cache layer whose prompt part is held once per distinct prompt (`prefix_*`: [D, heads,
    prompt, head size]) and whose rows keep only what was decoded after it; `rows[i]` is row i's prompt."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.prefix_keys, self.prefix_values = keys, values
        self._set_rows(rows)
        self.lazy_initialization(keys[:0], values[:0])
        self.keys = keys.new_empty(len(rows), keys.shape[1], 0, keys.shape[3])
        self.values = values.new_empty(len(rows), values.shape[1], 0, values.shape[3])

    def _set_rows(self, rows: torch.Tensor) -> None:
        """`copies`: G where the rows are the prompts' runs of G consecutive copies (TRL's layout), so that a prompt
        part is written to its rows by one broadcast copy; 0 otherwise (a gather, then a copy)."""
        self.rows = rows
        prompts = self.prefix_keys.shape[0]
        copies = len(rows) // prompts if len(rows) % prompts == 0 else 0
        runs = torch.arange(prompts, device=rows.device).repeat_interleave(copies) if copies else None
        self.copies = copies if runs is not None and torch.equal(rows, runs) else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self._expanded(self.prefix_keys, self.keys), self._expanded(self.prefix_values, self.values)

    def _expanded(self, prefix: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """This layer's keys or values for its rows (freed once it has attended): about the copy a row-per-copy
        cache makes at every step when it appends."""
        rows, heads, decoded, width = own.shape
        length = prefix.shape[-2]
        out = own.new_empty(rows, heads, length + decoded, width)
        out[:, :, length:] = own
        if self.copies:
            out.view(-1, self.copies, heads, length + decoded, width)[:, :, :, :length] = prefix[:, None]
        else:
            out[:, :, :length] = prefix[self.rows]
        return out

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2] + self.keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        if abs(tokens_to_remove) > self.keys.shape[-2]:
            raise CannotShare("a crop into the shared prompt")
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._set_rows(self.rows.repeat_interleave(repeats))
        self.keys, self.values = (t.repeat_interleave(repeats, dim=0) for t in (self.keys, self.values))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._set_rows(self.rows[indices])
        self.keys, self.values = self.keys[indices], self.values[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


def copy_cache_rows(cache: Any, index: torch.Tensor, share: bool = False) -> None:
    """Give each row of `index` the cache row it names, in every layer (full-attention layers shared instead of
    copied with `share`); refuse a layer it does not know."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise CannotShare(f"a {type(cache).__name__} without layers")
    for number, layer in enumerate(layers):
        names = COPYABLE_LAYERS.get(type(layer).__name__)
        if names is None:
            raise CannotShare(f"a cache layer it does not know ({type(layer).__name__})")
        if share and type(layer) is DynamicLayer:
            layers[number] = SharedPrefixLayer(layer.keys, layer.values, index)
            continue
        for name in names:
            value = getattr(layer, name)
            if isinstance(value, dict):
                setattr(layer, name, {k: v if v is None else v[index] for k, v in value.items()})
            elif isinstance(value, torch.Tensor) and value.numel() > 0:
                setattr(layer, name, value[index])


def _rope_owner(model: Any) -> Any:
    """The module that keeps Qwen-VL's `rope_deltas` between a prefill and its decoding steps."""
    for module in model.modules():
        if hasattr(module, "rope_deltas") and hasattr(module, "get_rope_index"):
            return module
    return None


@dataclass
class SharedPrefillGenerate:
    """Installed as `model.generate`: prefills each run of identical prompts once (see the module docstring)."""

    model: Any
    generate: Any  # the model's own generate
    share_cache: bool = True  # the prompt's keys and values once per prompt while decoding (SharedPrefixLayer)
    reported: bool = False
    fallback: str | None = None

    def __call__(self, **inputs: Any) -> torch.Tensor:
        # Text-only prompts and videos keep the per-copy path (their rope deltas are set elsewhere: not worth it).
        if self.fallback is not None or inputs.get("image_grid_thw") is None or "pixel_values_videos" in inputs:
            return self.generate(**inputs)
        if self._dropout_active():
            return self.generate(**inputs)
        try:
            runs, layout = copy_runs(inputs, self._patches_per_token())
            if len(runs.first) == len(runs.rows):
                return self.generate(**inputs)
            cache = self._prefill(distinct_inputs(inputs, runs, layout), torch.tensor(runs.rows))
        except CannotShare as reason:
            self.fallback = str(reason)
            logger.warning("prefill sharing off: %s; every copy is prefilled on its own from now on", reason)
            return self.generate(**inputs)
        if not self.reported:
            self.reported = True
            logger.info("prefill sharing: %d prompts prefilled once for %d rows", len(runs.first), len(runs.rows))
        rest = {k: v for k, v in inputs.items() if k not in ("pixel_values", "image_grid_thw")}
        return self.generate(**rest, cache=cache)

    def _patches_per_token(self) -> int:
        """Vision patches per image token: the square of the tower's spatial merge (4 in the Qwen-VL families)."""
        tower = next((module for _, module in towers(self.model)), None)
        if tower is None or not hasattr(tower, "spatial_merge_size"):
            raise CannotShare("no vision tower says how many patches make an image token")
        return tower.spatial_merge_size**2

    def _dropout_active(self) -> bool:
        active = next(
            (m for m in self.model.modules() if isinstance(m, torch.nn.Dropout) and m.training and m.p > 0), None
        )
        if active is not None and not self.reported:
            self.reported = True
            logger.info(
                "prefill sharing off while dropout (p = %s) is active in generation: every copy prefilled", active.p
            )
        return active is not None

    def _prefill(self, distinct: dict[str, Any], rows: torch.Tensor) -> Any:
        owner = _rope_owner(self.model)
        if owner is None:
            raise CannotShare("no module keeps the rope deltas of the prefill")
        owner.rope_deltas = None  # set by this prefill, never left from an earlier forward
        with torch.no_grad():
            output = self.model(**distinct, use_cache=True, logits_to_keep=1)
        if owner.rope_deltas is None:
            raise CannotShare("the prefill left no rope deltas")
        rows = rows.to(distinct["input_ids"].device)
        copy_cache_rows(output.cache, rows, self.share_cache)
        owner.rope_deltas = owner.rope_deltas[rows]
        return output.cache


def share_prefill(model: Any, share_cache: bool = True) -> SharedPrefillGenerate:
    """Install `SharedPrefillGenerate` on `model` (PEFT-wrapped or not); idempotent."""
    if isinstance(model.generate, SharedPrefillGenerate):
        model.generate.share_cache = share_cache
        return model.generate
    shared = SharedPrefillGenerate(model, model.generate, share_cache)
    model.generate = shared
    return shared
