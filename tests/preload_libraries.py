"""The libraries every entry point imports, imported once by `preloaded.py`'s fork server (never our own code).

Beyond the core stack: accelerate imports DeepSpeed whenever it is installed (`extract_model_from_parallel`, which
TRL's trainer calls), our callbacks import TensorBoard's hparams protos, the VQA rewards `math_verify`, and every
run loads one family's model, processor and tokenizer modules and TRL's parser. Left out, every forked command
imported them again itself.
"""

import accelerate  # noqa: F401
import datasets  # noqa: F401
import deepspeed  # noqa: F401
import math_verify  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: F401
import transformers.models.qwen2_5_vl.processing_qwen2_5_vl  # noqa: F401
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl  # noqa: F401
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
import transformers.models.qwen3_5.tokenization_qwen3_5  # noqa: F401
import transformers.models.qwen3_vl.modeling_qwen3_vl  # noqa: F401
import transformers.models.qwen3_vl.processing_qwen3_vl  # noqa: F401
from PIL import ImageDraw  # noqa: F401
from tensorboard.compat.proto import summary_pb2  # noqa: F401
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2  # noqa: F401
from torch.utils.tensorboard import SummaryWriter  # noqa: F401
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: F401
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, TrlParser  # noqa: F401
