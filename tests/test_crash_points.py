"""Crash-point testing (issue 37, item 1): each path is run once uninterrupted with `VISION_GRPO_CRASH_LOG` to
count its durable writes (`vision_grpo/storage/crash_points.py`), then killed (SIGKILL, from inside, at that point)
at every one of them in turn - or at a seeded sample where a path has many, the seed printed - and rerun as
docs/reliability.md says. The rerun must end with the uninterrupted run's outputs: the same rows, the same
evaluation records once each, the same exported bytes, bit-identical weights.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import run_script
from test_data_cache import recipe, write_source

CRASH_AT, CRASH_LOG = "VISION_GRPO_CRASH_AT", "VISION_GRPO_CRASH_LOG"


def crash_points(argv: list[str], log: Path, env: dict[str, str] | None = None) -> list[str]:
    """The names of the durable writes an uninterrupted run of `argv` passes, in order."""
    run_script(argv, env={**(env or {}), CRASH_LOG: str(log)}, timeout=600)
    return [line.split(" ", 2)[2] for line in log.read_text(encoding="utf-8").splitlines()]


def crashed_at(argv: list[str], k: int, env: dict[str, str] | None = None) -> None:
    """Run `argv`, killed at its k-th durable write."""
    killed = run_script(argv, env={**(env or {}), CRASH_AT: str(k)}, timeout=600, check=False)
    assert killed.returncode == -signal.SIGKILL, f"not killed at point {k}:\n{killed.stderr[-3000:]}"


# ---------------------------------------------------------------------------------------------------------------------
# The checking pass: the rows cache, its seal and the source-digest memo.

LOAD_ROWS = """
import json, sys
import datasets
from trl import GRPOConfig, ModelConfig
from vision_grpo.data import get_dataset
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
datasets.config.HF_DATASETS_CACHE = sys.argv[1]
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[3:])[0]
rows = get_dataset(args, "train", 168 * 168)
with open(sys.argv[2], "w") as out:
    json.dump([list(rows["id"]), list(rows["answer"])], out)
"""


@pytest.mark.slow
def test_the_checking_pass_killed_at_every_write_gives_the_same_rows_on_rerun(tmp_path: Path) -> None:
    folder = write_source(tmp_path / "data", [str(i % 9) for i in range(40)])
    script = tmp_path / "load.py"
    script.write_text(LOAD_ROWS)

    def argv(cache: Path, out: Path) -> list[str]:
        return [str(script), str(cache), str(out), *recipe(folder)]

    whole = tmp_path / "whole.json"
    names = crash_points(argv(tmp_path / "cache-whole", whole), tmp_path / "points.log")
    assert any("not yet sealed" in name for name in names) and any(".seal.json" in name for name in names), names
    for k in range(1, len(names) + 1):
        cache, out = tmp_path / f"cache-{k}", tmp_path / f"rows-{k}.json"
        crashed_at(argv(cache, out), k)
        run_script(argv(cache, out))  # the same command again
        assert json.loads(out.read_text()) == json.loads(whole.read_text()), f"other rows after a crash at {k}"
        again = run_script(argv(cache, tmp_path / "again.json"), env={CRASH_LOG: str(tmp_path / f"after-{k}.log")})
        assert again.returncode == 0 and not (tmp_path / f"after-{k}.log").exists(), "the rerun left no sealed cache"
    print(f"checking pass: {len(names)} crash points, all tried: {names}")
