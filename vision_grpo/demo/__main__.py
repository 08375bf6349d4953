"""`python -m vision_grpo.demo` (`make demo`): two GRPO experiments on the embedded default (demo/cli.py)."""

from vision_grpo.demo.cli import main

main()
