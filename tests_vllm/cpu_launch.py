"""Run a project entry point in the CPU vLLM test environment with test-only switches; without one, as is.

    python tests_vllm/cpu_launch.py [--unfixed-prompts] [--vllm-dtype DTYPE] recipes/train.py \
        --config recipes/shapes/tiny_cpu_vllm_colocate.yaml

- `--unfixed-prompts` sends TRL's own prompts to the engine (image placeholders already expanded, expanded again by
  vLLM), bypassing `VisionPromptEngine`: the corrupted run the logprob-gap guard must stop.
- `--vllm-dtype float32` (or another dtype) starts TRL's colocated engine in that dtype. TRL passes none, so vLLM's
  `auto` applies, which runs a float32 checkpoint (the replicas) in the platform's 16-bit type (bf16 here): the flag
  separates bf16 numerics from the rest of the logprob gap (docs/scaling.md).
"""

from __future__ import annotations

import functools
import runpy
import sys

import trl.generation.vllm_generation as trl_vllm

from vision_grpo.training.vllm_generation import VisionPromptEngine


def trl_prompts(self: VisionPromptEngine, prompts: list, *args, **kwargs) -> list:
    """What TRL 1.16 sends: the processor's expanded ids with the image, unchecked."""
    return self.llm.generate(prompts, *args, **kwargs)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--unfixed-prompts":
        VisionPromptEngine.generate = trl_prompts
        args = args[1:]
    if args and args[0] == "--vllm-dtype":
        trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype=args[1])
        args = args[2:]
    script, *rest = args
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
