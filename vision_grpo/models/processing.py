"""Loading a Qwen-VL processor, with a fallback for machines without torchvision.

Every full Qwen-VL processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) declares a video processor, and every video
processor needs torchvision. Our recipes only use images, so when the full processor cannot be built we build the
same processor class without its video part: same image processor, tokenizer and chat template, hence the same
prompts and the same image-token counts. This is the loader for the embedded tiny model and for real checkpoints.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, ProcessorMixin, Qwen2_5_VLProcessor
from transformers.models.auto.processing_auto import processor_class_from_name
from transformers.utils import cached_file, is_torchvision_available

logger = logging.getLogger(__name__)


@functools.cache
def image_only_processor_class(processor_cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """A subclass of `processor_cls` whose constructor takes no video processor.

    The subclass keeps the parent's name so that what `save_pretrained` writes stays a standard processor config,
    and it saves the image processor's own `preprocessor_config.json` too, as Hub Qwen-VL checkpoints ship it: on a
    machine with torchvision, transformers builds the missing video processor from that file, so AutoProcessor
    (vLLM's, lmms-eval's) loads what we saved (replicas, checkpoints, exports) back as the full processor. Without
    it that load fails: "Can't load video processor".
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        saved = processor_cls.save_pretrained(self, save_directory, *args, **kwargs)
        self.image_processor.save_pretrained(save_directory)
        return saved

    namespace = {"__init__": __init__, "save_pretrained": save_pretrained, "__module__": __name__}
    return type(processor_cls.__name__, (processor_cls,), namespace)


def _needs_torchvision(error: Exception) -> bool:
    return "torchvision" in str(error).lower() or "video" in str(error).lower()


@functools.cache
def _say_image_only() -> None:
    """A machine without torchvision is no fault: one short line per process (rank 0's only under a launcher), not
    transformers' error at every load, a paragraph about the Hub and local folders that reads as a failure."""
    if os.environ.get("RANK", "0") == "0":
        logger.info("no torchvision here: processors load without their video part (these recipes use images only)")


def load_processor(path: str, min_pixels: int | None, max_pixels: int | None, trust_remote_code: bool = False):
    """Load the processor of `path` with the recipe's pixel limits; image-only when torchvision is missing.

    The pixel limits go to the image processor, so training, evaluation and the visual-token check all see the same
    number of image tokens per image.
    """
    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ImportError, ValueError, TypeError, OSError) as error:
        if not _needs_torchvision(error):
            raise
        if is_torchvision_available():  # installed but broken (a CUDA build on a CPU machine): worth a look
            logger.warning("the full processor of %s failed (%s); loading it image-only", path, error)
        else:
            _say_image_only()
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        processor_cls = processor_class_from_name(_processor_class_name(path))
        processor = image_only_processor_class(processor_cls)(
            image_processor, tokenizer, chat_template=tokenizer.chat_template
        )
    set_pixel_limits(processor.image_processor, min_pixels, max_pixels)
    processor.tokenizer.padding_side = "left"
    return processor


def set_pixel_limits(image_processor: Any, min_pixels: int | None, max_pixels: int | None) -> None:
    """Replace the image processor's pixel limits (its `size` edges) with the recipe's, keeping any not given.

    `size={"shortest_edge", "longest_edge"}` is the form transformers 5 reads for every Qwen-VL family; the older
    `min_pixels`/`max_pixels` keywords are deprecated and warned about on every call.
    """
    current = image_processor.size
    size = {
        "shortest_edge": current["shortest_edge"] if min_pixels is None else min_pixels,
        "longest_edge": current["longest_edge"] if max_pixels is None else max_pixels,
    }
    if size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(f"min_pixels {size['shortest_edge']} is larger than max_pixels {size['longest_edge']}")
    image_processor.size = size


def _processor_class_name(path: str) -> str:
    """The processor class a checkpoint declares (processor_config.json, else tokenizer_config.json)."""
    for filename in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        resolved = cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
        if resolved:
            with open(resolved, encoding="utf-8") as handle:
                name = json.load(handle).get("processor_class")
            if name:
                return name
    return Qwen2_5_VLProcessor.__name__
