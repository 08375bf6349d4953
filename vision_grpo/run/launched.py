"""What an entry point needs under a launcher: a worker that never outlives it, and errors named first.

An entry point imports this module first, before anything heavy.

accelerate's plain launcher (`accelerate launch --num_processes 2 --cpu …`, `single_gpu.yaml`) forwards no signal
and dies of a SIGTERM at once; torchrun's agent forwards signals but dies of a SIGKILL without a word. Either way
its worker would run on, an orphan that a scheduler cannot stop, writing into the run folder. Importing this module
asks Linux to send this process SIGTERM when its launcher dies (PR_SET_PDEATHSIG), which stops it: gracefully
(a checkpoint, then exit) once training has begun, at once before.

The request is made on import, and this module imports only the standard library, because the imports that follow
it (torch, transformers, TRL) take seconds: a launcher killed during them must stop the worker too. Only a launcher
that dies during the interpreter's own start-up, before this import, goes unnoticed.

Errors: under a launcher a worker's traceback is followed by the launcher's own (accelerate's, 12 lines) and torch's
elastic report (`ChildFailedError`, 20 lines more), so the message naming the problem ends up in the middle.
`errors_named_first` prints it as the worker's first line and hands it to torch's report (its `error_file`, which
torch shows as the root cause), and drops the traceback of an error our code raised on purpose.

Ending: a worker of a multi-process launch ends through `finish`, which skips the interpreter's finalisation (below).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vision_grpo.storage.writes import DiskFull

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def launched() -> bool:
    """Whether a launcher started this process: torchrun sets LOCAL_RANK, accelerate's plain launcher ACCELERATE_*."""
    return "LOCAL_RANK" in os.environ or any(key.startswith("ACCELERATE_") for key in os.environ)


def stop_with_launcher() -> None:
    """Receive SIGTERM when the launching process dies (Linux, under a launcher; elsewhere nothing)."""
    if not sys.platform.startswith("linux") or not launched():
        return
    launcher = os.getppid()
    die_with_parent()
    if os.getppid() != launcher:  # the launcher died before the request was made: nothing would tell us
        os.kill(os.getpid(), signal.SIGTERM)


def finish() -> None:
    """End a worker of a multi-process launch as the interpreter would (its threads joined, atexit handlers run,
    output flushed), then leave without the interpreter's finalisation; elsewhere nothing.

    On CPU, torch's gloo threads free a finished collective's tensors on their own thread, and that needs the GIL; a
    gloo thread that asks for it once finalisation has begun is ended by the interpreter, through C++ destructors, and
    the process aborts ("terminate called without an active exception": rank 1 of a 2-process ZeRO-3 run, in about 1
    launch of 12 of tests/test_distributed.py's; its core dump shows a gloo thread freeing a barrier's tensors while
    the main thread finalises). Waiting for the other ranks and closing the process group (`RecipeRun.close`) cannot
    prevent it: the last reference to those tensors is the gloo thread's own."""
    if not launched() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging's handlers flushed and closed, and those of the libraries
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def die_with_parent() -> None:
    """Ask Linux for SIGTERM when the parent process dies; kept across `exec`, so a process starting another may
    call it between fork and exec (`subprocess.Popen(preexec_fn=...)`)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# Code of this repository: an error raised here on purpose (a check that failed) needs its message, not its traceback.
REPOSITORY = Path(__file__).resolve().parents[2]
OURS = tuple(f"{REPOSITORY / folder}{os.sep}" for folder in ("vision_grpo", "recipes", "eval"))


@contextmanager
def errors_named_first() -> Iterator[None]:
    """Under a launcher, an error ends this worker with its message as one line (`error: RecipeError: …`), printed
    first and given to torch's elastic report; a check of ours that failed (a ValueError, OSError or RuntimeError
    raised in this repository's code) exits 1 without a traceback, anything else keeps its traceback. Without a
    launcher nothing changes: the traceback ends with the message."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:
        if not launched():
            raise
        report_error(f"{type(error).__name__}: {error}")
        if not raised_on_purpose(error):
            raise
        sys.exit(1)


def report_error(message: str) -> None:
    """Print `message` as one line, `error: <message>`, and hand it to torch's elastic report, which shows it as the
    root cause (`errors_named_first`; vision_grpo/run/rank_watch.py when a rank stalls)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if report := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # set by torch's agent for each worker
        Path(report).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


def raised_on_purpose(error: BaseException) -> bool:
    """Whether `error` is a check of ours that failed: raised by a `raise` in this repository's code."""
    frames = traceback.extract_tb(error.__traceback__)
    where = str(Path(frames[-1].filename).resolve()) if frames else ""
    if isinstance(error, DiskFull):  # a full disk named, wherever it was met (the rows cache is in data/)
        return True
    return isinstance(error, (ValueError, OSError, RuntimeError)) and where.startswith(OURS)


stop_with_launcher()
