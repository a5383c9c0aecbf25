"""How a multi-rank job fails: one clear message naming the rank, never a hang or a wrong answer.

    RankFailure            a rank died, stopped answering, or never joined; the Engine is closed
    ProcessWatch           spawn mode: rank 0 watches its worker processes (exit codes, reports)
    Health                 torchrun / SPMD mode: per-rank heartbeats in the job's store, and the
                           diagnosis that names the lost rank after a collective fails
    kill_point             the RINGCTX_TEST_KILL test hook (see below)

Test hook (for tests only, never set it in production): RINGCTX_TEST_KILL="<rank>:<point>[,...]"
makes that rank SIGKILL itself at <point>: "join" (a spawned worker, before it joins the group),
"chunk<N>" (right after chunk N of a prefill, 1-based) or "decode<N>" (before decode step N over a
split KV cache). It is how tests kill a rank mid-prefill
deterministically; tests/runtime/test_failures.py and tests/multihost/ use it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import threading
import time

import torch.distributed as dist

from ..parallel.launch import describe_exit
from ..parallel.shm import machine_id, process_state  # parallel/ holds them: the TP all-reduce needs them too

TEST_KILL_ENV = "RINGCTX_TEST_KILL"

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats of a rank (torchrun / SPMD mode); longer in big jobs, so that
the store sees at most HEARTBEATS_PER_S writes a second."""

HEARTBEATS_PER_S = 500

_COMM_ERROR_MARKERS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
                       "gloo", "nccl", "processgroup", "socket", "peer", "distbackend", "store")


CLOSED = "; the engine is closed (create a new Engine)"


class RankFailure(RuntimeError):
    """A rank of the job died, stopped answering within the timeout, or never joined the group.

    The Engine that raised it is closed (its process group cannot be trusted any more): create a
    new one. `lost_ranks` lists the ranks found dead or silent (empty when none could be named).
    """

    def __init__(self, message: str, lost_ranks=()):
        super().__init__(message)
        self.lost_ranks = tuple(lost_ranks)


def looks_like_comm_error(exc: BaseException) -> bool:
    """Whether `exc` came out of torch.distributed (gloo/NCCL/store), not out of our own code."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, (RuntimeError, OSError, TimeoutError)) and any(m in text for m in _COMM_ERROR_MARKERS)


def first_line(exc: BaseException, limit: int = 160) -> str:
    """The gist of an error: its first line, without gloo's source location and boilerplate."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(". This is typically caused", 1)[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ----------------------------------------------------------------------------- test hook


