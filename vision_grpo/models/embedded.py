"""The embedded default models, named like Hub models, and the one path from a recipe's `model_name_or_path` to a
folder `from_pretrained` reads.

`resolve_model_path` builds an embedded replica into the cache on first use (it is never downloaded; the builders are
in vision_grpo/models/replicas/), seals it, and rebuilds one whose seal no longer matches; it passes anything else
through unchanged, so the tiny model and `Qwen/Qwen2.5-VL-3B-Instruct` load with the same calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from filelock import FileLock

from vision_grpo.models import processing
from vision_grpo.models.replicas import build
from vision_grpo.storage.cache_home import vision_grpo_cache
from vision_grpo.storage.seals import seal, seal_fault, seal_path

logger = logging.getLogger(__name__)

# The embedded replicas, named like Hub models: the family each one replicates (vision_grpo/models/replicas/).
EMBEDDED_FAMILIES = {
    "vision-grpo/tiny-qwen2.5-vl": "qwen2.5-vl",
    "vision-grpo/tiny-qwen3-vl": "qwen3-vl",
    "vision-grpo/tiny-qwen3.5": "qwen3.5",
}
EMBEDDED_MODELS = {name: functools.partial(build.build_replica, family) for name, family in EMBEDDED_FAMILIES.items()}
TINY_MODEL = "vision-grpo/tiny-qwen2.5-vl"  # the default of the tiny recipes and the demo


def resolve_model_path(name: str) -> str:
    """A path or Hub id that `from_pretrained` can read; builds the embedded model on first use."""
    if name in EMBEDDED_MODELS:
        target = vision_grpo_cache() / f"{name.replace('/', '--')}--{_builder_version()}"
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):  # two ranks starting together build it once
            fault = seal_fault(target, model=name)
            if fault is not None:
                if target.exists() or seal_path(target).exists():
                    logger.warning("the embedded model %s cannot be used (%s): building it again", target, fault)
                else:
                    logger.info("building the embedded model %s in %s", name, target)
                _build_sealed(name, target)
        return str(target)
    path = Path(name)
    if name.startswith((".", "/", "~")) and not path.expanduser().exists():
        raise FileNotFoundError(f"model path {name} does not exist")
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not path.exists():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise FileNotFoundError(
                f"model {name} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; download it first or "
                f"use the embedded default `{TINY_MODEL}`"
            )
    return name


@functools.cache
def _builder_version() -> str:
    """A digest of the replica builders' source (every file of vision_grpo/models/replicas/, and
    vision_grpo/models/processing.py, whose processor class they save with) and the transformers version: a cached
    replica built by other code is never reused, so changing a builder (or upgrading transformers) rebuilds instead
    of loading stale files."""
    import transformers

    sources = [*sorted(Path(build.__file__).parent.glob("*.py")), Path(processing.__file__)]
    source = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in sources)
    return hashlib.sha256(source + transformers.__version__.encode()).hexdigest()[:10]


def _build_sealed(name: str, target: Path) -> None:
    """Build `name` into a staging folder beside `target`, move it into place and seal it (each file's size and
    sha256, `<target>.seal.json`): a build cut off leaves no `target`, and a replica damaged later (a weights file
    cut short or bit-flipped, a file deleted) fails its seal at the next start instead of reaching safetensors. The
    check reads the replica once a start (2.5 MB at most)."""
    staging = target.with_name(f"{target.name}.{os.getpid()}.building")
    for stale in (staging, target):
        if stale.exists():
            shutil.rmtree(stale)  # ours: a folder of the cache named by the builder's version
    seal_path(target).unlink(missing_ok=True)
    _build_embedded(name, staging)
    staging.rename(target)
    seal(target, model=name)


def _build_embedded(name: str, target: Path) -> None:
    """Build embedded model `name` into `target`; in a process of a multi-process run, in a fresh interpreter.

    In a run's process the build would meet the run's distributed state: transformers 5's `save_pretrained` writes
    the weights only on rank 0 of an initialised process group (built on another rank, the folder would hold the
    processor but no model), and under ZeRO-3 building the model runs collectives (its token embeddings resized in
    a gather) that the other ranks, waiting for the build's lock, never join (gloo: "Received data size doesn't
    match expected size"). A fresh interpreter has neither.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        code = "import sys; from vision_grpo.models.embedded import EMBEDDED_MODELS as M; M[sys.argv[1]](sys.argv[2])"
        subprocess.run([sys.executable, "-c", code, name, str(target)], check=True)
    else:
        EMBEDDED_MODELS[name](target)
