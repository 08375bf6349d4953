"""Atomic writes and a full disk named: every file the project writes itself goes through `write_text_atomic` or
`naming_a_full_disk`, so that ENOSPC (or a full quota) ends in one message naming the path, the space the write
needed and what is free there, instead of a raw errno or a library's own words for it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vision_grpo.storage.crash_points import crash_point

# A write that found no room: the device is full, or the user's quota is.
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """A write that failed for lack of space, naming the path, the space it needed and what is free there."""


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem that holds `path` (or its nearest existing parent); None if unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def sized(count: int | None) -> str:
    """A byte count for a message: `512 bytes`, `3.4 MB`, `12.0 GB`."""
    if count is None:
        return "an unknown amount"
    if count < 1000:
        return f"{count} bytes"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"  # unreachable: kB covers the rest


def full_disk_message(path: Path, needed: int | None) -> str:
    """What a user sees when a write of about `needed` bytes to `path` found the disk full."""
    return (
        f"no space left on the device to write {path}: the write needed about {sized(needed)} and "
        f"{sized(free_bytes(path))} is free there; free some space and run the same command again (finished work "
        "is kept)"
    )


# How libraries that raise no OSError of their own report a full disk: safetensors (Rust's I/O error, errno 28 or
# 122), and torch's zip writer, which says only that its position did not move (`unexpected pos 576 vs 534`, measured
# on a full tmpfs) or that a write failed: that one counts as a full disk when what is free is less than the write
# needed.
FULL_DISK_WORDS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
TORCH_WRITE_FAILED = ("unexpected pos", "file write failed")


def is_full_disk(error: BaseException, path: Path, needed: int | None) -> bool:
    """Whether `error` (or an error it was raised from) is a write to `path` that found no room."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_DISK_ERRNOS:
            return True
        text = str(seen)
        if any(words in text for words in FULL_DISK_WORDS):
            return True
        if any(words in text for words in TORCH_WRITE_FAILED):
            free = free_bytes(path)
            return free is not None and needed is not None and free < needed
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def naming_a_full_disk(path: Path, needed: int | None) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT, or a library's words for it, `is_full_disk`) met in the block into
    `DiskFull` naming `path` and `needed` bytes; every other error passes unchanged."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        if not is_full_disk(error, path, needed):
            raise
        raise DiskFull(errno.ENOSPC, full_disk_message(path, needed)) from error


# The suffix `write_text_atomic` gives its temporary file: `.<host>.<pid>-<8 hex>.tmp` (older versions: no host).
TEMPORARY_SUFFIX = re.compile(r"(?:\.(?P<host>[A-Za-z0-9-]+))?\.(?P<pid>[0-9]+)-[0-9a-f]{8}\.tmp")
# This machine in a temporary's name, so that a process id is only ever checked on the machine it belongs to.
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
# A temporary older than this is a killed writer's whatever its process id says: writing one takes milliseconds.
STALE_TEMPORARY_S = 3600.0


def temporary_writer(candidate: Path, path: Path) -> tuple[str | None, int] | None:
    """The (host, process id) of the writer whose temporary file of `write_text_atomic(path)` `candidate` is, or
    None if it is not one."""
    name, stem = candidate.name, path.name
    if candidate.parent != path.parent or not name.startswith(stem):
        return None
    match = TEMPORARY_SUFFIX.fullmatch(name[len(stem) :])
    return (match["host"], int(match["pid"])) if match else None


