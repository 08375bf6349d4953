"""The checking pass every task's rows go through, cached on disk and shared by the processes of a node.

A task maps a function over its source that checks each row (the image decodes and fits the limits, the text holds
no special token, the answer reads as its type, ...) and returns the row's small columns (id, prompt, answer, ...)
plus `ERROR` (None, or what is wrong). Nothing decoded is kept: the pass writes a small Arrow file, keyed by the
source's `datasets` fingerprint, the recipe keys that decide the rows and the code that builds them, under
`<datasets cache>/vision_grpo_rows/`, and seals it (`<key>.arrow.seal.json`: size, sha256, key, rows). A second
start with the same keys checks the seal (a few ms for 20k rows) and reads that file instead of checking again; a
file cut short, bit-flipped, another key's or unsealed is named in a warning and rebuilt. Under `accelerate launch`
the first process of each node does the pass while the others wait, then read it.

The images stay in the source (encoded bytes in its Arrow cache, or files in an image folder), decoded when a row is
read (data/reading.py's `decode_on_access`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from datasets.fingerprint import Hasher
from filelock import FileLock, Timeout

from vision_grpo.data.reading import (
    REPAIRED,
    ROWS_CACHE,
    UNREADABLE,
    ReleasingPages,
    release_mapped_pages,
    unreadable_rows,
)
from vision_grpo.storage.crash_points import crash_point
from vision_grpo.storage.seals import seal, seal_fault, seal_path
from vision_grpo.storage.writes import (
    DiskFull,
    file_sha256,
    full_disk_message,
    held_open_elsewhere,
    is_full_disk,
    write_text_atomic,
)

logger = logging.getLogger(__name__)

ERROR = "_error"  # the pass's column: None for a usable row, else why it is not (without its id)
# The pass's optional column of each row's image sizes as training will see them ([[width, height], ...]): kept
# beside the rows (`image_sizes`), not in them, so that what a consumer reads does not change.
SIZES = "_image_sizes"
SIZES_FEATURE = datasets.List(datasets.List(datasets.Value("int32")))
# Bytes (uncompressed) of a parquet row group above which converting it costs enough memory to say so.
LARGE_ROW_GROUP = 50_000_000
# `datasets`' parquet builder scans a file opened in Python with pyarrow's default pre-buffering, which reads every
# row group of the file into memory ahead of the conversion: without it the first start's memory does not grow with
# the file's rows, only with its largest row group.
PARQUET_READ = {"fragment_scan_options": pads.ParquetFragmentScanOptions(pre_buffer=False)}


def code_digest(*modules: Any) -> str:
    """A digest of the source files of `modules`: a change to the code that builds rows invalidates the cache."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def files_digest(paths: list[Path]) -> str:
    """A content digest of data files (sha256 of their bytes, remembered per path, size and mtime so that a second
    start only stats them): an edit under the same path changes it, a copy of the same bytes does not."""
    digest = hashlib.sha256()
    memo_dir = Path(datasets.config.HF_DATASETS_CACHE) / ROWS_CACHE / "file_digests"
    for path in sorted(paths):
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32]
        memo = memo_dir / key
        if memo.is_file():
            content = memo.read_text()
        else:
            content = file_sha256(path)
            memo_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(memo, content)
        digest.update(f"{path.name}:{content}\n".encode())
    return digest.hexdigest()[:16]


def source_files(path: Path) -> list[Path]:
    """The data files a local source path stands for (a file, or every data file under a folder); none for a Hub id."""
    if path.is_file():
        return [path]
    if path.is_dir():
        suffixes = {".parquet", ".arrow", ".jsonl", ".json", ".csv"}
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
    return []


