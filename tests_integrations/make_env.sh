#!/usr/bin/env bash
# Build the environment of the tests against the field's tools outside TRL (`make test-lmms-eval`, `make
# test-trackers`): a venv of its own beside `.venv`, never a user install. On a GPU machine, `pip install
# lmms-eval==0.7.3` (or `pip install -e ".[trackers]"`) beside this project is all it takes.
#
#   tests_integrations/make_env.sh [VENV]      (default .venv-integrations)
#
# Steps beyond those two installs, each because of a measured failure on this CPU machine:
# - torch first, `torch==2.13.0`: the local CPU wheel, so that nothing pulls a CUDA build; transformers and
#   accelerate held at this project's versions (lmms-eval alone resolves newer ones than the project allows).
# - decord: lmms-eval 0.7.3's Qwen2.5-VL model class imports it unconditionally (only its `video-legacy` extra
#   lists it).
# - filelock 3: lmms-eval 0.7.3's evaluator imports `filelock._api`, which filelock 4 no longer has
#   (`ModuleNotFoundError: No module named 'filelock._api'`). This project declares filelock 4 for its soft-lock
#   fallback; it uses only `FileLock` and `Timeout`, which filelock 3 has: installed over the pin (pip warns).
# - PyPI's torchvision is a CUDA build: with CPU torch its import fails (`operator torchvision::nms does not
#   exist`), and lmms-eval's qwen-vl-utils imports it; guarded in this venv only (tests_vllm/patch_torchvision.py).
# The trackers are here rather than in `.venv` because they move two of its packages down (trackio needs
# pillow<13, swanlab protobuf<7): `.venv` stays what `pip install -e .` gives a user.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-integrations}
PYTHON=${PYTHON:-python3}
PIP=(--quiet --disable-pip-version-check)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==2.13.0\ntransformers==5.24.0\naccelerate==1.15.0\n' >"$CONSTRAINTS"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install "${PIP[@]}" "torch==2.13.0"
"$VENV/bin/python" -m pip install "${PIP[@]}" -c "$CONSTRAINTS" "lmms-eval==0.7.3" "decord==0.6.0" -e ".[dev,trackers]"
"$VENV/bin/python" -m pip install "${PIP[@]}" -c "$CONSTRAINTS" "filelock>=3.16,<4"
"$VENV/bin/python" tests_vllm/patch_torchvision.py
"$VENV/bin/python" -c "import lmms_eval.evaluator, qwen_vl_utils, swanlab, trackio, torch, transformers; \
from importlib.metadata import version; print(*(f'{p} {version(p)}' for p in ('lmms-eval', 'swanlab', 'trackio', \
'transformers', 'torch')))"
