"""GRPO for vision-language models on TRL: the library behind recipes/ and eval/ (the entry points users run).

Sub-packages by job, in layers: each may import only the layers below it, and the packages named on one line are
independent of each other (pyproject.toml's import-linter contract checks it; docs/architecture.md draws it):

    demo | export         the commands `python -m vision_grpo.demo` (make demo) and `python -m vision_grpo.export`
    training              TRL's GRPOTrainer subclass, vLLM generation, the logprob guard, trainer callbacks
    evaluation            the evaluator, its result files, pass@k, comparisons and their statistics
    run | plan            one run's folder, manifest, resume, signals | the memory plan (`python -m vision_grpo.plan`)
    models                loading, processors, the embedded replicas, LoRA, vision parts, the visual-token check
    data                  the task plugins (the data/ folder)
    rewards | recipe      the reward plugins (the rewards/ folder) | recipe keys and parsing, `--help`
    plugins               loading plugin files, the reward and task registries
"""

from vision_grpo.storage.cache_home import hf_home_without_home

hf_home_without_home()  # before any import of huggingface_hub or datasets reads HOME (storage/cache_home.py says why)