def hook_point(env: str, rank: int) -> str | None:
    """The point a tests-only variable ("<rank>:<point>,...", e.g. RINGCTX_TEST_KILL) names for this
    rank (None: none)."""
    spec = os.environ.get(env, "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        who, _, point = item.partition(":")
        if who.strip() == str(rank):
            return point.strip()
    return None


def kill_point(rank: int) -> str | None:
    """The point at which RINGCTX_TEST_KILL asks this rank to die (None: never)."""
    return hook_point(TEST_KILL_ENV, rank)


def maybe_die(rank: int, point: str) -> None:
    """SIGKILL this process if RINGCTX_TEST_KILL names this rank and point (tests only)."""
    if kill_point(rank) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def with_test_hook(on_chunk, rank: int):
    """`on_chunk` wrapped so that RINGCTX_TEST_KILL="<rank>:chunk<N>" kills this rank after chunk N."""
    point = kill_point(rank)
    if not point or not point.startswith("chunk"):
        return on_chunk

    def hooked(done, total, record):
        if on_chunk is not None:
            on_chunk(done, total, record)
        maybe_die(rank, f"chunk{done}")

    return hooked


# ----------------------------------------------------------------------------- spawn mode


def settled_exitcode(proc, wait_s: float = 2.0) -> int | None:
    """The exit code of a process known to have exited. The watch thread and rank 0's own thread
    both poll the same Process, and the one whose waitpid loses the race to reap it reads None for
    a moment (multiprocessing swallows the ECHILD), so wait until the code is in."""
    deadline = time.monotonic() + wait_s
    proc.join(timeout=wait_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.exitcode


class ProcessWatch:
    """Rank 0's watch over its spawned workers: the first one to die is recorded (with the error
    it reported, if any) and the others are killed at once, so that a collective rank 0 waits in
    fails within moments instead of at the timeout."""

    def __init__(self, procs: list, conns: list):
        self.procs, self.conns = procs, conns  # procs[i] is rank i + 1
        self.first_death: tuple[int, int | None] | None = None
        self.reports: dict[int, str] = {}
        self._stop_r, self._stop_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ringctx-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        while not self._stopping:
            ready = wait(list(sentinels) + [self._stop_r])
            if self._stopping or self._stop_r in ready:
                return
            dead = [sentinels[s] for s in ready if s in sentinels]
            if not dead:
                continue
            code = settled_exitcode(self.procs[dead[0] - 1])
            self.collect_reports()
            if self.first_death is None:
                self.first_death = (dead[0], code)
            for p in self.procs:  # the group is broken: end the others so that rank 0 is released
                if p.is_alive():
                    p.kill()
            return

    def collect_reports(self) -> None:
        """Read the error reports workers sent before exiting (non-blocking)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll():
                    kind, *payload = conn.recv()
                    if kind == "error" and rank not in self.reports:
                        self.reports[rank] = payload[0]
            except (EOFError, OSError):
                continue

    def wait_for_death(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.first_death is None and time.monotonic() < deadline:
            if any(not p.is_alive() for p in self.procs):
                time.sleep(0.05)  # let the watch thread record it
                if self.first_death is None:
                    dead = [r for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
                    self.first_death = (dead[0], settled_exitcode(self.procs[dead[0] - 1]))
                break
            time.sleep(0.05)

    def stop(self) -> None:
        self._stopping = True
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for fd in (self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def diagnose(self, exc: BaseException, during: str, world: int, timeout_s: float) -> RankFailure | None:
        """The RankFailure to raise on rank 0 after `exc` interrupted `during` (None: not a rank failure)."""
        self.wait_for_death(2.0)
        self.collect_reports()
        if self.first_death is not None:
            rank, code = self.first_death
            what = f"rank {rank} of {world} {describe_exit(code)} during {during}"
            if rank in self.reports:
                what += f" after reporting: {self.reports[rank]}"
            return RankFailure(what + CLOSED, [rank])
        if self.reports:
            rank = min(self.reports)
            return RankFailure(f"rank {rank} of {world} failed during {during}: {self.reports[rank]}{CLOSED}",
                               [rank])
        if not looks_like_comm_error(exc):
            return None
        states = {r: process_state(p.pid) for r, p in enumerate(self.procs, start=1)}
        silent = [r for r, s in states.items() if s != "alive"]
        who = ", ".join(f"rank {r} (pid {self.procs[r - 1].pid}) is {states[r]}" for r in silent) or \
            "every rank is still running (one is stuck or much slower)"
        return RankFailure(f"{during} did not complete within the {timeout_s:g} s timeout: {who} (raise --timeout "
                           f"/ timeout_s if the job is just slow) [{first_line(exc)}]{CLOSED}", silent)


# ----------------------------------------------------------------------------- torchrun / SPMD mode


class Health:
    """This rank's heartbeat in the job's store, and the diagnosis of a failed collective.

    Every rank publishes where it runs (host, pid, local rank) once and bumps a counter every
    `interval` seconds from a daemon thread. After a collective fails, `diagnose` names the
    ranks that are gone: on this machine by their process state, elsewhere by a heartbeat that
    stopped moving.
    """

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.peers: dict[int, dict] = {}
        self.interval = max(HEARTBEAT_S, world / HEARTBEATS_PER_S)
        self.store = _private_store()
        self._stop = threading.Event()
        self._thread = None
        if self.store is None:
            return
        self.where = {"host": socket.gethostname(), "pid": os.getpid(), "machine": machine_id(),
                      "local_rank": int(os.environ.get("LOCAL_RANK", rank))}
        try:
            self.store.set(f"where/{rank}", json.dumps(self.where))
            self.store.set(f"beat/{rank}", "0")
        except Exception:  # a store that refuses us: run without heartbeats
            self.store = None
            return
        self._thread = threading.Thread(target=self._beat, name="ringctx-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.interval):
            count += 1
            try:
                self.store.set(f"beat/{self.rank}", str(count))
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def learn_peers(self) -> None:
        """Read every rank's place once (call after a collective every rank reached after __init__),
        so that a diagnosis can check local peers even when the store is gone."""
        if self.store is None:
            return
        for r in range(self.world):
            if r in self.peers:
                continue
            text = self._read(f"where/{r}")
            if text is _STORE_DOWN:
                return
            if isinstance(text, str):
                self.peers[r] = json.loads(text)

    def _read(self, key: str):
        """The key's value, None when it is not set, or _STORE_DOWN when the store cannot be reached."""
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except Exception:
            return _STORE_DOWN

    def describe(self, rank: int) -> str:
        where = self.peers.get(rank)
        if not where:
            return f"rank {rank}"
        return f"rank {rank} (local rank {where['local_rank']} on host {where['host']}, pid {where['pid']})"

    def diagnose(self, exc: BaseException, during: str) -> RankFailure | None:
        """Name the lost ranks after `exc` interrupted `during` on this rank (None: not a rank failure)."""
        me = f"rank {self.rank} of {self.world}"
        gist = first_line(exc)
        if self.store is None:
            if not looks_like_comm_error(exc):
                return None
            return RankFailure(f"{me}: {during} failed, another rank is gone or stuck [{gist}]")
        if len(self.peers) < self.world:  # failed before learn_peers (start-up): try now
            self.learn_peers()
        others = [r for r in range(self.world) if r != self.rank]
        lost: dict[int, str] = {}
        remote = []
        for r in others:  # peers on this machine: their process state says it all
            w = self.peers.get(r)
            if w is not None and w["machine"] == self.where["machine"]:
                state = process_state(w["pid"])
                if state != "alive":
                    lost[r] = "died" if state == "dead" else "is stopped"
            else:
                remote.append(r)
        store_down = False
        if remote and not lost:  # peers elsewhere: a heartbeat that no longer moves
            before = {r: self._read(f"beat/{r}") for r in remote}
            store_down = _STORE_DOWN in before.values()
            if not store_down:
                time.sleep(3 * self.interval + 0.2)
                after = {r: self._read(f"beat/{r}") for r in remote}
                store_down = _STORE_DOWN in after.values()
                if not store_down:
                    for r in remote:
                        if after[r] is None or after[r] == before[r]:
                            lost[r] = "stopped responding (its heartbeat stopped: the process or its host is gone)"
        if store_down and not lost:
            home = self.peers.get(0, {}).get("machine")
            gone = [r for r in remote if home is not None and self.peers.get(r, {}).get("machine") == home] or [0]
            return RankFailure(f"{me} stops: {during} lost the host of rank 0: the job's store, which its launcher "
                               f"runs, is unreachable, so rank(s) {', '.join(map(str, gone))} there are gone [{gist}]",
                               gone)
        if lost:
            parts = [f"{self.describe(r)} {how}" for r, how in sorted(lost.items())]
            return RankFailure(f"{me} stops: {during} lost {'; '.join(parts)} [{gist}]", sorted(lost))
        if not looks_like_comm_error(exc):
            return None
        return RankFailure(f"{me}: {during} did not complete within the {self.timeout_s:g} s timeout while every "
                           f"rank is still running (one is stuck or much slower; raise --timeout if the job is "
                           f"just slow) [{gist}]")


_STORE_DOWN = object()


def _private_store():
    """A separate client of the job's store (its own connection), under a ringctx prefix."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    try:
        base = base.clone()
    except Exception:
        pass
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        base.set_timeout(datetime.timedelta(seconds=10))
    except Exception:
        pass
    return dist.PrefixStore(f"ringctx/health/{run}/", base)
