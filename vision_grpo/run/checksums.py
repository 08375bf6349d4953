"""Checksums of what a checkpoint holds: recorded after each save (`CheckpointChecksums`), checked before a resume
reads a checkpoint (`checksum_fault`), so a file cut short or corrupted later is named before torch or safetensors
read it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from vision_grpo.run.manifest import read_manifest
from vision_grpo.storage.writes import file_record, record_difference, write_text_atomic

CHECKSUMS = "checksums.json"


# Written by the other ranks while the main process may already be hashing: theirs to check, not ours.
OTHER_RANKS_FILES = re.compile(r"rng_state_[1-9][0-9]*\.pth")


def write_checksums(checkpoint: Path) -> None:
    """Record the size and sha256 of every file the main process wrote into `checkpoint` (`checksums.json`)."""
    files = sorted(
        p
        for p in checkpoint.iterdir()
        if p.is_file() and p.name != CHECKSUMS and not OTHER_RANKS_FILES.fullmatch(p.name)
    )
    sums = {p.name: file_record(p) for p in files}
    write_text_atomic(checkpoint / CHECKSUMS, json.dumps(sums, indent=1))


def checksum_fault(checkpoint: Path) -> str | None:
    """The first file of `checkpoint` that is missing, cut short or changed since it was saved, or None (also for a
    checkpoint of a run started before checksums were recorded: nothing to compare). In a run folder whose manifest
    says its checkpoints carry checksums, a checkpoint without them is a fault: its files cannot be verified (the
    save was cut before they were written, or they were deleted)."""
    path = checkpoint / CHECKSUMS
    if not path.is_file():
        manifest = read_manifest(checkpoint.parent) or {}
        return f"no {CHECKSUMS}, so its files cannot be verified" if manifest.get("checkpoint_checksums") else None
    try:
        sums = json.loads(path.read_bytes())
    except ValueError:
        return f"a {CHECKSUMS} that is not valid JSON"
    for name, expected in sums.items():
        file = checkpoint / name
        if not file.is_file():
            return f"no {name} (listed in {CHECKSUMS})"
        difference = record_difference(file, expected)
        if difference == "sha256":
            return f"{name} corrupted: its bytes changed since it was saved (sha256 differs from {CHECKSUMS})"
        if difference is not None:
            return f"{name} of {difference} bytes, saved with {expected['bytes']} (cut short or replaced)"
    return None


class CheckpointChecksums(TrainerCallback):
    """After each checkpoint save, record the checksums of its files, so a resume notices a corrupted one."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if folder.is_dir():
                write_checksums(folder)
        return control
