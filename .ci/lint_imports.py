"""The package's layers checked: import-linter's `lint-imports` with the contracts in pyproject.toml.

import-linter (its graph builder, grimp) reads a package from the folder the package is found in, but two
sub-packages live elsewhere: `vision_grpo.data` is the data/ folder and `vision_grpo.rewards` the rewards/ folder
(pyproject.toml's package-dir), which it would report as missing. So the package's source is laid out as installed,
`vision_grpo/` with `data/` and `rewards/` inside, in a temporary folder, and `lint-imports` runs there: a wrong-way
import fails naming both modules and the line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where each part of the installed package comes from (pyproject.toml's [tool.setuptools.package-dir]).
LAYOUT = {
    "vision_grpo": REPO / "vision_grpo",
    "vision_grpo/data": REPO / "data",
    "vision_grpo/rewards": REPO / "rewards",
}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="lint-imports-") as tmp:
        for target, source in LAYOUT.items():
            for path in source.rglob("*.py"):
                if "__pycache__" not in path.parts:
                    copy = Path(tmp) / target / path.relative_to(source)
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, copy)
        command = [str(Path(sys.executable).with_name("lint-imports")), str(REPO / "pyproject.toml")]
        return subprocess.run([*command, "--no-cache"], cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
