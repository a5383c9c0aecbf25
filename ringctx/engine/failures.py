"""How a multi-rank job fails: one clear message naming the rank, never a hang or a wrong answer.

    RankFailure            a rank died, stopped answering, or never joined; the Engine is closed
    ProcessWatch           spawn mode: rank 0 watches its worker processes (exit codes, reports)
    Health                 torchrun / SPMD mode: per-rank heartbeats in the job's store, and the
                           diagnosis that names the lost rank after a collective fails
    memory_problem         the planner's memory estimate against the memory really available
    kill_point             the RINGCTX_TEST_KILL test hook (see below)

Test hook (for tests only, never set it in production): RINGCTX_TEST_KILL="<rank>:<point>[,...]"
makes that rank SIGKILL itself at <point>: "join" (a spawned worker, before it joins the group),
"chunk<N>" (right after chunk N of a prefill, 1-based) or "decode<N>" (before decode step N over a
split KV cache). It is how tests kill a rank mid-prefill
deterministically; tests/engine/test_failures.py and tests/multihost/ use it.
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

import torch
import torch.distributed as dist

from ..parallel.launch import describe_exit
from ..units import fmt_bytes

TEST_KILL_ENV = "RINGCTX_TEST_KILL"
MEMORY_LIMIT_ENV = "RINGCTX_MEMORY_LIMIT"
MEMORY_CHECK_ENV = "RINGCTX_MEMORY_CHECK"

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


def process_state(pid: int) -> str:
    """'alive', 'stopped' (SIGSTOP / traced) or 'dead' (gone or a zombie) for a local pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "dead"
    except OSError:
        return "alive"
    return {"Z": "dead", "X": "dead", "T": "stopped", "t": "stopped"}.get(state, "alive")


