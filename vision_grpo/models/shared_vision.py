"""Each distinct image through the vision tower once per forward, its features placed at every slot that shows it.

GRPO repeats every prompt G times, so a batch of 64 sequences holds 8 images, each 8 times, and the per-copy path
encodes all 64. The tower attends within each image (`cu_seqlens` split by image), so an image's features do not
depend on the other images of the batch: encoding the distinct ones and copying their rows to every slot gives the
same features, and the gradient of a copied row (an index gather) is the sum over its copies - what the per-copy path
accumulates in the tower's parameters, in another summation order (float round-off, measured in
tests/test_shared_vision.py).

Installed on the tower *instance* (`forward` replaced, the module and its parameter names untouched), so the module
call, its hooks (DeepSpeed ZeRO-3 gathers parameters in them) and DDP see one ordinary call per forward.

Across the passes of one optimizer step (generation, old policy, reference, policy), a frozen tower gives the same
features for the same pixels: with `StepFeatureCache` the later passes reuse them, and the trainer empties it at the
end of every step (vision_grpo/training/trainer.py).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

logger = logging.getLogger(__name__)

# The towers whose forward is `(pixel patches, grid_thw) -> features per patch / per merged token`, images independent
# of each other (attention windows within an image), checked against the per-copy path in tests/test_shared_vision.py.
# Any other tower keeps the per-copy path, with one warning.
SHAREABLE_TOWERS = frozenset(
    {
        "Qwen2_5_VisionTransformerPretrainedModel",  # Qwen2.5-VL
        "Qwen3VLVisionModel",  # Qwen3-VL (with its deepstack features)
        "Qwen3_5VisionModel",  # Qwen3.5
    }
)
# Module-name endings of vision towers, to tell "no tower" (a text model: nothing to share) from "a tower we do not
# know" (warned, per-copy).
TOWER_NAMES = ("visual", "vision_tower", "vision_model")


@dataclass(frozen=True)
class Distinct:
    """Which images of a batch are the same: `first[k]` is the index of distinct image k's first slot, `inverse[i]`
    the distinct image slot i shows, `keys[k]` distinct image k's (grid, fingerprint)."""

    first: list[int]
    inverse: list[int]
    keys: list[tuple]


def _fingerprints(pixel_values: torch.Tensor, sizes: list[int]) -> list[int]:
    """Per image, the integer sum of the bits of its pixel patches: one pass on the pixels' device, one sync.

    Integer addition (wrapping mod 2^64) is exact and order-free, so equal pixels always give equal fingerprints,
    whatever the memory layout or kernel; unequal pixels may collide, which is why `distinct_images` confirms
    every match with `torch.equal`.
    """
    bits = pixel_values.contiguous().view(torch.int16 if pixel_values.element_size() == 2 else torch.int32)
    rows = bits.sum(dim=-1, dtype=torch.int64)
    return torch.stack([piece.sum() for piece in rows.split(sizes)]).tolist()


def distinct_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Distinct:
    """The distinct images among a batch's `(pixel patches, grid)`: same grid and bit-identical patches.

    A fingerprint picks the candidate; `torch.equal` decides, so a collision of fingerprints can never merge two
    different images - it only costs one more comparison.
    """
    grids = [tuple(row) for row in grid_thw.tolist()]
    sizes = [t * h * w for t, h, w in grids]
    pieces = pixel_values.split(sizes)
    seen: dict[tuple, list[int]] = {}
    first: list[int] = []
    inverse: list[int] = []
    keys: list[tuple] = []
    for index, key in enumerate(zip(grids, _fingerprints(pixel_values, sizes), strict=True)):
        candidates = seen.setdefault(key, [])
        match = next((k for k in candidates if torch.equal(pieces[first[k]], pieces[index])), None)
        if match is None:
            match = len(first)
            first.append(index)
            keys.append(key)
            candidates.append(match)
        inverse.append(match)
    return Distinct(first, inverse, keys)


class UnmappableOutput(ValueError):
    """The tower returned a tensor that is neither per patch nor per merged token: it cannot be split by image."""


