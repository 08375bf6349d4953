"""What identifies a file by content and who holds a folder: every file a run or an evaluation writes goes through
an atomic write (vision_grpo/storage/writes.py), weights are identified by sha256 (remembered per file stamp), and a
folder or output is held by a lock file while a process works in it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from vision_grpo.storage.cache_home import vision_grpo_cache
from vision_grpo.storage.writes import write_text_atomic


def permissions_as_created(folder: Path) -> None:
    """Give `folder` and the files in it the modes `mkdir` and `open` would have under the process's umask (usually
    `drwxr-xr-x`, `-rw-r--r--`): a folder staged with `tempfile.mkdtemp` is `drwx------`, and some writers (safetensors)
    make their files `-rw-------`, so another account, a serving container's user among them, could not read it."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def content_digest(files: list[Path]) -> str:
    """sha256 over the names and bytes of `files`: what identifies weights by content, whatever their path.

    Remembered by each file's path, size, modification time and inode (`digest_cache_path`): a multi-GB model is
    read once, not at every start while the other ranks wait for the main process.
    """
    key = json.dumps([[str(p.resolve()), *_file_stamp(p)] for p in sorted(files, key=lambda p: p.name)])
    cache = _read_digest_cache()
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as source:
            while chunk := source.read(1 << 24):
                digest.update(chunk)
    if key == json.dumps([[str(p.resolve()), *_file_stamp(p)] for p in sorted(files, key=lambda p: p.name)]):
        _remember_digest(key, digest.hexdigest())  # only if no file changed while it was read
    return digest.hexdigest()


def _file_stamp(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def digest_cache_path() -> Path:
    """Where content digests are remembered: `digests.json` in our cache (`$VISION_GRPO_CACHE`, else
    `~/.cache/vision_grpo`)."""
    return vision_grpo_cache() / "digests.json"


def _read_digest_cache() -> dict[str, str]:
    try:
        cache = json.loads(digest_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: digests are then computed, never guessed
        return {}
    return cache if isinstance(cache, dict) else {}


def _remember_digest(key: str, digest: str) -> None:
    path = digest_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_digest_cache()
        cache[key] = digest
        write_text_atomic(path, json.dumps(dict(list(cache.items())[-256:])))
    except OSError:  # a read-only home: the digest is still right, only not remembered
        pass


@contextmanager
def hold_lock(lock: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the lock file `lock` while the block runs; raise `busy(holder's pid)` at once if another process holds it.

    filelock's `FileLock`: an OS lock (`flock`) that ends with its process, however that process ends, so a lock
    left by a killed run is recognised as stale and taken over; where the filesystem has no `flock` (Lustre mounted
    without it, some network filesystems) filelock falls back to a lock file that records its holder, and takes over
    one whose holder has died. The holder's pid is the file's first line, for the message. The file is removed on
    leaving, while still held, so that no other process can lock a file about to disappear.
    """
    lock.parent.mkdir(parents=True, exist_ok=True)
    held = FileLock(str(lock), blocking=False)
    while True:
        try:
            held.acquire()
            break
        except Timeout:
            if lock.exists():
                raise busy(_holder(lock)) from None
            # the last holder removed the file as this process locked it: lock the one at the path now
    # flock leaves the file to us: the pid goes in. A soft lock's file is filelock's own record (its pid first).
    native = "\n" not in lock.read_text(errors="replace")
    if native:
        lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        if native:
            lock.unlink(missing_ok=True)  # while held; a soft lock removes its own file on release
        held.release()


def _holder(lock: Path) -> str:
    """The pid written first into a lock file, or `unknown` (unreadable, or a holder that is still writing it)."""
    try:
        first = lock.read_text(errors="replace").split("\n", 1)[0].strip()
    except OSError:
        return "unknown"
    return first or "unknown"
