"""`python -m vision_grpo.export`: ship a trained policy as one standalone model folder (export_command.py)."""

import logging

from vision_grpo.export.export_command import main

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
main()
