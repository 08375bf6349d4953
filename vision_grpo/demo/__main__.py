"""`python -m vision_grpo.demo` (`make demo`): two GRPO experiments on the embedded default (demo/demo_command.py)."""

from vision_grpo.demo.demo_command import main

main()
