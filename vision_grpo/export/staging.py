"""An export's staging folder, `.<output>.<hex>` beside `--output`, announced by a marker file beside it
(`.<output>.<hex>.staging.json`, naming the output and the folder) written before the folder is made and removed
after the folder was renamed into place or deleted. A folder that a killed export left behind is therefore provably
ours, and the next export to the same output removes it: without the marker a user's folder of a similar name could
not be told from it, and every crash left a full copy of the weights beside `--output` for ever.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from vision_grpo.storage.writes import naming_a_full_disk

logger = logging.getLogger("vision_grpo.export")
MARKER_SUFFIX = ".staging.json"


def marker_of(staging: Path) -> Path:
    return staging.with_name(staging.name + MARKER_SUFFIX)


def marker_content(output: Path, staging: Path) -> dict[str, str]:
    return {"export_output": output.name, "staging": staging.name}


@contextlib.contextmanager
def parent_folders(output: Path) -> Iterator[None]:
    """`output`'s missing parent folders, made for the export (a fresh clone has no `exported/`) and removed again,
    where still empty, when the export fails: a refused export leaves nothing behind."""
    missing = list(itertools.takewhile(lambda folder: not folder.exists(), output.parents))  # the deepest first
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in missing:
            with contextlib.suppress(OSError):  # not empty: another export's, or the user's, now
                folder.rmdir()
        raise


def make_staging(output: Path) -> Path:
    """A new, empty staging folder for `output`, its marker written first (the umask's modes, not mkdtemp's)."""
    staging = output.with_name(f".{output.name}.{secrets.token_hex(4)}")
    text = json.dumps(marker_content(output, staging))
    with naming_a_full_disk(marker_of(staging), len(text)):
        marker_of(staging).write_text(text, encoding="utf-8")
    staging.mkdir()
    return staging


def remove_staging(staging: Path) -> None:
    """Remove a staging folder (if still there) and then its marker."""
    shutil.rmtree(staging, ignore_errors=True)
    marker_of(staging).unlink(missing_ok=True)


def remove_stale_staging(output: Path) -> None:
    """Remove what killed exports to `output` left beside it: each staging folder whose marker names `output` and
    it. Called under the output's lock, so no export to it is running; a folder without our marker is never touched."""
    prefix = f".{output.name}."
    for marker in output.parent.iterdir():
        if not (marker.name.startswith(prefix) and marker.name.endswith(MARKER_SUFFIX)) or not marker.is_file():
            continue
        staging = marker.with_name(marker.name.removesuffix(MARKER_SUFFIX))
        try:
            ours = json.loads(marker.read_text(encoding="utf-8")) == marker_content(output, staging)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            ours = False
        if not ours or staging.is_symlink():
            continue
        if staging.exists():
            logger.warning("removing %s: the staging folder of an export to %s that was stopped", staging, output)
        remove_staging(staging)
