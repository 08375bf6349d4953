"""The libraries every entry point imports, imported once by `preloaded.py`'s fork server (never our own code)."""

import accelerate  # noqa: F401
import datasets  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: F401
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: F401
