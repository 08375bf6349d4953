"""`python -m vision_grpo.plan`: the memory plan of a recipe (vision_grpo/plan/plan_command.py)."""

import logging
import sys

from vision_grpo.plan.plan_command import main

logging.basicConfig(level=logging.WARNING)
sys.exit(main())
