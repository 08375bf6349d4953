"""Evaluate a base model, a trained model or a saved adapter with the recipe it was trained with.

    python eval/evaluate.py --config recipes/geoqa/qwen3_5_4b_lora.yaml --output results/base.json
    python eval/evaluate.py --config recipes/geoqa/qwen3_5_4b_lora.yaml \\
        --adapter runs/geoqa/qwen3_5_4b_lora/<run>/checkpoint-100 --output results/step100.json

    accelerate launch eval/evaluate.py --config ...     # the items split across the processes (GPUs)

The model, prompt, pixel limits and chat-template switches come from the recipe (any key can be overridden on the
command line), and the examples come from the same `get_dataset` as training: the held-out split (`eval`) of the
task. The model goes to the GPU (or MPS) when there is one, in the recipe's dtype. Decoding is greedy with a
generation config of our own (nothing from the checkpoint's `generation_config.json`), recorded in the result, in
batches of prompts of similar length, left-padded; answers do not depend on the batch size or the number of
processes. Records are appended to `<output>.partial.jsonl` as they finish (after a header line holding the run's
settings, the model's and adapter's weights by content among them), so `--resume` continues an interrupted run with
the same settings and weights; the final JSON is written atomically. One evaluation at a time writes an output (a
lock, `<output>.lock`), and an existing result or partial file is never replaced without `--overwrite`.
"""

from __future__ import annotations

import vision_grpo.run.launched  # first: a launcher killed while the imports below run stops this worker too

# isort: split
import json
import logging

from accelerate import PartialState

from vision_grpo.evaluation.evaluate import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with vision_grpo.run.launched.errors_named_first():
        summary = main()["summary"]
    if PartialState().is_main_process:
        print(json.dumps(summary, indent=1, ensure_ascii=False))
    vision_grpo.run.launched.finish()
