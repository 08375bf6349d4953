"""Every rank of a multi-process run watches the others: a rank that stops answering (stopped by SIGSTOP or a
debugger, a frozen host, a deadlock) ends the launch within `rank_stall_timeout` seconds, naming that rank, instead
of leaving the others waiting in their next collective until the process group's timeout (30 minutes).

Why a heartbeat and not a shorter process-group timeout: a collective may wait long for good reasons - the main
process hashes a large model while the others wait in a broadcast, a first step compiles, an evaluation runs - and a
short timeout would end those runs. A thread's heartbeat goes on through any long torch, gloo or hashing call (they
release the GIL); it stops only when its whole process does.

How: each rank's beat thread adds 1 to its counter in the launch's store (the TCPStore at MASTER_ADDR:MASTER_PORT,
which torchrun's agent holds, or else rank 0) every tenth of the timeout (at most 5 s), and reads the other ranks'
counters. A judge thread ends this process (exit 1, the message printed first and handed to torch's error report)
once a peer's counter has not moved, or the store has not answered, for `rank_stall_timeout` seconds of this
process's own monotonic clock: no two hosts' clocks are compared. A store whose host stopped never answers (a
TCPStore read has no timeout), hence the second thread. Time this process itself was held up (suspended together
with its peers, say) counts against no one. The launcher then ends the other workers: torchrun's agent sends them
SIGTERM and, 30 s later, SIGKILL, which ends a stopped process too.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from vision_grpo.run.launched import report_error

logger = logging.getLogger(__name__)

MAX_INTERVAL = 5.0  # seconds between heartbeats, at most
HELD_UP = 3  # judge rounds this process may miss before what it missed counts as no evidence
TRAINING_RESUME = "--resume_from_checkpoint last"  # how a stopped training continues; an evaluation: --resume


def end_this_rank(message: str) -> None:
    """Print `message` first, hand it to torch's report, and end this process at once: its main thread may be
    inside a collective that never returns, so no exception could reach it."""
    report_error(f"RankStalled: {message}")
    sys.stderr.flush()
    os._exit(1)


class RankWatch:
    """This rank's heartbeat in `store` and its judgement of the other ranks' (see the module's docstring).

    `store`: shared by the ranks (a TCPStore client of this rank's own); `store_at` says where it is, for messages;
    `on_stall` gets the message when a rank or the store is overdue (tests record it; by default the process ends);
    `resume` is the flag the message tells the user to continue with.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        store_at: str,
        on_stall: Callable[[str], None] = end_this_rank,
        resume: str = TRAINING_RESUME,
    ) -> None:
        self.store, self.rank, self.timeout, self.store_at, self.on_stall = store, rank, timeout, store_at, on_stall
        self.resume = resume
        self.peers = [peer for peer in range(world_size) if peer != rank]
        self.interval = min(MAX_INTERVAL, timeout / 10)
        now = time.monotonic()
        self.counts: dict[int, int] = {}
        self.moved = dict.fromkeys(self.peers, now)  # when each peer's counter last moved
        self.answered = now  # when the store last answered a whole round
        self.judged = now  # when the judge last looked
        self.who: dict[int, str] = {}  # "pid N on host H", as each peer wrote it
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def start(self) -> RankWatch:
        self.store.set(f"who/{self.rank}", f"pid {os.getpid()} on {socket.gethostname()}")
        for target in (self._beat, self._judge):
            threading.Thread(target=target, name=f"rank-watch{target.__name__}", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop beating and judging (every rank, once they all left their last collective)."""
        self.stopped.set()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.store.add(f"beat/{self.rank}", 1)
                counts = {peer: self.store.add(f"beat/{peer}", 0) for peer in self.peers}  # 0 if it has not beaten
                unnamed = [peer for peer in self.peers if peer not in self.who and self.store.check([f"who/{peer}"])]
                who = {peer: self.store.get(f"who/{peer}").decode() for peer in unnamed}
            except dist.DistError as error:  # the store's host ended: the process group's own error follows
                logger.warning("rank watch: the store at %s is gone (%s); no longer watching", self.store_at, error)
                return
            self.seen(counts, who, time.monotonic())
            self.stopped.wait(self.interval)

    def _judge(self) -> None:
        while not self.stopped.wait(self.interval):
            if message := self.overdue(time.monotonic()):
                self.on_stall(message)
                return

    def seen(self, counts: dict[int, int], who: dict[int, str], now: float) -> None:
        """Record a round of the peers' counters, read at `now`."""
        with self.lock:
            for peer, count in counts.items():
                if self.counts.get(peer) != count:
                    self.counts[peer], self.moved[peer] = count, now
            self.who.update(who)
            self.answered = now

    def overdue(self, now: float) -> str | None:
        """What is overdue at `now` (a message naming the ranks or the store), or None."""
        with self.lock:
            if now - self.judged > HELD_UP * self.interval:  # this process did not run: it saw nothing to judge by
                self.answered, self.moved = now, dict.fromkeys(self.moved, now)
            self.judged = now
            ending = (
                f"ending rank {self.rank} so that the launch ends instead of waiting for it; once every rank can run, "
                f"continue with {self.resume}"
            )
            if now - self.answered > self.timeout:
                return (
                    f"the launch's store at {self.store_at} has not answered for {now - self.answered:.0f} s "
                    f"(rank_stall_timeout: {self.timeout:g} s): its process is stopped or hung; {ending}"
                )
            late = [peer for peer in self.peers if now - self.moved[peer] > self.timeout]
            if not late:
                return None
            named = ", ".join(f"rank {peer} ({self.who.get(peer, 'pid unknown')})" for peer in late)
            return (
                f"{named} has not answered for {now - min(self.moved[peer] for peer in late):.0f} s "
                f"(rank_stall_timeout: {self.timeout:g} s): stopped, hung or gone; {ending}"
            )


def watch_ranks(timeout: float, resume: str = TRAINING_RESUME) -> RankWatch | None:
    """Start watching the other ranks of this launch (training, or with `resume` "--resume" an evaluation); None for
    one process, `timeout` 0 (off), or no store."""
    if timeout <= 0 or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        logger.warning("rank_stall_timeout: no MASTER_ADDR/MASTER_PORT to find the launch's store; ranks not watched")
        return None
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    # One namespace per start of the workers (torchrun restarts them with the same store).
    store = dist.PrefixStore(f"vision_grpo/rank_watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
    holder = "torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    where = f"{host}:{port}, held by {holder}"
    watch = RankWatch(store, dist.get_rank(), dist.get_world_size(), timeout, where, resume=resume)
    return watch.start()
