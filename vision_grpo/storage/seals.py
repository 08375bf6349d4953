"""Seals: a record beside a cache file or folder of each file's size and sha256 and what it was made for, written
after the cache and checked before it is read.

A cache written by a library (`datasets`' Arrow file, a model's safetensors) cannot be trusted because it opens: a
file cut at a record boundary reads as fewer rows, a flipped bit as other values, another key's file as another
dataset, all in silence. The seal catches each (size, digest, identity), and a cache whose seal is missing (written
before seals, or cut before its seal) counts as damaged: caches are rebuilt, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vision_grpo.storage.writes import file_record, record_difference, write_text_atomic

SEAL_SUFFIX = ".seal.json"


def seal_path(cache: Path) -> Path:
    """Where the seal of `cache` lives: beside it, `<name>.seal.json`."""
    return cache.with_name(cache.name + SEAL_SUFFIX)


def _files(cache: Path) -> dict[str, Path]:
    if cache.is_dir():
        return {str(p.relative_to(cache)): p for p in sorted(cache.rglob("*")) if p.is_file()}
    return {cache.name: cache}


def seal(cache: Path, **identity: Any) -> None:
    """Record the size and sha256 of `cache` (a file, or every file in a folder) and `identity` (JSON values: what
    the cache was made for) in its seal."""
    files = {name: file_record(p) for name, p in _files(cache).items()}
    write_text_atomic(seal_path(cache), json.dumps({"identity": identity, "files": files}, indent=1))


def seal_fault(cache: Path, **identity: Any) -> str | None:
    """Why `cache` cannot be trusted, naming the file (missing, no seal, made for something else, cut short or
    grown, bytes changed), or None when every file is as sealed. Reads every sealed byte once (sha256)."""
    path = seal_path(cache)
    if not cache.exists():
        return f"{cache} does not exist"
    try:
        record = json.loads(path.read_bytes())
        sealed_identity, files = record["identity"], record["files"]
    except FileNotFoundError:
        return f"{cache} has no seal {path.name} (written by an older version, or cut off before its seal)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its seal {path} is unreadable or damaged"
    if sealed_identity != json.loads(json.dumps(identity)):
        return f"{cache} was made for {sealed_identity}, not {identity} (swapped or copied from another cache)"
    present = _files(cache)
    for name, expected in files.items():
        file = present.get(name)
        if file is None:
            return f"{cache}: {name} is missing"
        difference = record_difference(file, expected)
        if difference == "sha256":
            return f"{file} is corrupted: its bytes changed since it was sealed (sha256 differs)"
        if difference is not None:
            return f"{file} holds {difference} bytes, sealed with {expected['bytes']} (cut short, grown or replaced)"
    extra = sorted(set(present) - set(files))
    if extra:
        return f"{cache}: {extra[0]} was not there when it was sealed"
    return None
