"""How the data path scales with the number of rows: a synthetic VQA set of our own making (JPEG, one image column),
prepared by `get_dataset` in a fresh process per start; prints per size the seconds of the first start (the checking
pass) and of the second (the cache read), rows/s of the pass, peak RSS of the process, and the cache's disk use.

    python benchmarks/data_scale.py [--rows 1000 4000] [--width 640 --height 480] [--format JPEG]

Not yet here (docs/datasets.md says so): PNG and list-of-images columns, a 2-step training run, the evaluator.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import datasets
from PIL import Image, ImageDraw

MAX_PIXELS = 1003520
CHILD = """
import json, resource, sys, time
from trl import GRPOConfig, ModelConfig
from vision_grpo.config import TaskArguments, parse_recipe
from vision_grpo.data import get_dataset
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[2:])[0]
started = time.perf_counter()
rows = get_dataset(args, "train", int(sys.argv[1]))
rows[len(rows) - 1]  # one row read: decoded at access
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_source(folder: Path, rows: int, width: int, height: int, kind: str) -> Path:
    """`rows` distinct drawn images (coloured boxes on a gradient), a counting question, a numeric answer."""
    folder.mkdir(parents=True, exist_ok=True)
    base = Image.linear_gradient("L").resize((width, height)).convert("RGB")

    def generate():
        for index in range(rows):
            rng = random.Random(index)
            image = base.copy()
            draw = ImageDraw.Draw(image)
            count = rng.randint(1, 6)
            for _ in range(count):
                x, y = rng.randrange(width - 40), rng.randrange(height - 40)
                draw.rectangle([x, y, x + 30, y + 30], fill=(rng.randrange(256), 40, 200))
            buffer = io.BytesIO()
            image.save(buffer, format=kind, quality=90) if kind == "JPEG" else image.save(buffer, format=kind)
            yield {"id": str(index), "image": {"bytes": buffer.getvalue()}, "question": "How many boxes?",
                   "answer": str(count)}  # fmt: skip

    features = datasets.Features(
        {"id": datasets.Value("string"), "image": datasets.Image(), "question": datasets.Value("string"),
         "answer": datasets.Value("string")}
    )  # fmt: skip
    datasets.Dataset.from_generator(generate, features=features).to_parquet(str(folder / "train.parquet"))
    return folder


def start(folder: Path, hf_home: Path) -> dict:
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_answer_type", "number", "--use_cpu", "true"]
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(MAX_PIXELS), *argv], capture_output=True, text=True, check=True,
        env={**__import__("os").environ, **env},
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--format", default="JPEG", choices=["JPEG", "PNG"])
    args = parser.parse_args()
    print("| rows | source MB | first start s | pass rows/s | second start s | peak RSS MiB (1st / 2nd) | cache MB |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for rows in args.rows:
            folder = write_source(Path(scratch) / f"rows{rows}", rows, args.width, args.height, args.format)
            hf_home = Path(scratch) / f"hf{rows}"
            first, second = start(folder, hf_home), start(folder, hf_home)
            cache = sum(p.stat().st_size for p in (hf_home / "datasets" / "vision_grpo_rows").rglob("*.arrow"))
            source_mb = (folder / "train.parquet").stat().st_size / 1e6
            print(
                f"| {rows} | {source_mb:.0f} | {first['seconds']:.1f} | {rows / first['seconds']:.0f} | "
                f"{second['seconds']:.1f} | {first['peak_rss_mib']:.0f} / {second['peak_rss_mib']:.0f} | "
                f"{cache / 1e6:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
