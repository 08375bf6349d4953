"""Run a project entry point with transformers' weight loading refused, and report this process's peak memory.

    python tests_vllm/without_hf_weights.py eval/evaluate.py --backend vllm ...

`--backend vllm` must leave the weights to the engine: at real size, a transformers copy beside vLLM's doubles the
memory of the evaluating process. Any `from_pretrained` of a transformers model (AutoModel*, a model class, PEFT's
base) fails here with an AssertionError naming the call. On exit the process's own peak RSS (`ru_maxrss`, the
engine's processes not included) is printed as `peak_rss_kib=<n>`.
"""

from __future__ import annotations

import atexit
import resource
import runpy
import sys

from transformers import PreTrainedModel


def refuse(cls: type, name: str, *args: object, **kwargs: object) -> None:
    raise AssertionError(f"{cls.__name__}.from_pretrained({name!r}) was called: the vLLM path loaded HF weights")


def report_peak() -> None:
    print(f"peak_rss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)


if __name__ == "__main__":
    PreTrainedModel.from_pretrained = classmethod(refuse)
    atexit.register(report_peak)
    sys.argv = sys.argv[1:]  # the entry point's own argv
    runpy.run_path(sys.argv[0], run_name="__main__")
