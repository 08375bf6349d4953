"""Test-only guard, imported at interpreter start when this folder is on PYTHONPATH (Python's `site` module does).

With `VISION_GRPO_GUARD_LOG` set, it makes every process of a run prove two things, by appending one JSON line per
violation to that file, after an `installed` line per process (the test reads it back; every subprocess inherits
the guard through the environment):

- no network: a connection or name lookup for anything but loopback or a Unix socket is recorded and fails with
  `OSError`, as it would on a machine without network (torch.distributed's gloo talks over loopback: allowed);
- no pickle: every unrestricted unpickling (`pickle.load`, `pickle.loads`, `pickle.Unpickler`, which
  `torch.load(weights_only=False)` and `numpy.load(allow_pickle=True)` use) is recorded. `torch.load(...,
  weights_only=True)` uses torch's own restricted unpickler, which builds tensors and plain containers only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pickle
import socket
import sys
import traceback

LOG = os.environ.get("VISION_GRPO_GUARD_LOG")
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", ""}


def _record(kind: str, detail: str) -> None:
    stack = [f"{frame.filename}:{frame.lineno} {frame.name}" for frame in traceback.extract_stack()[-12:-2]]
    with open(LOG, "a", encoding="utf-8") as file:
        file.write(json.dumps({"kind": kind, "detail": detail, "pid": os.getpid(), "stack": stack}) + "\n")


def _is_loopback(host: object) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    host = str(host).strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _install_network_guard() -> None:
    original_connect, original_connect_ex = socket.socket.connect, socket.socket.connect_ex
    original_getaddrinfo = socket.getaddrinfo

    def allowed(sock: socket.socket, address: object) -> bool:
        if sock.family == getattr(socket, "AF_UNIX", None):
            return True
        return isinstance(address, tuple) and _is_loopback(address[0])

    def refuse(what: str) -> OSError:
        _record("network", what)
        return OSError(101, f"network blocked by the test guard: {what}")

    def connect(self, address):
        if not allowed(self, address):
            raise refuse(f"connect {address!r}")
        return original_connect(self, address)

    def connect_ex(self, address):
        if not allowed(self, address):
            raise refuse(f"connect_ex {address!r}")
        return original_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_loopback(host):
            raise refuse(f"getaddrinfo {host!r}")
        return original_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo


def _install_pickle_guard() -> None:
    original_load, original_loads, original_unpickler = pickle.load, pickle.loads, pickle.Unpickler

    class RecordingUnpickler(original_unpickler):
        def load(self):
            _record("pickle", "pickle.Unpickler.load")
            return super().load()

    def load(*args, **kwargs):
        _record("pickle", "pickle.load")
        return original_load(*args, **kwargs)

    def loads(*args, **kwargs):
        _record("pickle", "pickle.loads")
        return original_loads(*args, **kwargs)

    pickle.load, pickle.loads, pickle.Unpickler = load, loads, RecordingUnpickler


if LOG:
    _install_network_guard()
    _install_pickle_guard()
    _record("installed", " ".join(sys.argv))  # proves to the test that this process ran guarded
