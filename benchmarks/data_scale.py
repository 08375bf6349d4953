"""How the data path scales with the number of rows: a synthetic VQA set of our own making (JPEG, PNG or WebP, one
image or a list of images per row) prepared by `get_dataset` in a fresh process per start, and optionally a short
`recipes/train.py` run on it.

    python benchmarks/data_scale.py [--rows 1000 20000] [--width 640 --height 480] [--format JPEG] [--images 1]
        [--skip-bad-rows] [--row-group-rows 100] [--loader-epochs 2] [--train-steps 2 [--token-check-samples 32]]
        [--train-epochs 2] [--scratch DIR [--reuse-cache]] [--json FILE] [--quick]

The source is one `train.parquet` written by `datasets`' `to_parquet` in row groups of `--row-group-rows` rows (100:
as earlier `datasets` releases wrote image datasets for the Hub, `config.PARQUET_ROW_GROUP_SIZE_FOR_IMAGE_DATASETS`,
and as the warning for large row groups advises; 0: the installed `datasets`' own default, row groups of up to
100 MB, which `datasets` converts to its Arrow cache a whole row group at a time, so that first start's memory grows
with the row group).

Printed per size: seconds of the first start (the checking pass, including `datasets`' own conversion of the parquet
file to its Arrow cache) and of the second (the cache read), rows/s of the pass, the process's peak RSS split into
its anonymous part (memory the process owns) and its file-backed part (pages of memory-mapped files it read, which
the kernel reclaims), the disk of the checked-rows cache and of the source's Arrow cache, and, with `--train-steps`,
the training process's peak RSS and seconds from its start to its first step, first and second start.
`--train-epochs` trains the tiny recipe until every row was read that many times (32 prompts a step) and prints the
training process's resident memory (VmRSS) growth from after its first 50 steps to its last.
`--loader-epochs` reads the rows that many epochs as the training loader does (shuffled batches, no model), with and
without the loader's page release, and prints its RSS growth from after its first 50 batches to the end. `--scratch`
keeps the generated sources there (reused by a later call with the same settings); by default they live in a
temporary folder that is removed. With `--reuse-cache` it keeps each size's datasets cache too, and a later call
that finds it measures second starts only (a 20,000-row first start takes minutes). `--skip-bad-rows` runs every
start with `skip_bad_rows: true` (the pass then decodes JPEG bitstreams at an eighth of their size, and leaves a
training row's WebP to the reader).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
from common import REPO, check, machine, markdown_table, read_step_log, report, run_measured
from PIL import Image, ImageDraw

MAX_PIXELS = 1003520
# `--train-epochs`: completions per step and per prompt (TRL's minimum group), so a step reads 32 prompts' rows.
TRAIN_BATCH, TRAIN_GENERATIONS = 64, 2
RECIPE = REPO / "recipes" / "vqa" / "tiny_clevr_count.yaml"
QUALITY = {"JPEG": {"quality": 90}, "WEBP": {"quality": 85}}  # PNG is lossless
# The child: one `get_dataset` start, its time and its memory (read from /proc every 20 ms by a thread, since the
# peak of each part falls somewhere inside the pass).
CHILD = """
import json, sys, threading, time
from pathlib import Path

def status():
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}

peaks = dict.fromkeys(("RssAnon", "RssFile"), 0.0)
def sample():
    while True:
        now = status()
        for key in peaks:
            peaks[key] = max(peaks[key], now[key])
        time.sleep(0.02)

from trl import GRPOConfig, ModelConfig
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.data import get_dataset
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[3:])[0]
threading.Thread(target=sample, daemon=True).start()
for _ in range(int(sys.argv[2])):
    before = status()
    started = time.perf_counter()
    rows = get_dataset(args, "train", int(sys.argv[1]))
    rows[len(rows) - 1]  # one row read: decoded at access
    seconds = time.perf_counter() - started
    after = status()
    print(json.dumps({"seconds": seconds, "peak_rss_mib": after["VmHWM"], "imports_rss_mib": before["VmHWM"],
                      "peak_anon_mib": peaks["RssAnon"], "peak_file_mib": peaks["RssFile"]}))