def _split_by_image(value: Any, patches: Sequence[int], tokens: Sequence[int]) -> Any:
    """`value` (a tower output: tensors inside ModelOutputs, tuples, lists) as one such structure per image."""
    if value is None:
        return [None] * len(patches)
    if isinstance(value, torch.Tensor):
        for sizes in (patches, tokens):
            if value.dim() > 0 and value.shape[0] == sum(sizes):
                return list(value.split(list(sizes)))
        raise UnmappableOutput(f"a tensor of shape {tuple(value.shape)}")
    if isinstance(value, (list, tuple)):
        columns = [_split_by_image(item, patches, tokens) for item in value]
        return [type(value)(column[i] for column in columns) for i in range(len(patches))]
    if hasattr(value, "keys"):  # transformers' ModelOutput (a dataclass and an ordered dict)
        columns = {key: _split_by_image(value[key], patches, tokens) for key in value}
        return [type(value)(**{key: column[i] for key, column in columns.items()}) for i in range(len(patches))]
    raise UnmappableOutput(f"a {type(value).__name__}")


def _join(per_image: Sequence[Any]) -> Any:
    """The inverse of `_split_by_image`: one structure whose tensors are the images' pieces in the given order."""
    sample = per_image[0]
    if sample is None:
        return None
    if isinstance(sample, torch.Tensor):
        return torch.cat(list(per_image))
    if isinstance(sample, (list, tuple)):
        return type(sample)(_join([image[i] for image in per_image]) for i in range(len(sample)))
    return type(sample)(**{key: _join([image[key] for image in per_image]) for key in sample})


@dataclass
class StepFeatureCache:
    """A frozen tower's features per distinct image, kept from the first pass of an optimizer step to its last.

    Holds, per distinct image, a copy of its pixel patches (to confirm a match bit for bit) and its features; the
    trainer calls `clear` at the end of every step, so it never holds more than one step's distinct images.
    """

    entries: dict[tuple, list[tuple[torch.Tensor, Any]]] = field(default_factory=dict)
    active: bool = False

    def get(self, key: tuple, patches: torch.Tensor) -> Any | None:
        return next((features for pixels, features in self.entries.get(key, []) if torch.equal(pixels, patches)), None)

    def put(self, key: tuple, patches: torch.Tensor, features: Any) -> None:
        """Kept without their graph: a frozen tower's features have no trainable parameter upstream, yet with
        activation checkpointing transformers makes the tower's patch embedding require grad, and a later pass's
        backward would run through the graph of the pass that filled the cache (freed by its own backward)."""
        detached = tree_map(lambda value: value.detach() if isinstance(value, torch.Tensor) else value, features)
        self.entries.setdefault(key, []).append((patches.detach().clone(), detached))

    def clear(self) -> None:
        self.entries.clear()