def read_parquet(files: list[Path]) -> datasets.Dataset:
    """Local parquet files as one `datasets.Dataset`, converted to `datasets`' Arrow cache at the first read one row
    group at a time (`PARQUET_READ`), with a warning, at that conversion only, for a file whose row groups are large.
    """
    names = [str(file) for file in files]
    large = [warning for warning in map(_large_row_group, files) if warning]
    if large and not _converted(names):
        for warning in large:
            logger.warning(warning)
    return datasets.load_dataset("parquet", data_files=names, split="train", **PARQUET_READ)


def _large_row_group(path: Path) -> str | None:
    """What to say of a parquet file whose largest row group is over `LARGE_ROW_GROUP` bytes (None if it is not):
    `datasets` converts a row group whole, so the memory of that conversion grows with the row group, whatever its
    batch size. Reads the file's footer only, never its data."""
    metadata = pq.read_metadata(path)
    groups = [metadata.row_group(index) for index in range(metadata.num_row_groups)]
    largest = max(groups, key=lambda group: group.total_byte_size, default=None)
    if largest is None or largest.total_byte_size <= LARGE_ROW_GROUP:
        return None
    return (
        f"{path}: its largest row group holds {largest.num_rows} rows in {largest.total_byte_size / 1e6:.0f} MB "
        f"({metadata.num_row_groups} row group(s), {metadata.num_rows} rows); `datasets` reads a row group whole when "
        "it converts the file to its Arrow cache (once per file), so that start needs several times this in memory. "
        "Write the file in smaller row groups, e.g. pyarrow.parquet.write_table(table, path, row_group_size=100)"
    )


def _converted(names: list[str]) -> bool:
    """Whether `read_parquet` of these files would find `datasets`' Arrow cache of them already made (the builder's
    cache folder, which names the files' paths and modification times, holds its dataset info)."""
    builder = datasets.load_dataset_builder("parquet", data_files=names, **PARQUET_READ)
    return (Path(builder.cache_dir) / datasets.config.DATASET_INFO_FILENAME).is_file()


