"""pass@k on the recipe's held-out images: k completions per image, sampled as GRPO samples them in training.

Greedy accuracy says what a model answers; pass@k says whether a right answer is among what it samples, which is
all a GRPO group can find and reinforce. Comparing the two before and after GRPO shows what GRPO turned into greedy
accuracy. Model loading, prompts, pixels, stop and suppressed tokens, the cut after EOS and scoring are the
evaluator's own (`build_evaluator`, `Evaluator.encode`, `Evaluator.completion`, its scorer): one path for prompts.
The sampling settings are the recipe's training ones (temperature, top-p, top-k, min-p, repetition penalty,
completion length), as TRL's GRPOTrainer builds them, and nothing from the checkpoint's generation config.

    python eval/pass_at_k.py --config recipes/shapes/tiny_grpo_demo.yaml \\
        --model_name_or_path runs/shapes/tiny_grpo_demo/demo --k 8 --output results/grpo_pass8.json
"""

from __future__ import annotations

import json

from vision_grpo.evaluation.pass_at_k import main

if __name__ == "__main__":
    print(json.dumps(main()["summary"], indent=1))
