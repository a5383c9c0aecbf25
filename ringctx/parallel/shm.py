"""Shared memory between the ranks of one host: a segment every rank maps, a sequence number per
rank, and a wait that ends with an error naming a dead or stuck peer instead of hanging.

Both users build on it: the decode ranks' all-gather of partials (runtime/shm_exchange.py) and the
tensor-parallel all-reduce (parallel/allreduce.py). A user writes its data into the segment, then
`post(step)` raises its sequence number; `wait(step)` spins until every rank's number has reached
`step`. x86-64 keeps stores in program order as other cores see them (the data before the sequence
number) and loads in program order (the numbers before the data), which is what makes this safe;
elsewhere `shm_supported` says no and the callers keep the process group's collectives.

    segment bytes   [W, 64] int64 words first: rank r's sequence number is word [r, 0], each on
                    its own 64-byte cache line (a rank spinning on one does not slow the writer of
                    another); then the payload, 64-byte aligned, laid out by the user

A rank that dies is noticed at once (its pid is gone: the ranks share the host, checked by their
machine ids); a rank that stops answering ends the wait after `timeout_s`, as a collective would,
with an error naming the rank.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

from .comm import all_gather_ints

SPINS_BEFORE_YIELD = 64
"""Busy checks (about 1 us each) before each yield of the core: the other ranks are usually
microseconds away, and where ranks outnumber free cores the one being waited for needs the core."""

_LINE = 64
"""Bytes of a cache line: each rank's sequence number sits on its own."""


def shm_supported(device: torch.device) -> bool:
    """Shared-memory exchange applies: CPU tensors on x86-64 Linux with /dev/shm."""
    return device.type == "cpu" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


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


def _machine_number() -> int:
    """machine_id() as a non-negative int64 (to compare hosts in one all-gather of ints)."""
    return int.from_bytes(hashlib.blake2b(machine_id().encode(), digest_size=8).digest(), "little") >> 1


class ShmSegment:
    """`payload` bytes every rank of a group maps, plus the ranks' sequence numbers.

    Build it collectively with `ShmSegment.create`, which returns None on every rank (the callers
    then use the process group) when any rank cannot map it, sits on another host, or cannot see the
    others' pids.
    """

    def __init__(self, payload: torch.Tensor, seqs: torch.Tensor, pids: list[int], rank: int, timeout_s: float,
                 what: str):
        self.payload, self.pids, self.rank, self.timeout_s, self.what = payload, pids, rank, timeout_s, what
        self.world = len(pids)
        self._seqs = seqs  # [W, 8] int64; column 0 is the rank's number
        self._seq_view = seqs.numpy()[:, 0]  # numpy reads it in ~1 us where a torch op takes ~5

    @classmethod
    def create(cls, payload_bytes: int, group, timeout_s: float, what: str) -> "ShmSegment | None":
        """A segment of `payload_bytes` (zero-filled) shared by the ranks of `group`; call on every
        rank of the group alike. `what` names the user in errors ("decode merge", "TP all-reduce")."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        name = torch.zeros(36, dtype=torch.uint8)
        if rank == 0:
            name[:] = torch.frombuffer(bytearray(str(uuid.uuid4()).encode()), dtype=torch.uint8)
        dist.broadcast(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        path = f"/dev/shm/ringctx-{bytes(name.tolist()).decode()}"
        head = world * _LINE
        payload_bytes = -(-payload_bytes // _LINE) * _LINE
        try:  # the first rank to open it creates it, zero-filled
            storage = torch.from_file(path, shared=True, size=head + payload_bytes, dtype=torch.uint8)
        except Exception:  # no /dev/shm room, say: every rank then uses the process group
            storage = None
        opened = all_gather_ints([os.getpid(), int(storage is not None), _machine_number()], group, world)
        if rank == 0 and os.path.exists(path):
            os.unlink(path)  # every rank has tried to open it: the name can go, the mappings stay
        pids = [pid for pid, _, _ in opened]
        one_host = len({host for _, _, host in opened}) == 1
        # A pid we cannot see lives in another pid namespace: a dead rank would go unnoticed there.
        mine = (storage is not None and one_host and all(ok for _, ok, _ in opened)
                and all(process_state(p) != "dead" for p in pids))
        if not all(ok for (ok,) in all_gather_ints([int(mine)], group, world)):  # one answer for all
            return None
        seqs = storage[:head].view(torch.int64).view(world, _LINE // 8)
        return cls(storage[head:], seqs, pids, rank, timeout_s, what)

    def post(self, step: int) -> None:
        """Tell the others this rank has reached `step` (after its writes: x86 keeps them in order)."""
        self._seq_view[self.rank] = step

    def wait(self, step: int) -> None:
        """Spin until every rank has posted `step`; a dead peer or `timeout_s` without progress
        raises a RuntimeError naming the rank."""
        seqs = self._seq_view
        if seqs.min() >= step:
            return
        spins, deadline = 0, None
        while seqs.min() < step:
            spins += 1
            if spins % SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            late = [r for r in range(self.world) if int(seqs[r]) < step]
            gone = [r for r in late if process_state(self.pids[r]) == "dead"]
            if gone:
                raise RuntimeError(f"{self.what}: peer rank {gone[0]} (pid {self.pids[gone[0]]}) is gone: "
                                   "connection closed")
            if now > deadline:
                raise RuntimeError(f"{self.what} timed out after {self.timeout_s:g} s waiting for rank(s) "
                                   f"{', '.join(map(str, late))}")
