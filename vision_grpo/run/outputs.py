"""One check for every command that writes a file: its output is never one of the files it reads.

`--overwrite` (or a fixed output name) would otherwise replace the recipe, a result being compared or the adapter
being evaluated with the command's own output, and the command would still end with exit status 0. Paths are
compared as the filesystem sees them (`os.path.samefile`: symbolic and hard links to an input are the input too), and
an input folder counts with everything already in it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path


class OutputIsInput(ValueError):
    """An output path that names a file or folder the same command reads."""


def _is_within(path: Path, folder: Path) -> bool:
    """`path` exists and is `folder` or lies inside it (both resolved, so links count)."""
    return path.exists() and path.resolve().is_relative_to(folder.resolve())


def check_outputs_are_not_inputs(flag: str, outputs: Iterable[Path], inputs: Mapping[str, str | Path | None]) -> None:
    """Refuse, before any work, an output (`flag`'s path, or a file the command writes beside it) that is one of
    `inputs` (label, such as "the recipe (--config)", to path; unset and missing inputs are skipped) or an existing
    file inside an input folder."""
    for output in outputs:
        for label, source in inputs.items():
            if source is None or not Path(source).exists():
                continue
            source = Path(source)
            same = output.exists() and os.path.samefile(output, source)
            if same or (source.is_dir() and _is_within(output, source)):
                where = "is" if same else "is inside"
                raise OutputIsInput(
                    f"{flag} {output} {where} {label} {source}, which this command reads: writing there would "
                    f"replace it; choose another {flag}"
                )