@contextlib.contextmanager
def _one_process_per_node() -> Iterator[str]:
    """Under a launcher (WORLD_SIZE > 1) the local main process runs the body first, the others after it (they find
    its cache); yields which process this is, for the log."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield f"process {os.getpid()}"
        return
    from accelerate import PartialState

    state = PartialState()
    with state.local_main_process_first():
        yield f"process {state.process_index} (local {state.local_process_index}, pid {os.getpid()})"


def checked_rows(
    source: datasets.Dataset,
    check: Callable[..., dict[str, Any]],
    deciding: dict[str, Any],
    features: datasets.Features,
    what: str,
    keep: dict[str, str] | None = None,
    source_key: str | None = None,
) -> tuple[datasets.Dataset, list[tuple[str, str]]]:
    """The pass: `check(row, index, **deciding)` over `source`, cached; returns the usable rows (the pass's columns
    and `source`'s columns `keep`, `{source name: row name}`, in source order) and the (id, reason) of every row that
    is not usable. `source_key` identifies a source that has no `datasets` fingerprint of its own (a generator's
    settings).

    `deciding` holds everything besides the source that decides the rows (column mapping, template, pixel limit, the
    code's digest): changing any of it, or the source, makes another cache file; other recipe keys reuse it.
    """
    if not len(source):
        return datasets.Dataset.from_dict({"id": []}), []  # `get_dataset` says the split is empty
    key = Hasher.hash([source_key or source._fingerprint, deciding])
    cache = Path(datasets.config.HF_DATASETS_CACHE) / ROWS_CACHE / f"{key}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with _one_process_per_node() as who, _key_lock(cache):
        cached = _trusted(cache, key, len(source))
        started = time.perf_counter()
        with _full_disk_estimated(cache, source, check, deciding, features):
            checked = source.map(
                ReleasingPages(check, source),
                with_indices=True,
                fn_kwargs=deciding,
                remove_columns=source.column_names,
                features=features,
                cache_file_name=str(cache),
                load_from_cache_file=True,
                new_fingerprint=key,
                desc=f"checking {what} rows",
            )
            if not cached:
                crash_point(f"{cache.name} written by datasets, not yet sealed")
                seal(cache, key=key, rows=len(source))
        seconds = time.perf_counter() - started
    if cached:
        logger.info("%s: %d checked rows read from the cache %s (%s)", what, len(checked), cache, who)
    else:
        release_mapped_pages(source)  # the rows since the pass's last release
        rate = len(source) / seconds if seconds > 0 else float("inf")
        logger.info("%s: %s checked %d rows (%.0f rows/s), cached in %s", what, who, len(source), rate, cache)
    # Whole Arrow columns, not `checked[ERROR]`: that is a `datasets.Column`, which formats one row at a time.
    table = checked.with_format("arrow")[:]
    errors = table[ERROR]
    bad_at = pc.indices_nonzero(pc.is_valid(errors))
    ids, reasons = (pc.take(table[name], bad_at).to_pylist() for name in ("id", ERROR))
    bad = [(str(row_id), reason) for row_id, reason in zip(ids, reasons, strict=True)]
    usable_mask = pc.is_null(errors)
    earlier = unreadable_rows(cache)
    if earlier:  # found when read by an earlier launch: left out from now on, named and counted as bad
        repaired = REPAIRED.format(record=cache.with_suffix(UNREADABLE))
        found = pc.and_(usable_mask, pc.is_in(table["id"], value_set=pa.array(list(earlier), pa.string())))
        for row_id in pc.filter(table["id"], found).to_pylist():
            bad.append((str(row_id), f"{earlier[row_id]} (found when an earlier launch read the row; {repaired})"))
        usable_mask = pc.and_(usable_mask, pc.invert(found))
    usable = pc.indices_nonzero(usable_mask)
    if SIZES in table.column_names:
        checked = checked.remove_columns(SIZES)  # still in the cache file, for `image_sizes`
    if keep:
        checked = _beside(checked, source, keep)
    if bad:
        checked = checked.select(usable)
    return checked.remove_columns(ERROR), bad


@contextlib.contextmanager
def _key_lock(cache: Path) -> Iterator[None]:
    """Hold the rows cache's lock (one per key) while its file is checked, built and sealed. Two launches preparing
    one key at once (the demo's two experiments) build it once, the second reads the first's; and no process finds
    the file between a rebuild's removal of a damaged one and its seal (without the lock, one could remove the
    other's file, written but not yet sealed, as damaged, and the other's seal would find no file). `datasets`
    writes the file under a temporary name and renames it, so its path never holds half a file. A process that has
    to wait says so, naming the file: the holder may be a launch that was stopped, which holds it until it ends."""
    lock = FileLock(str(cache) + ".lock")
    try:
        lock.acquire(blocking=False)
    except Timeout:
        logger.warning("the rows cache %s is being prepared by another process: waiting for it to finish", cache)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def image_sizes(rows: Any) -> list[list[tuple[int, int]]] | None:
    """The (width, height) of each row's images as training will see them, as the checking pass recorded them in the
    rows cache file `rows` are read from (a column the rows themselves do not show), matched by id; None where no
    pass recorded them or the ids are not unique. Lets a check that depends only on the sizes group the rows without
    decoding any image."""
    for entry in getattr(rows, "cache_files", None) or []:
        cached = datasets.Dataset.from_file(entry["filename"]).with_format("arrow")
        if SIZES not in cached.column_names:
            continue
        ids = cached["id"].to_pylist()
        by_id = dict(zip(ids, cached[SIZES].to_pylist(), strict=True))
        wanted = rows.with_format("arrow")["id"].to_pylist()
        if len(by_id) != len(ids) or not set(wanted) <= by_id.keys():
            return None
        return [[(width, height) for width, height in by_id[row_id]] for row_id in wanted]
    return None


def _trusted(cache: Path, key: str, rows: int) -> bool:
    """Whether the rows cache `cache` is there and as its seal says it was written (size, sha256, key, row count):
    one read of the file, about 1 s per GB. A damaged one (cut short, bit-flipped, another key's, or without its
    seal) is removed with a warning naming it and the fault, so the pass writes it again: never fewer rows, nor
    other rows, in silence. `datasets` alone reuses a cache file found under its name unread: a flipped bit reads as
    another row, a file cut short fails in Arrow naming no file (tests/test_damaged_caches.py shows both)."""
    if not cache.exists() and not seal_path(cache).exists():
        return False
    fault = seal_fault(cache, key=key, rows=rows)
    if fault is None:
        return True
    logger.warning("the rows cache %s cannot be used (%s): checking the rows again to rebuild it", cache, fault)
    cache.unlink(missing_ok=True)
    seal_path(cache).unlink(missing_ok=True)
    return False


# Rows the pass checks in memory to estimate the size of a rows cache that found the disk full.
SIZE_SAMPLE = 64


@contextlib.contextmanager
def _full_disk_estimated(
    cache: Path,
    source: datasets.Dataset,
    check: Callable[..., dict[str, Any]],
    deciding: dict[str, Any],
    features: datasets.Features,
) -> Iterator[None]:
    """A full disk while the pass writes `cache` becomes `DiskFull` naming it and the cache's size, estimated from
    the first `SIZE_SAMPLE` rows checked in memory. `datasets` leaves its half-written temporary file (`tmp…`) on
    the full disk, closed by then: the ones that appeared during the pass are removed, but not one another process
    holds open (another key's pass, writing into the same folder)."""
    before = set(cache.parent.glob("tmp*"))
    try:
        yield
    except Exception as error:
        if not is_full_disk(error, cache, None):
            raise
        appeared = set(cache.parent.glob("tmp*")) - before
        for leftover in appeared - held_open_elsewhere(appeared):
            leftover.unlink(missing_ok=True)
        if isinstance(error, DiskFull):  # the seal's own write, already named
            raise
        sample = source.select(range(min(SIZE_SAMPLE, len(source))))
        sampled = sample.map(
            check, with_indices=True, fn_kwargs=deciding, remove_columns=source.column_names, features=features,
            keep_in_memory=True, desc="estimating the rows cache's size",
        )  # fmt: skip
        needed = sampled.data.nbytes * len(source) // len(sample)
        raise DiskFull(errno.ENOSPC, full_disk_message(cache, needed)) from error


def repeated_values(rows: datasets.Dataset, column: str) -> list[Any]:
    """The values of `column` that occur more than once, in order of first occurrence; counted by Arrow over the
    whole column, so that a start does not read the rows one by one."""
    counts = pc.value_counts(rows.with_format("arrow")[column])
    return counts.filter(pc.greater(counts.field("counts"), 1)).field("values").to_pylist()


def _beside(rows: datasets.Dataset, source: datasets.Dataset, columns: dict[str, str]) -> datasets.Dataset:
    """`rows` beside `source`'s columns `{source name: row name}`, without copying them: the images stay where the
    source keeps them, encoded (`datasets.Image(decode=False)`)."""
    kept = source.select_columns(list(columns))
    for name, feature in kept.features.items():
        plain = undecoded(feature)
        if plain is not feature:
            kept = kept.cast_column(name, plain)
    kept = kept.rename_columns({name: new for name, new in columns.items() if name != new})
    return datasets.concatenate_datasets([rows, kept], axis=1)


def undecoded(feature: Any) -> Any:
    """The same column feature with its images left encoded (bytes and path, no PIL); `feature` itself when it is
    already, because `datasets` casts a list-of-images column by writing a copy of every image."""
    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False) if feature.decode else feature
    if isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Image):
        return datasets.List(datasets.Image(decode=False)) if feature.feature.decode else feature
    if isinstance(feature, list) and feature and isinstance(feature[0], datasets.Image):
        return [datasets.Image(decode=False)] if feature[0].decode else feature
    return feature
