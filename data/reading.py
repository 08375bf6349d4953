"""Reading the rows of the checking pass (data/prepared.py): images decoded when a row is read, this process's
mapped pages of the Arrow files released as reads go on, and rows that do not decode when read replaced and recorded.

`decode_on_access` sets a `datasets` transform that opens and normalises a row's images when it is read, in the data
loader's workers. Where a task lets rows that only a decode can refuse reach training unchecked
(`replace_unreadable`), a row that does not decode when read is named, recorded beside the rows cache
(`<key>.unreadable.jsonl`) and replaced by the next row that does; the next pass of the key leaves the recorded rows
out, named and counted like any bad row.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from vision_grpo.storage.writes import append_bytes

logger = logging.getLogger(__name__)

ROWS_CACHE = "vision_grpo_rows"  # the folder of the pass's rows caches, under the datasets cache

# Rows the pass reads between two releases of the source's mapped pages (`release_mapped_pages`): at a few hundred
# KB a row (a 1-MP photograph as JPEG) that bounds what the pass holds of the source to tens of MB, at one read of
# /proc/self/maps per hundred rows.
RELEASE_EVERY = 100
# <sys/mman.h>, Linux 5.4 and later (older kernels refuse it: nothing is released). Not MADV_DONTNEED, which would
# zero the range if another thread unmapped the file between our read of /proc/self/maps and the call and the
# address were reused for anonymous memory; MADV_PAGEOUT never loses data, whatever the range holds by then.
MADV_PAGEOUT = 21
# Beside a rows cache `<key>.arrow`: the rows found unreadable when read, one JSON line each ({"id", "reason"}).
UNREADABLE = ".unreadable.jsonl"
# A record outlives a repair of an image file in `vqa_image_folder` (those are not in the cache key): how to clear it.
REPAIRED = "recorded in {record}: once its image is repaired, delete that file (or this id's line) to use the row again"


class UnreadableRow(ValueError):
    """A row that passed the pass's checks and fails when read (an image whose bitstream does not decode): the
    task's error, carrying the row's id and the reason without the id, so the reader can skip and record it."""

    def __init__(self, message: str, row_id: str, reason: str) -> None:
        super().__init__(message)
        self.row_id, self.reason = row_id, reason


class ReleasingPages:
    """`check`, releasing this process's mapped pages of the source's Arrow files every `RELEASE_EVERY` rows.

    `datasets` reads a source through a memory map; every page the pass touches (the source's whole size, its images
    being most of it) stays mapped, and so counted in the process's RSS, until the process ends or the kernel needs
    the memory: without the release a first start's RSS grows with the source."""

    def __init__(self, check: Callable[..., dict[str, Any]], source: datasets.Dataset) -> None:
        self.check, self.names = check, _mapped_files(source)

    def __call__(self, row: dict[str, Any], index: int, **deciding: Any) -> dict[str, Any]:
        if index % RELEASE_EVERY == RELEASE_EVERY - 1:
            _release(self.names)
        return self.check(row, index, **deciding)


def release_mapped_pages(dataset: Any) -> None:
    """Release this process's resident pages of `dataset`'s Arrow files (madvise `MADV_PAGEOUT` on each range
    /proc/self/maps names them at): the process's RSS drops them, and a later read of them reads the file again.
    Pages that another process also has mapped stay. Does nothing where there is no /proc (not Linux), nor for a
    dataset with no Arrow file (held in memory, or any object that reads rows by indices)."""
    _release(_mapped_files(dataset))


def _mapped_files(dataset: Any) -> set[str]:
    return {os.path.realpath(entry["filename"]) for entry in getattr(dataset, "cache_files", None) or []}


def _release(names: set[str]) -> None:
    """`release_mapped_pages` of the Arrow files `names` (real paths); one read of /proc/self/maps, about 2 ms."""
    if not names or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") in names:
                start, end = (int(address, 16) for address in fields[0].split("-"))
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)


def decode_on_access(
    rows: datasets.Dataset, decode: Callable[[dict[str, list]], dict[str, list]], replace_unreadable: bool = False
) -> datasets.Dataset:
    """`rows` whose reads (indexing, iteration, the data loader's batches) go through `decode`, which turns the
    encoded images of a batch into normalised ones; a picklable `decode` (a `functools.partial` of a module
    function) lets `dataloader_num_workers` processes decode in parallel. Each process that reads releases its
    mapped pages of the rows' Arrow files every `RELEASE_EVERY` rows it reads (`_ReleasingReads`).

    With `replace_unreadable` (training rows under `skip_bad_rows` whose bitstreams the pass did not decode), a row
    whose `decode` raises `UnreadableRow` is skipped as the pass would have: named in a warning, recorded beside
    the rows cache for the run's end record and the next pass, and replaced by the next readable row
    (`_ReplacingUnreadable`), so a batch keeps its size and a GRPO group its G copies of one prompt."""
    if replace_unreadable:
        decode = _ReplacingUnreadable(decode, rows, _rows_cache(rows))
    return rows.with_transform(_ReleasingReads(decode, _mapped_files(rows)))