def is_temporary_of(candidate: Path, path: Path) -> bool:
    """Whether `candidate` is a temporary file of `write_text_atomic(path)`: one that a writer killed before its
    rename left behind, or one being written now."""
    return temporary_writer(candidate, path) is not None


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` that writers killed before their rename left: those of this machine whose
    process is not running, and any older than `STALE_TEMPORARY_S` (a writer on another machine sharing the folder
    has a process id this one cannot check). A live writer's temporary is never touched; costs one folder listing."""
    for candidate in path.parent.glob(f"{glob.escape(path.name)}.*.tmp"):
        writer = temporary_writer(candidate, path)
        if writer is None:
            continue
        host, pid = writer
        try:
            old = time.time() - candidate.stat().st_mtime > STALE_TEMPORARY_S
        except FileNotFoundError:
            continue  # its writer renamed or removed it meanwhile
        if old or (host == HOST and pid != os.getpid() and not process_running(pid)):
            candidate.unlink(missing_ok=True)


def process_running(pid: int) -> bool:
    """Whether a process with this id runs on this machine (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def held_open_elsewhere(paths: set[Path]) -> set[Path]:
    """Those of `paths` that another process of this machine holds open (a live writer's file): one look at every
    process's open files in /proc (those of another user's processes cannot be read, and count as not held). Our
    own temporaries need none of it (their names carry their writer); the rows cache's clean-up after a full disk
    does: `datasets` names its temporary at random in the folder every key's pass shares, and a file another pass
    still writes is told from a dead one only by its open handle."""
    targets = {os.path.realpath(path): path for path in paths}
    held: set[Path] = set()
    for descriptors in Path("/proc").glob("[0-9]*/fd"):
        if not targets:
            break  # every path found: the other processes need not be read
        if descriptors.parent.name == str(os.getpid()):
            continue
        with contextlib.suppress(OSError):  # ended meanwhile, or not ours to read
            for descriptor in descriptors.iterdir():
                with contextlib.suppress(OSError):
                    found = targets.pop(os.readlink(descriptor), None)
                    if found is not None:
                        held.add(found)
    return held


@contextmanager
def replaced_atomically(path: Path, needed: int | None = None) -> Iterator[Path]:
    """A temporary path to write `path`'s new content into (a file of any size, streamed), renamed onto `path` when
    the block ends: the final name never holds a partial file, a full disk leaves the previous file as it was and
    says so (`DiskFull`, with `needed` bytes when known), and any failure removes the temporary. The content is
    flushed to disk before the rename and the rename after it (fsync), so a power cut leaves the old file or the new
    one, whole.

    The temporary name is unique, so two writers of one file never write into, or rename, each other's half-file;
    temporaries that killed writers left are removed first (`remove_stale_temporaries`).
    """
    remove_stale_temporaries(path)
    tmp = path.with_name(f"{path.name}.{HOST}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with naming_a_full_disk(path, needed):
            yield tmp
            _fsync(tmp)
        crash_point(f"{path.name} written, not yet renamed")
        tmp.replace(path)
        _fsync(path.parent)
        crash_point(f"{path.name} renamed into place")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync(path: Path) -> None:
    """Flush a file's content, or a folder's entries, to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through `replaced_atomically`."""
    data = text.encode("utf-8")
    with replaced_atomically(path, len(data)) as tmp, tmp.open("xb") as sink:  # the umask applies, as for any file
        sink.write(data)
        sink.flush()


def append_bytes(path: Path, data: bytes) -> None:
    """Append `data` to `path` in one unbuffered write: on a full disk what is already in the file stays whole (a
    line cut short at the end is the reader's to drop) and the error is `DiskFull`, raised here, never again at
    close."""
    with naming_a_full_disk(path, len(data)), path.open("ab", buffering=0) as sink:
        view = memoryview(data)
        while view:
            view = view[sink.write(view) :]
    crash_point(f"{path.name} appended")


def file_sha256(path: Path) -> str:
    """sha256 of one file's bytes, read in 16 MB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """What seals and checkpoint checksums record of a file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def record_difference(path: Path, record: dict[str, Any]) -> int | str | None:
    """How `path` differs from its `file_record`: its size when that changed (the cheap check, first), "sha256" when
    only its bytes did, None when it is as recorded."""
    size = path.stat().st_size
    if size != record["bytes"]:
        return size
    return "sha256" if file_sha256(path) != record["sha256"] else None
