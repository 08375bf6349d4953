"""Peak memory of the evaluator against the size of the eval split: it must hold its records and one batch, not
the split's images.

    python benchmarks/eval_memory.py [--sizes 100 5000] [--side 160]

Each size runs in its own process: a synthetic VQA split of our own making (JPEG images of `--side` pixels, a
number question each) is written to an on-disk `datasets` cache (memory-mapped, images encoded until read, as the
data path returns rows), then evaluated by `run_evaluation` with the tiny shapes recipe's model and processor,
greedy, one new token, batch 8. Printed per size: the process's peak RSS before the evaluation (model and data
opened) and after it.
"""

from __future__ import annotations

import argparse
import io
import resource
import tempfile
from pathlib import Path

import datasets
from common import RECIPE, child_figures, machine, markdown_table
from PIL import Image

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "prompt": [
            {
                "role": datasets.Value("string"),
                "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
            }
        ],
        "image": datasets.Image(),
        "answer": datasets.Value("string"),
        "answer_type": datasets.Value("string"),
        "tolerance": datasets.Value("float64"),
    }
)


def synthetic_rows(count: int, side: int):
    """`count` rows: a noisy JPEG each (so it does not compress to nothing), a question, a number answer."""
    for index in range(count):
        image = Image.effect_noise((side, side), 40 + index % 50).convert("RGB")
        encoded = io.BytesIO()
        image.save(encoded, format="JPEG", quality=90)
        text = [
            {"type": "image", "text": None},
            {"type": "text", "text": f"How many? Row {index}. Answer in \\boxed{{}}."},
        ]
        yield {
            "id": str(index),
            "prompt": [{"role": "user", "content": text}],
            "image": {"bytes": encoded.getvalue(), "path": None},
            "answer": str(index % 7),
            "answer_type": "number",
            "tolerance": 0.0,
        }


def measure(count: int, side: int, folder: Path) -> dict[str, float]:
    """In this process: write the split, evaluate it, return peak RSS (MiB) before and after the evaluation. The
    evaluator's libraries are imported here, not by the process that forks this one, as a fresh process would."""
    from trl import GRPOConfig, ModelConfig

    from vision_grpo.evaluation.eval_options import EvalArguments
    from vision_grpo.evaluation.evaluate import run_evaluation
    from vision_grpo.evaluation.evaluator import Evaluator
    from vision_grpo.models.loading import get_processor, load_model
    from vision_grpo.recipe.arguments import TaskArguments
    from vision_grpo.recipe.parse import parse_recipe

    dataset = datasets.Dataset.from_generator(
        synthetic_rows, gen_kwargs={"count": count, "side": side}, features=FEATURES, cache_dir=str(folder / "cache")
    )
    task_args, _, model_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), ["--config", str(RECIPE)])
    processor = get_processor(model_args, task_args)
    evaluator = Evaluator(load_model(model_args), processor, "vqa", [], {})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    eval_args = EvalArguments(output=str(folder / "eval.json"), batch_size=8, max_new_tokens=1)
    result = run_evaluation(evaluator, dataset, eval_args, 1, {"rows": count})
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert result["summary"]["n"] == count
    return {
        "rows": count,
        "peak_rss_before_mib": before,
        "peak_rss_mib": after,
        "seconds": result["summary"]["total_seconds"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 5000])
    parser.add_argument("--side", type=int, default=160, help="image side in pixels")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eval-memory-") as tmp:
        figures = [child_figures(measure, n, args.side, Path(tmp) / str(n), what=f"{n} rows") for n in args.sizes]
    base = figures[0]["peak_rss_mib"]
    rows = [
        [
            f["rows"],
            f"{f['peak_rss_before_mib']:.0f}",
            f"{f['peak_rss_mib']:.0f}",
            f"{f['peak_rss_mib'] - base:+.0f}",
            f"{f['seconds']:.0f}",
        ]
        for f in figures
    ]
    print(markdown_table(["rows", "peak RSS before eval (MiB)", "peak RSS (MiB)", "vs first size", "eval s"], rows))
    print(machine())


if __name__ == "__main__":
    main()