def _rows_cache(rows: datasets.Dataset) -> Path:
    """The rows cache file (`checked_rows`'s) that `rows` were read from."""
    for entry in rows.cache_files:
        if Path(entry["filename"]).parent.name == ROWS_CACHE:
            return Path(entry["filename"])
    raise ValueError("these rows were not read from a rows cache (checked_rows)")


def unreadable_rows(cache: Path) -> dict[str, str]:
    """The rows recorded unreadable beside the rows cache `cache`, {id: reason}. A line cut by a crash is passed
    over: that row is found again when read."""
    path = cache.with_suffix(UNREADABLE)
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            entry = json.loads(line)
            found[str(entry["id"])] = str(entry["reason"])
    return found


def found_when_read(rows: Any) -> dict[str, str]:
    """The rows of `rows` (a task's `load` result) recorded unreadable since they were loaded, {id: reason}: the
    run's end record counts them. Empty for rows that replace none."""
    try:
        recorded = unreadable_rows(_rows_cache(rows))
    except (AttributeError, ValueError):
        return {}
    if not recorded:
        return {}
    held = set(_ids(rows))
    return {row_id: reason for row_id, reason in recorded.items() if row_id in held}


def _ids(rows: datasets.Dataset) -> list[str]:
    """The rows' ids, read as one Arrow column (not the images beside them, nor through the transform)."""
    return [str(each) for each in rows.select_columns(["id"]).with_format("arrow")[:]["id"].to_pylist()]


class _ReplacingUnreadable:
    """`decode`, where a row that raises `UnreadableRow` is replaced by the next row of `rows` (in order, wrapping
    round) that decodes. The replacement depends on the row alone, so every rank and every epoch read the same row
    in its place. Each unreadable row is warned about once per process and recorded beside the rows cache `cache`."""

    def __init__(self, decode: Callable[[dict[str, list]], dict[str, list]], rows: datasets.Dataset, cache: Path):
        self.decode, self.rows, self.cache = decode, rows, cache
        self.positions: dict[str, int] | None = None  # row id -> index, built at the first unreadable row
        self.reported: set[str] = set()

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        try:
            return self.decode(dict(batch))
        except UnreadableRow:
            pass
        size = len(next(iter(batch.values())))
        read = [self._readable({name: [values[k]] for name, values in batch.items()}) for k in range(size)]
        return {name: [row[name][0] for row in read] for name in read[0]}

    def _readable(self, row: dict[str, list]) -> dict[str, list]:
        for _ in range(len(self.rows)):
            try:
                return self.decode(dict(row))
            except UnreadableRow as error:
                self._report(error)
                row = self._after(error.row_id, list(row))
        raise UnreadableRow(f"no row of the rows cache {self.cache} can be read", "", "no row decodes")

    def _after(self, row_id: str, names: list[str]) -> dict[str, list]:
        if self.positions is None:
            self.positions = {each: index for index, each in enumerate(_ids(self.rows))}
        following = self.rows[(self.positions[row_id] + 1) % len(self.rows)]
        return {name: [following[name]] for name in names}

    def _report(self, error: UnreadableRow) -> None:
        if error.row_id in self.reported:
            return
        self.reported.add(error.row_id)
        logger.warning(
            "skipping row id=%r (skip_bad_rows), found when read: %s; the next readable row is read in its place, "
            "the run's end record counts it (rows_skipped_when_read) and the next start's pass leaves it out; %s",
            error.row_id,
            error.reason,
            REPAIRED.format(record=self.cache.with_suffix(UNREADABLE)),
        )
        line = json.dumps({"id": error.row_id, "reason": error.reason}, ensure_ascii=False) + "\n"
        append_bytes(self.cache.with_suffix(UNREADABLE), line.encode("utf-8"))


class _ReleasingReads:
    """`decode`, releasing this process's mapped pages of the rows' Arrow files (`names`) once `RELEASE_EVERY` rows
    have been read since the last release. A training run reads every row once an epoch; without the release each
    page read stays in the reading process's RSS until it ends (measured: `benchmarks/data_scale.py --train-rows`),
    as the checking pass's did before `ReleasingPages`."""

    def __init__(self, decode: Callable[[dict[str, list]], dict[str, list]], names: set[str]) -> None:
        self.decode, self.names, self.unreleased = decode, names, 0

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        self.unreleased += len(next(iter(batch.values()), []))
        decoded = self.decode(batch)
        if self.unreleased >= RELEASE_EVERY:
            _release(self.names)
            self.unreleased = 0
        return decoded
