"""Plugin files, for the reward registry (`rewards/`) and the task registry (`data/`) alike: which files a folder
offers, importing one (built-in files as the package's modules, others under a name of their own), and what plugin
code may do to end a run that must become an error naming it instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# What plugin code may raise that is no `Exception` but would end the run, silently where it is `SystemExit(0)`.
ENDS_THE_RUN = (SystemExit, KeyboardInterrupt)


def ended(error: BaseException) -> str:
    """How plugin code tried to end the process, for the error that replaces it."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r}) (SystemExit); plugin code must raise an exception or return values"
    return "raised KeyboardInterrupt (a second Ctrl-C during a plugin call also shows here)"


def plugin_files(folders: Sequence[Path], error: type[Exception], kind: str) -> list[Path]:
    """The plugin files of `folders`, in order (files starting with `_` are not plugins); a missing folder fails."""
    importlib.invalidate_caches()  # a plugin file dropped in after start-up must still be found (Python's docs)
    files = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise error(f"{kind} folder {folder} does not exist")
        found = [path.resolve() for path in sorted(folder.glob("*.py")) if not path.name.startswith("_")]
        for writable in [folder, *found]:
            if writable.stat().st_mode & stat.S_IWOTH:
                raise error(
                    f"{kind} {'folder' if writable == folder else 'file'} {writable} is writable by every user: "
                    f"anyone on this machine could put code into your run; `chmod o-w {writable}`"
                )
        files += found
    return files


def import_plugin(path: Path, builtin: tuple[Path, str], error: type[Exception], kind: str) -> ModuleType:
    """Import plugin file `path`: a file of the built-in folder `builtin[0]` as a module of package `builtin[1]`, any
    other under a module name made from its folder. Any failure, or an attempt to exit, is an `error` naming it."""
    folder, package = builtin
    try:
        if path.parent == folder:
            return importlib.import_module(f"{package}.{path.stem}")
        digest = hashlib.sha1(str(path.parent).encode()).hexdigest()[:8]
        module_name = f"{package.replace('.', '_')}_plugins_{digest}.{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        return module
    except error:
        raise
    except ENDS_THE_RUN as failure:  # e.g. argparse at import time: it would end training with exit status 0
        raise error(f"{kind} {path} {ended(failure)} while being imported") from failure
    except Exception as failure:  # plugin code may fail in any way; say which file
        raise error(f"{kind} {path} failed to import: {type(failure).__name__}: {failure}") from failure
