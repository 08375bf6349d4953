"""CPU vLLM test environment only: let PyPI's (CUDA) torchvision import beside the CPU torch wheel.

vLLM needs torchvision to inspect Qwen-VL architectures, and transformers imports it for their model classes. PyPI's
torchvision is built for CUDA torch; with the CPU wheel its `_meta_registrations.py` fails at import with
`operator torchvision::nms does not exist`, because it registers fake kernels for CUDA-built operators the CPU
torch never defined. This guards those registrations (nothing here uses `nms`). Run by `tests_vllm/make_env.sh` in
`.venv-vllm`; a GPU install has a matching torchvision and needs none of it. Idempotent.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GUARD = '''

def _register_fake_if_defined(name):
    """Patched by tests_vllm/patch_torchvision.py: skip operators this (CPU) torch does not define."""
    def wrap(fn):
        try:
            return torch.library.register_fake(name)(fn)
        except RuntimeError:
            return fn
    return wrap
'''


def main() -> None:
    spec = importlib.util.find_spec("torchvision")
    assert spec is not None and spec.origin is not None, "torchvision is not installed"
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    if "_register_fake_if_defined" in text:
        print(f"{path}: already patched")
        return
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    assert anchor in text, f"{path}: unexpected layout, cannot patch"
    patched = text.replace(anchor, GUARD.lstrip("\n") + "\n\n" + anchor, 1)
    fake = '@torch.library.register_fake("torchvision::'
    patched = patched.replace(fake, '@_register_fake_if_defined("torchvision::')
    path.write_text(patched)
    print(f"{path}: guarded the fake-kernel registrations of operators CPU torch lacks")


if __name__ == "__main__":
    main()
