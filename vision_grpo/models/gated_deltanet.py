"""Which implementation Qwen3.5's Gated DeltaNet layers run: the flash-linear-attention and causal-conv1d kernels,
or transformers' torch fallback. The answer uses transformers' own checks (`is_flash_linear_attention_available`,
`is_causal_conv1d_available`: the package installed *and* a CUDA-class device present), so an install without a GPU
reads as the fallback, and the memory plan and the log name the path the layers take.
"""

from __future__ import annotations

from typing import Literal

from transformers.utils.import_utils import is_causal_conv1d_available, is_flash_linear_attention_available

GatedDeltaNetPath = Literal["kernels", "torch"]


def gated_deltanet_path() -> GatedDeltaNetPath:
    """Returns "kernels" when both flash-linear-attention (the chunked delta rule) and causal-conv1d can run here, else
    "torch" (the reference PyTorch fallback: correct, slower, and more memory in prefill; see docs/memory.md)."""
    return "kernels" if is_flash_linear_attention_available() and is_causal_conv1d_available() else "torch"


def describe_gated_deltanet_path(path: GatedDeltaNetPath) -> str:
    """One log line's text naming the path and, for the fallback, how to get the kernels."""
    if path == "kernels":
        return "Gated DeltaNet layers: flash-linear-attention + causal-conv1d kernels"
    return (
        "Gated DeltaNet layers: torch fallback (flash-linear-attention/causal-conv1d not usable here: "
        "on a CUDA GPU, pip install -e '.[gpu]')"
    )