def machine_id() -> str:
    """Identifies this host: boot id and network namespace (emulated hosts share one kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}/{netns}"


# ----------------------------------------------------------------------------- test hook


def kill_point(rank: int) -> str | None:
    """The point at which RINGCTX_TEST_KILL asks this rank to die (None: never)."""
    spec = os.environ.get(TEST_KILL_ENV, "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        who, _, point = item.partition(":")
        if who.strip() == str(rank):
            return point.strip()
    return None


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


# ----------------------------------------------------------------------------- memory


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
             "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    try:
        return int(float(number) * units[s[len(number):]])
    except (KeyError, ValueError):
        raise ValueError(f"{MEMORY_LIMIT_ENV}={text!r}: not a size; write e.g. 512MiB, 16GiB or a number of bytes") \
            from None


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free for this rank's tensors, where): the GPU's free memory or the host's available RAM,
    capped by RINGCTX_MEMORY_LIMIT when set."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"GPU {device.index if device.index is not None else torch.cuda.current_device()}"
    else:
        import psutil

        free, where = psutil.virtual_memory().available, f"host {socket.gethostname()}"
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit:
        free = min(free, parse_bytes(limit))
        where += f" ({MEMORY_LIMIT_ENV}={limit})"
    return int(free), where


def prefill_memory_need(cfg, dtype_name: str, world: int, tokens: int, cached: int, chunk: int, *,
                        decode_room: int, local_ranks: int, decode_here: bool, decode_ranks: int = 1,
                        kv_dtype: str = "model") -> dict:
    """Bytes a prefill adds on this rank's device (host RAM on CPU: all its local ranks), by part.

    From the planner's formulas: the KV shard (kv_cache_bytes_per_rank over the rows this rank
    ends with, stored in kv_dtype), the one-layer working set of a chunk (activation_bytes_per_rank,
    the larger of pass-KV and pass-Q), and what the hand-off adds on the decode host: with one
    decode rank the whole decode KV cache, with several the rows the other ranks send them plus
    each decode rank's room. Weights are already loaded and not counted again.
    """
    from ..planning.memory import activation_bytes_per_rank, kv_cache_bytes_per_rank, kv_row_bytes
    from ..planning.strategy import STRATEGIES, cached_rows_per_rank, tokens_per_rank

    chunk = max(1, min(chunk, tokens))
    full, rest = divmod(tokens, chunk)
    rows = cached_rows_per_rank(cached, world) + full * tokens_per_rank(chunk, world) + \
        (tokens_per_rank(rest, world) if rest else 0)
    shard = kv_cache_bytes_per_rank(cfg, rows, 1, dtype_name, kv_dtype)
    activations = max(activation_bytes_per_rank(cfg, world, 1, chunk, rows, s, dtype_name) for s in STRATEGIES)
    per_token = kv_row_bytes(cfg, 1, dtype_name, kv_dtype)
    if decode_ranks == 1:
        decode_cache = per_token * (cached + tokens + decode_room)
    else:  # decode ranks keep their shards: only the other ranks' rows arrive, and the room
        moved = (cached + tokens) * max(0, world - decode_ranks) // world
        decode_cache = per_token * (moved + decode_room * decode_ranks)
    per_rank = shard + activations + 16 * tokens  # + the token ids
    total = per_rank * local_ranks + (decode_cache if decode_here else 0)
    return {"shard": shard, "activations": activations, "decode_cache": decode_cache if decode_here else 0,
            "per_rank": per_rank, "total": total, "local_ranks": local_ranks}


def _element_bytes(dtype_name: str) -> int:
    from ..planning.hardware import element_bytes

    return element_bytes(dtype_name)


def memory_problem(model, tokens: int, cached: int, chunk: int, world: int, rank: int, decode_rank: int,
                   decode_room: int, *, local_ranks: int = 1, local_decode: bool | None = None,
                   decode_ranks: int = 1, kv_dtype: str = "model") -> str | None:
    """A one-line problem when the prefill would not fit the memory available to this rank, else None.

    On CPU the ranks of one host share its RAM: `local_ranks` of them, and what the hand-off
    brings to the decode ranks when `local_decode` (default: this is the decode rank). Every fix
    it suggests is checked to fit. Set RINGCTX_MEMORY_CHECK=0 to
    skip the check, RINGCTX_MEMORY_LIMIT=<size> to cap the memory it assumes available.
    """
    if os.environ.get(MEMORY_CHECK_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if tokens < 1 or chunk < 1 or model.device.type == "meta":
        return None
    from ..planning.memory import MEMORY_USABLE_FRACTION

    cfg = model.config
    dtype_name = str(model.dtype).removeprefix("torch.")
    on_gpu = model.device.type == "cuda"
    local_ranks = 1 if on_gpu else max(1, local_ranks)
    decode_here = (rank == decode_rank) if (local_decode is None or on_gpu) else local_decode

    weight_bytes = cfg.n_params * _element_bytes(dtype_name)

    def need_at(n_world: int, n_chunk: int, dtype: str = dtype_name, kv: str = kv_dtype, n_tokens: int = tokens,
                n_local: int = local_ranks) -> int:
        """The need with some settings changed; n_local > local_ranks: more ranks on this CPU host,
        each with its own copy of the weights and, when every local rank decodes, its decode slice."""
        n_decode = decode_ranks * n_local // local_ranks if decode_ranks == local_ranks else decode_ranks
        extra_weights = (n_local - local_ranks) * weight_bytes * _element_bytes(dtype) // _element_bytes(dtype_name)
        return extra_weights + prefill_memory_need(
            cfg, dtype, n_world * n_local // local_ranks, n_tokens, cached, n_chunk, decode_room=decode_room,
            local_ranks=n_local, decode_here=decode_here, decode_ranks=n_decode, kv_dtype=kv)["total"]

    try:
        free, where = available_memory(model.device)
    except ValueError as exc:
        return str(exc)
    usable = int(free * MEMORY_USABLE_FRACTION)
    need = prefill_memory_need(cfg, dtype_name, world, tokens, cached, chunk, decode_room=decode_room,
                               local_ranks=local_ranks, decode_here=decode_here, decode_ranks=decode_ranks,
                               kv_dtype=kv_dtype)
    if need["total"] <= usable:
        return None
    parts = f"KV shard {fmt_bytes(need['shard'])} + chunk working set {fmt_bytes(need['activations'])} per rank"
    if local_ranks > 1:
        parts += f", x {local_ranks} ranks on this host"
    if need["decode_cache"]:
        parts += (f", + the decode rank's KV cache {fmt_bytes(need['decode_cache'])}" if decode_ranks == 1 else
                  f", + what the hand-off brings the {decode_ranks} decode ranks {fmt_bytes(need['decode_cache'])}")
    header = (f"not enough memory for a prefill of {tokens:,} tokens on {world} rank(s): it needs about "
              f"{fmt_bytes(need['total'])} ({parts}) but {where} has {fmt_bytes(free)} available "
              f"({fmt_bytes(usable)} usable)")
    more_local = [n for n in (2 * local_ranks, 4 * local_ranks) if n <= (os.cpu_count() or 1)] \
        if not on_gpu and world == local_ranks else []  # one CPU host: its cores could run more ranks
    return f"{header}; {_memory_fixes(need_at, usable, world, chunk, dtype_name, kv_dtype, tokens, cached, more_local)}"


# 8-bit KV storage is the smallest ringctx has; a chunk below this many tokens only adds ring steps.
_SMALLEST_KV, _SMALLEST_CHUNK = "fp8", 256


def _memory_fixes(need_at, usable: int, world: int, chunk: int, dtype: str, kv_dtype: str, tokens: int,
                  cached: int, more_local: list[int]) -> str:
    """What to change so that the prefill fits: the fewest settings of this host that do (smaller
    chunks, bf16, an 8-bit KV cache, more ranks on this CPU host), else more ranks over more hosts;
    when nothing on this host fits, say so and give the longest prompt that does. Every suggestion
    is checked with the same memory model (need_at)."""
    import itertools

    options: list[list[tuple[str, dict]]] = []  # per setting, its choices: (flag, need_at changes)
    if dtype == "float32":
        options.append([("--dtype bfloat16", {"dtype": "bfloat16"})])
    if kv_dtype not in ("fp8", "int8"):
        options.append([(f"--kv-dtype {_SMALLEST_KV}", {"kv": _SMALLEST_KV})])
    if more_local:
        options.append([(f"--nproc {n}", {"n_local": n}) for n in more_local])
    chunks = [chunk // 2 ** i for i in range(1, 8) if chunk // 2 ** i >= _SMALLEST_CHUNK]

    def fitting(changes: dict) -> str | None:
        """The flags that fit with `changes` (and the largest chunk that then fits), or None."""
        for n_chunk in [chunk, *chunks]:
            if need_at(**{"n_world": world, "n_chunk": n_chunk, **changes}) <= usable:
                return "" if n_chunk == chunk else f"--chunk-tokens {n_chunk}"
        return None

    for count in range(len(options) + 1):  # the fewest settings first
        for group in itertools.combinations(options, count):
            for combo in itertools.product(*group):
                changes = {k: v for _, change in combo for k, v in change.items()}
                chunk_flag = fitting(changes)
                if chunk_flag is not None and (combo or chunk_flag):
                    return "use " + " ".join([flag for flag, _ in combo] + ([chunk_flag] if chunk_flag else []))
    hosts = next((f for f in (2, 4, 8, 16, 32, 64, 128) if need_at(world * f, chunk) <= usable), None)
    if hosts:
        return f"use about {world * hosts} ranks in all over more hosts or GPUs (see `ringctx plan`)"
    # Nothing fits: the longest prompt that does, every setting at its smallest (more local ranks
    # only where they let a longer prompt fit: each brings its own copy of the weights).
    least = {"n_world": world, "n_chunk": min([chunk, *chunks])}
    flags = []
    for setting in options:
        flag, change = setting[-1]
        if "n_local" not in change:
            least.update(change)
            flags.append(flag)

    def longest_at(settings: dict) -> int:
        return _longest_prompt(lambda n: need_at(**settings, n_tokens=n) <= usable, tokens)

    longest, best_local = longest_at(least), None
    for n_local in more_local:
        if (n := longest_at({**least, "n_local": n_local})) > longest:
            longest, best_local = n, n_local
    if best_local:
        flags.append(f"--nproc {best_local}")
    flags.append(f"--chunk-tokens {least['n_chunk']}")
    fits = (f"the longest prompt that fits here is about {longest + cached:,} tokens, with {' '.join(flags)}"
            if longest else "not even a short prompt fits here")
    return (f"no setting of this host fits {tokens + cached:,} tokens ({fits}); use more ranks over more hosts "
            "or GPUs (see `ringctx plan`)")


def _longest_prompt(fits, tokens: int) -> int:
    """The largest n < tokens with fits(n) (0 if none): fits is monotone in n."""
    low, high = 0, tokens
    while high - low > max(1, tokens // 1000):
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