"""
# The loader child: the rows as training reads them (shuffled batches through `__getitems__`, GRPO's identity
# collator, the main process reading as with `dataloader_num_workers: 0`) for some epochs, with the process's RSS
# (and its file-backed part) before reading, after its first 50 batches and at the end; `unreleased` patches the
# loader's page release out, for the comparison. The model is left out: its memory does not grow with the rows read.
LOADER = """
import json, sys
from pathlib import Path
import torch

def rss():
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssFile")}

from trl import GRPOConfig, ModelConfig
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.data import get_dataset, reading
if sys.argv[3] == "unreleased":
    reading._ReleasingReads.__call__ = lambda self, batch: self.decode(batch)
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[4:])[0]
rows = get_dataset(args, "train", int(sys.argv[1]))
torch.manual_seed(0)
loader = torch.utils.data.DataLoader(rows, batch_size=8, shuffle=True, collate_fn=list)
read, before, after_50 = 0, rss(), None
for _ in range(int(sys.argv[2])):
    for batch in loader:
        read += len(batch)
        after_50 = rss() if after_50 is None and read >= 50 * 8 else after_50
print(json.dumps({"rows_read": read, "before": before, "after_50_batches": after_50, "end": rss()}))
"""


def source_name(rows: int, width: int, height: int, kind: str, images: int, group: int) -> str:
    return f"{kind.lower()}-{width}x{height}-{images}img-{rows}rows-{f'{group}per-group' if group else '100MB-groups'}"


def write_source(folder: Path, rows: int, width: int, height: int, kind: str, images: int, group: int = 100) -> Path:
    """`folder/train.parquet`: `rows` rows of `images` distinct drawn images each (coloured boxes on a gradient), a
    counting question and its numeric answer, in row groups of `group` rows (0: `datasets`' default, up to 100 MB).
    Kept if it is already there."""
    if (folder / "train.parquet").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    base = Image.linear_gradient("L").resize((width, height)).convert("RGB")

    def draw(rng: random.Random) -> tuple[bytes, int]:
        image = base.copy()
        pen = ImageDraw.Draw(image)
        count = rng.randint(1, 6)
        for _ in range(count):
            x, y = rng.randrange(width - 40), rng.randrange(height - 40)
            pen.rectangle([x, y, x + 30, y + 30], fill=(rng.randrange(256), 40, 200))
        buffer = io.BytesIO()
        image.save(buffer, format=kind, **QUALITY.get(kind, {}))
        return buffer.getvalue(), count

    def generate():
        for index in range(rows):
            rng = random.Random(index)
            drawn = [draw(rng) for _ in range(images)]
            encoded = [{"bytes": data} for data, _ in drawn]
            yield {"id": str(index), "image": encoded if images > 1 else encoded[0],
                   "question": "How many boxes?", "answer": str(sum(count for _, count in drawn))}  # fmt: skip

    image = datasets.List(datasets.Image()) if images > 1 else datasets.Image()
    features = datasets.Features(
        {"id": datasets.Value("string"), "image": image, "question": datasets.Value("string"),
         "answer": datasets.Value("string")}
    )  # fmt: skip
    building = folder / "building"  # `from_generator`'s own Arrow cache, removed once the parquet file is written
    rows_written = datasets.Dataset.from_generator(generate, features=features, cache_dir=str(building))
    rows_written.to_parquet(str(folder / "train.partial"), batch_size=group or None)  # a row group per batch
    (folder / "train.partial").replace(folder / "train.parquet")
    shutil.rmtree(building)
    return folder


def recipe_keys(folder: Path, skip: bool) -> list[str]:
    """The tiny CLEVR-count recipe's keys pointed at a synthetic source (`skip`: with `skip_bad_rows: true`)."""
    return ["--dataset_name", str(folder), "--vqa_image_column", "image", "--vqa_image_folder", "null",
            "--vqa_id_column", "id", "--vqa_answer_type", "number", "--skip_bad_rows", str(skip)]  # fmt: skip


def starts(folder: Path, cache: Path, count: int, skip: bool) -> list[dict[str, Any]]:
    """`count` starts of `get_dataset` in one fresh process: the first runs the pass, the next read its cache."""
    argv = ["--config", str(RECIPE), *recipe_keys(folder, skip)]
    env = {"HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = check(run_measured(["-c", CHILD, str(MAX_PIXELS), str(count), *argv], env=env), "get_dataset")
    return [json.loads(line) for line in done.output.strip().splitlines()[-count:]]


def train(
    folder: Path, cache: Path, steps: int, run_dir: Path, token_checks: int, skip: bool, batch: list[str] | None = None
) -> dict[str, Any]:
    """A `steps`-step run of `recipes/train.py` on the source: its peak RSS, seconds from start to first step (model
    load included) and its resident memory (VmRSS) when each step was logged (`batch`: the recipe keys of a long
    run, see `epochs_run`; it keeps the tiny replica's own pixel limit)."""
    # The same pixel limit as the `get_dataset` starts (the tiny replica's processor would cap images far lower), so
    # that training reads the cache they made. The recipe's `token_check_samples: -1` renders every prompt through
    # the processor at the first start (rows x tens of ms): the default sample keeps this a measure of the data path.
    limit = [] if batch else ["--max_pixels", str(MAX_PIXELS)]
    argv = ["recipes/train.py", "--config", str(RECIPE), *recipe_keys(folder, skip), "--max_steps", str(steps),
            "--output_dir", str(run_dir), "--save_strategy", "no", *limit,
            "--token_check_samples", str(token_checks), *(batch or [])]  # fmt: skip
    env = {"HF_DATASETS_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    done = check(run_measured(argv, timeout=4 * 3600, env=env), "recipes/train.py")
    log = read_step_log(run_dir)
    return {
        "peak_rss_mib": done.peak_rss_mib,
        "to_first_step_s": log.first_step_start() - done.started,
        "rss_at_step_mib": [done.rss_at(when) for when in log.wall_times],
    }


def epochs_run(folder: Path, cache: Path, rows: int, epochs: int, run_dir: Path, skip: bool) -> dict[str, Any]:
    """Training that reads every row `epochs` times: TRL's sampler gives each step `TRAIN_BATCH / TRAIN_GENERATIONS`
    prompts (each row read once per completion), so `rows * epochs` prompts take that many steps; resident memory
    after the first 50 steps against at the end says whether it grows with the rows read. The rows are read and
    decoded at their source size; the model sees them at the tiny replica's own pixel limit (at 1 MP its 64
    completions of 1,280 image tokens took about 70 s a step here, 4.3 GB resident), so its first start checks the
    rows again under that limit (another cache key)."""
    prompts_per_step = TRAIN_BATCH // TRAIN_GENERATIONS
    steps = -(-rows * epochs // prompts_per_step)
    batch = ["--per_device_train_batch_size", str(TRAIN_BATCH), "--num_generations", str(TRAIN_GENERATIONS),
             "--max_completion_length", "4", "--logging_steps", "1"]  # fmt: skip
    figures = train(folder, cache, steps, run_dir, 32, skip, batch)
    rss = figures["rss_at_step_mib"]
    after = min(50, len(rss)) - 1
    return {**figures, "steps": steps, "prompts_read": steps * prompts_per_step, "rss_after_50_steps_mib": rss[after],
            "rss_end_mib": rss[-1], "rss_growth_mib": rss[-1] - rss[after]}  # fmt: skip


def disk_mb(folder: Path) -> float:
    """MB of the Arrow files under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*.arrow")) / 1e6 if folder.is_dir() else 0.0


def measure(args: argparse.Namespace, scratch: Path, rows: int) -> dict[str, Any]:
    name = source_name(rows, args.width, args.height, args.format, args.images, args.row_group_rows)
    folder = write_source(scratch / name, rows, args.width, args.height, args.format, args.images, args.row_group_rows)
    layout = pq.read_metadata(folder / "train.parquet")
    skip = args.skip_bad_rows
    cache = scratch / f"cache-{name}{'-skip' if skip else ''}"
    reused = args.reuse_cache and cache.is_dir()
    if not reused:
        shutil.rmtree(cache, ignore_errors=True)  # a first start finds nothing
    # A second start is a fresh process, as a user's is; `--quick` saves the second import of the libraries.
    if reused:
        first, second = None, starts(folder, cache, 1, skip)[0]
    elif args.quick:
        first, second = starts(folder, cache, 2, skip)
    else:
        first, second = starts(folder, cache, 1, skip)[0], starts(folder, cache, 1, skip)[0]
    figures = {
        "rows": rows,
        "source_mb": (folder / "train.parquet").stat().st_size / 1e6,
        "row_groups": layout.num_row_groups,
        "largest_row_group_mb": max(layout.row_group(i).total_byte_size for i in range(layout.num_row_groups)) / 1e6,
        "first": first,
        "second": second,
        "pass_rows_per_s": rows / first["seconds"] if first else None,
        "rows_cache_mb": disk_mb(cache / "vision_grpo_rows"),
        "source_arrow_mb": disk_mb(cache) - disk_mb(cache / "vision_grpo_rows"),
    }
    if args.loader_epochs:
        argv = ["--config", str(RECIPE), *recipe_keys(folder, skip)]
        env = {"HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        figures["loader"] = {}
        for way in ("released", "unreleased"):
            command = ["-c", LOADER, str(MAX_PIXELS), str(args.loader_epochs), way, *argv]
            done = check(run_measured(command, 7200, env), "loader")
            figures["loader"][way] = json.loads(done.output.strip().splitlines()[-1])
    if args.train_steps:
        runs = scratch / f"runs-{name}"
        shutil.rmtree(runs, ignore_errors=True)
        if not reused:
            shutil.rmtree(cache)
            figures["train"] = [
                train(folder, cache, args.train_steps, runs / order, args.token_check_samples, skip)
                for order in ("first", "second")
            ]
        else:
            second_run = train(folder, cache, args.train_steps, runs / "second", args.token_check_samples, skip)
            figures["train"] = [None, second_run]
    if args.train_epochs:
        run_dir = scratch / f"epochs-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        figures["epochs"] = epochs_run(folder, cache, rows, args.train_epochs, run_dir, skip)
    if not args.reuse_cache:
        shutil.rmtree(cache, ignore_errors=True)
    return figures


def table(results: list[dict[str, Any]]) -> str:
    header = ["rows", "source MB (row groups, largest MB)", "first start s", "pass rows/s", "second start s",
              "peak RSS MiB 1st (anon + file) / 2nd", "rows cache MB", "source Arrow MB"]  # fmt: skip
    lines = []
    for r in results:
        first, second = r["first"], r["second"]
        if first:
            rss = f"{first['peak_rss_mib']:.0f} ({first['peak_anon_mib']:.0f} + {first['peak_file_mib']:.0f}) / "
            first_s, rate = f"{first['seconds']:.1f}", f"{r['pass_rows_per_s']:.0f}"
        else:  # --reuse-cache found the cache: no first start
            rss, first_s, rate = "- / ", "-", "-"
        source = f"{r['source_mb']:.0f} ({r['row_groups']}, {r['largest_row_group_mb']:.0f})"
        lines.append([r["rows"], source, first_s, rate, f"{second['seconds']:.1f}",
                      rss + f"{second['peak_rss_mib']:.0f}", f"{r['rows_cache_mb']:.1f}",
                      f"{r['source_arrow_mb']:.0f}"])  # fmt: skip
    text = markdown_table(header, lines)
    trained = [r for r in results if "train" in r]
    if trained:
        header = ["rows", "train peak RSS MiB (1st / 2nd)", "start to first step s (1st / 2nd)"]
        lines = [
            [r["rows"], " / ".join(f"{t['peak_rss_mib']:.0f}" if t else "-" for t in r["train"]),
             " / ".join(f"{t['to_first_step_s']:.1f}" if t else "-" for t in r["train"])]
            for r in trained
        ]  # fmt: skip
        text += "\n\n" + markdown_table(header, lines)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--format", default="JPEG", choices=["JPEG", "PNG", "WEBP"])
    parser.add_argument("--images", type=int, default=1, help="images per row (2 or more: a list-of-images column)")
    parser.add_argument("--skip-bad-rows", action="store_true", help="every start with skip_bad_rows: true")
    parser.add_argument(
        "--row-group-rows", type=int, default=100, help="rows per row group of the source (0: datasets' default)"
    )
    parser.add_argument(
        "--loader-epochs", type=int, default=0, help="also read the rows this many epochs as the training loader does"
    )
    parser.add_argument("--train-steps", type=int, default=0, help="also time recipes/train.py runs")
    parser.add_argument(
        "--train-epochs", type=int, default=0, help="also train until every row was read this many times (RSS growth)"
    )
    parser.add_argument(
        "--token-check-samples", type=int, default=32, help="the training runs' token_check_samples (-1: every prompt)"
    )
    parser.add_argument("--scratch", help="folder that keeps the generated sources (default: a temporary one)")
    parser.add_argument(
        "--reuse-cache",
        action="store_true",
        help="keep each size's datasets cache in --scratch; where one is already there, skip the first starts "
        "(second starts only)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument(
        "--quick", action="store_true", help="run_all's smoke run: small images, both starts in one process"
    )
    args = parser.parse_args()
    if args.quick:
        args.rows, args.width, args.height, args.train_steps = [64], 64, 48, 0
    with tempfile.TemporaryDirectory(prefix="data-scale-") as temporary:
        scratch = Path(args.scratch or temporary)
        results = []
        for rows in args.rows:
            results.append(measure(args, scratch, rows))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    groups = f"{args.row_group_rows} rows" if args.row_group_rows else "up to 100 MB"
    described = f"{args.format} {args.width}x{args.height}, {args.images} image(s) per row, row groups of {groups}"
    print(f"data_scale: {described}, max_pixels {MAX_PIXELS}; {machine()}")
    print(table(results), flush=True)
    skipping = ", skip_bad_rows" if args.skip_bad_rows else ""
    size = f"{args.width * args.height / 1e6:.1f} MP ({args.format.lower()}, {args.images} image(s) a row{skipping})"
    for r in results:
        if r["pass_rows_per_s"]:
            print(f"checking pass: {r['pass_rows_per_s']:.0f} rows/s at {size}, {r['rows']} rows")
        print(f"second start: {r['second']['seconds']:.1f} s, {r['rows']} rows")
        for way, loader in r.get("loader", {}).items():
            growth = loader["end"]["VmRSS"] - loader["after_50_batches"]["VmRSS"]
            points = ", ".join(
                f"{name} {loader[point]['VmRSS']:.0f} / {loader[point]['RssFile']:.0f}"
                for name, point in (("before", "before"), ("after 50 batches", "after_50_batches"), ("end", "end"))
            )
            print(f"loader RSS growth over {loader['rows_read']} rows read ({way}): {growth:.0f} MiB (VmRSS / "
                  f"file-backed MiB: {points})")  # fmt: skip
        if "epochs" in r:
            e = r["epochs"]
            print(f"training RSS growth over {e['prompts_read']} rows read: {e['rss_growth_mib']:.0f} MiB (VmRSS "
                  f"after 50 steps {e['rss_after_50_steps_mib']:.0f} MiB, at step {e['steps']} {e['rss_end_mib']:.0f} "
                  f"MiB; {r['rows']} rows x {args.train_epochs} epochs, {TRAIN_BATCH // TRAIN_GENERATIONS} prompts "
                  f"a step, each row read {TRAIN_GENERATIONS} times a prompt)")  # fmt: skip
    report("data_scale", {"setting": described, "sizes": results}, args.json)


if __name__ == "__main__":
    main()
