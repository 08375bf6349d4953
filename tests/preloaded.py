"""Run an entry point in a fresh process that starts with torch, transformers, TRL, peft and datasets already imported.

Importing those libraries costs each `python recipes/train.py ...` several CPU seconds before our code runs, and
the suite starts well over a hundred such processes on a 2-core machine. The standard library's forkserver imports
them once per test worker and forks a new child for every command: each command still runs in its own process,
from its own argv, environment and working folder, through `runpy` exactly as `python <script>` / `python -m` would
run it — only the imports are inherited. Our own packages are never preloaded, so every command imports the code
under test itself.

What a fork cannot give is a library that reads an environment variable while it is imported: `run` therefore
falls back to a fresh interpreter whenever a variable that such libraries read (`HF_*`, `PYTHON*`, `TORCH_*`, ...)
differs from the server's. Tests of interpreter start-up itself (the offline guard's `sitecustomize`) set
`PYTHONPATH` and so always get a fresh interpreter.

The server imports `PRELOAD` by module name from site-packages: Python 3.11's forkserver ignores the parent's
`sys.path` and silently skips a module it cannot import, so a preload module kept in tests/ was never imported and
every command imported the libraries itself. tests/test_preloaded.py checks that a command starts with them.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# Read when the preloaded libraries are imported (DeepSpeed picks its accelerator then): a command whose value differs
# needs its own interpreter.
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "DATASETS",
    "TORCH",
    "PYTHON",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "CUDA",
    "DS_",
)
# What the entry points import, never our own code. Beyond the core stack: accelerate imports DeepSpeed in every
# trainer when it is installed (`extract_model_from_parallel`), our callbacks import TensorBoard's hparams protos, the
# VQA rewards `math_verify`, and every run loads one family's model, processor and tokenizer modules.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.processing_auto",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen2_5_vl.processing_qwen2_5_vl",
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5.tokenization_qwen3_5",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "transformers.models.qwen3_vl.processing_qwen3_vl",
    "accelerate",
    "datasets",
    "deepspeed",
    "peft",
    "trl.trainer.grpo_trainer",
    "trl.trainer.sft_trainer",
    "trl.scripts.utils",
    "math_verify",
    "tensorboard.plugins.hparams.summary_v2",
    "torch.utils.tensorboard",
    "PIL.ImageDraw",
)
_context: multiprocessing.context.ForkServerContext | None = None
_server_env: dict[str, str] = {}


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME_PREFIXES)}


def _server() -> multiprocessing.context.ForkServerContext:
    global _context, _server_env
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
        _server_env = _import_time_env(dict(os.environ))
    return _context


def _child(args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str, sys_path: list[str]) -> None:
    """In the forked child: become `python <args>` and exit with its status (after its atexit handlers)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115
    code = 0
    try:
        if args[0] == "-m":
            sys.argv, sys.path[:] = [args[1], *args[2:]], [cwd, *sys_path]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(cwd, args[0]).resolve())
            sys.argv, sys.path[:] = [args[0], *args[1:]], [str(Path(script).parent), *sys_path]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, which would skip them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fresh_sys_path() -> list[str]:
    """What `sys.path` holds after the script's own folder in a fresh interpreter (no tests/ folder, no '')."""
    tests = str(Path(__file__).resolve().parent)
    return [entry for entry in sys.path if entry and not entry.startswith(tests)]


def _fresh(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python <args>` in `cwd` with `env`: a fork of the preloaded server when its imports fit `env`, else a fresh
    interpreter (also for interpreter flags such as `-c` or `-u`, and with `VISION_GRPO_TEST_FRESH_INTERPRETERS=1`)."""
    if env.get("VISION_GRPO_TEST_FRESH_INTERPRETERS") or (args[0].startswith("-") and args[0] != "-m"):
        return _fresh(args, cwd, env, timeout)
    context = _server()
    if _import_time_env(env) != _server_env:
        return _fresh(args, cwd, env, timeout)
    with tempfile.TemporaryDirectory(prefix="vision-grpo-run-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        child = context.Process(target=_child, args=(args, env, str(cwd), str(out), str(err), _fresh_sys_path()))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        return subprocess.CompletedProcess(
            [sys.executable, *args],
            child.exitcode,
            out.read_text(encoding="utf-8", errors="backslashreplace"),
            err.read_text(encoding="utf-8", errors="backslashreplace"),
        )