@dataclass
class SharedVisionTower:
    """What is installed on one tower: its class's forward, the counts the run log reports, and the optional cache."""

    tower: torch.nn.Module
    forward: Callable[..., Any]
    cache: StepFeatureCache | None = None
    slots: int = 0  # image slots the model was given
    encoded: int = 0  # images that went through the tower
    calls: int = 0  # tower forwards that ran
    reported: bool = False
    fallback: str | None = None  # why this tower went back to the per-copy path, once it did

    def __call__(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        # A tensor in kwargs (precomputed positions, seqlens) is per slot: such a call keeps the per-copy path. Flags
        # (`return_dict`) pass through; one that adds outputs split neither by patch nor by token is caught below.
        if self.fallback is not None or any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            return self._per_copy(hidden_states, grid_thw, **kwargs)
        grids = [tuple(row) for row in grid_thw.tolist()]
        merge = self.tower.spatial_merge_size**2
        distinct = distinct_images(hidden_states, grid_thw)
        pieces = hidden_states.split([t * h * w for t, h, w in grids])
        features: list[Any] = [None] * len(distinct.first)
        if self.cache is not None and self.cache.active:
            features = [self.cache.get(key, pieces[i]) for key, i in zip(distinct.keys, distinct.first, strict=True)]
        missing = [k for k, value in enumerate(features) if value is None]
        if missing:
            chosen = [distinct.first[k] for k in missing]
            output = self._run(torch.cat([pieces[i] for i in chosen]), grid_thw[chosen], **kwargs)
            patches = [pieces[i].shape[0] for i in chosen]
            try:
                computed = _split_by_image(output, patches, [n // merge for n in patches])
            except UnmappableOutput as error:
                return self._give_up(f"it returned {error}", hidden_states, grid_thw, **kwargs)
            for k, value in zip(missing, computed, strict=True):
                features[k] = value
                if self.cache is not None and self.cache.active:
                    self.cache.put(distinct.keys[k], pieces[distinct.first[k]], value)
        self._count(len(grids), len(distinct.first), len(missing))
        return _join([features[k] for k in distinct.inverse])

    def _run(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        self.calls += 1
        self.encoded += grid_thw.shape[0]
        return self.forward(hidden_states, grid_thw, **kwargs)

    def _per_copy(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        self._count(grid_thw.shape[0], None, grid_thw.shape[0])
        return self._run(hidden_states, grid_thw, **kwargs)

    def _give_up(self, reason: str, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        self.fallback = reason
        logger.warning(
            "vision sharing off for %s: %s; every image slot is encoded on its own from now on (the per-copy path)",
            type(self.tower).__name__,
            reason,
        )
        return self._per_copy(hidden_states, grid_thw, **kwargs)

    def _count(self, slots: int, distinct: int | None, encoded: int) -> None:
        """Count a forward's image slots; the run's first forward that shares (or cannot: `distinct` None) says what
        it did in the log. A forward whose images are all distinct (the shared prefill's) has nothing to report."""
        self.slots += slots
        if self.reported or distinct == slots:
            return
        self.reported = True
        what = "each encoded on its own" if distinct is None else f"{distinct} distinct images, {encoded} encoded here"
        logger.info("vision sharing: %d image slots, %s (%s)", slots, what, self.describe())

    def describe(self) -> str:
        if self.fallback is not None:
            return f"off: {self.fallback}"
        return "features also reused across the step's passes" if self.cache is not None else "once per forward"


def _frozen(tower: torch.nn.Module) -> bool:
    """No trainable parameter and no adapter inside: its features are a function of the pixels for the whole step."""
    return not any(p.requires_grad for p in tower.parameters()) and not any(
        hasattr(module, "lora_A") for module in tower.modules()
    )


def _partitioned(tower: torch.nn.Module) -> bool:
    """DeepSpeed ZeRO-3 partitions parameters (`ds_id`) and prefetches by the order modules ran in earlier steps; a
    cache that skips the tower in some passes would change that order, so ZeRO-3 keeps one tower call per forward."""
    return any(hasattr(p, "ds_id") for p in tower.parameters())


def towers(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """The vision towers of `model` (PEFT- or DDP-wrapped or not): modules named like one, outermost only."""
    found: list[str] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TOWER_NAMES and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)
            yield name, module


def share_vision_tower(model: torch.nn.Module, reuse_across_passes: bool = True) -> list[SharedVisionTower]:
    """Install sharing on each vision tower of `model`; returns what was installed (empty: nothing to share).

    `reuse_across_passes`: also keep a frozen tower's features for the step (a `StepFeatureCache`), where the tower is
    frozen and not partitioned by ZeRO-3; otherwise each forward encodes each distinct image once.
    """
    installed = []
    for name, tower in towers(model):
        kind = type(tower).__name__
        if kind not in SHAREABLE_TOWERS:
            logger.warning(
                "vision sharing off: %s (%s) is not a tower it knows (%s); every image slot is encoded on its own",
                name,
                kind,
                ", ".join(sorted(SHAREABLE_TOWERS)),
            )
            continue
        if isinstance(tower.forward, SharedVisionTower):
            installed.append(tower.forward)
            continue
        cache = StepFeatureCache() if reuse_across_passes and _frozen(tower) and not _partitioned(tower) else None
        shared = SharedVisionTower(tower, types.MethodType(type(tower).forward, tower), cache)
        tower.forward = shared
        installed.append(shared)
    return installed
