"""Which implementation Qwen3.5's Gated DeltaNet layers run: the flash-linear-attention and causal-conv1d kernels,
or transformers' torch fallback. The answer uses transformers' own checks (`is_flash_linear_attention_available`,
`is_causal_conv1d_available`: the package installed *and* a CUDA-class device present), so an install without a GPU
reads as the fallback, and the memory plan and the log name the path the layers take.

An installed flash-linear-attention older than 0.5 is refused for these models (`old_fla_message`): transformers
takes `fla.chunk_gated_delta_rule` whenever `fla` imports, whatever its version
(`transformers/integrations/hub_kernels.py`, `use_kernel_func_from_hub_with_fallback`), and passes Qwen3.5's q and k
with their 16 key heads and v with its 32 value heads unrepeated; fla reads that as grouped value heads only since
0.5.0 (fla #799, #812). Before, it takes the head count from k and indexes v by it: wrong outputs, no error (read
from fla 0.4.2's chunk_delta_h.py and wy_fast.py; not run, there is no CUDA here).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from packaging.version import Version
from transformers.utils.import_utils import is_causal_conv1d_available, is_flash_linear_attention_available

GatedDeltaNetPath = Literal["kernels", "torch"]
FLA, FLA_GROUPED_VALUE_HEADS = "flash-linear-attention", Version("0.5.0")


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


def has_linear_attention(config: Any) -> bool:
    """Whether a model config's text model has Gated DeltaNet (`linear_attention`) layers (Qwen3.5)."""
    return "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or ())


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def old_fla_message() -> str | None:
    """Why the installed flash-linear-attention cannot run Gated DeltaNet layers (older than 0.5.0), or None (none
    installed, or a version that reads grouped value heads)."""
    installed = installed_version(FLA)
    if installed is None or Version(installed) >= FLA_GROUPED_VALUE_HEADS:
        return None
    return (
        f"{FLA} {installed} is installed: transformers runs Qwen3.5's Gated DeltaNet layers through it whenever it "
        f"imports, and before {FLA_GROUPED_VALUE_HEADS} it reads their 32 value heads by the 16 key heads (wrong "
        f"outputs, no error). pip install -U '{FLA}>={FLA_GROUPED_VALUE_HEADS}' (the gpu extra), or pip uninstall "
        f"{FLA} for the torch fallback"
    )
