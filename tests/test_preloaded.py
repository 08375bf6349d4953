"""The test runner's fork server really preloads the libraries: a command forked from it starts with them imported
(Python 3.11's forkserver skips a preload it cannot import without a word, and the suite then ran at the speed of
fresh interpreters)."""

from __future__ import annotations

import os
from pathlib import Path

import preloaded


def test_a_forked_command_starts_with_the_libraries_imported_and_none_of_our_code(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(
        "import sys\n"
        "print(sorted(name for name in sys.argv[1:] if name not in sys.modules))\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in {'vision_grpo', 'conftest'}))\n"
    )
    process = preloaded.run([str(script), *preloaded.PRELOAD], cwd=tmp_path, env=dict(os.environ), timeout=120)
    assert process.returncode == 0, process.stderr
    missing, ours = process.stdout.splitlines()
    assert missing == "[]", f"not preloaded: {missing}"
    assert ours == "[]", f"our own code was preloaded: {ours}"
