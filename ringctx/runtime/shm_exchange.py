"""All-gather of small tensors between the ranks of one host through shared memory.

Why: a decode step over a KV cache split across the decode ranks merges every rank's partial
attention once per layer (runtime/decode.py). The decode ranks are always on one host, and on CPUs
gloo's all-gather of those few KiB took 0.2 ms on an idle 2-core machine and about 1.5 ms while the
other rank computed (TCP loopback and wake-ups): 30-45 ms a token for SmolLM2's 30 layers, a third
of the step at 128K tokens. Here each rank writes its tensor into its slot of a shared buffer and
raises its sequence number; the others spin until every sequence number has reached the step.

    slots [2, N, F] float32     two buffers used in turn: a rank can run at most one exchange ahead
                                (it waits for everyone's next write, which each writes only after
                                reading this one), so the buffer it writes is never still being read
    seqs  [N] int64             the last exchange each rank has written

x86-64 keeps stores in program order as other cores see them (data before the sequence number),
which is what makes this safe; elsewhere, and on GPUs (NCCL is fast there), the engine keeps the
process group's all-gather. A rank that dies is noticed at once (its pid is gone: the ranks share
the host); a rank that stops answering ends the wait after `timeout_s`, as a collective would, with
an error naming the rank.
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch
import torch.distributed as dist

from ..parallel.comm import all_gather_ints
from .failures import process_state

SPINS_BEFORE_YIELD = 2000
"""Busy checks before each yield of the core: the other ranks are usually microseconds away."""


def shm_supported(device: torch.device) -> bool:
    """Shared-memory exchange applies: CPU tensors on x86-64 Linux with /dev/shm."""
    return device.type == "cpu" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmExchange:
    """exchange(t [F] float32) -> [N, F]: every rank's t, in rank order (call on every rank alike).

    Build it collectively with `ShmExchange.create`, which returns None (and every rank falls back
    to the process group) when any rank cannot open the shared buffer or see the others' pids.
    """

    def __init__(self, slots: torch.Tensor, seqs: torch.Tensor, pids: list[int], rank: int, timeout_s: float):
        self.slots, self.seqs, self.pids, self.rank, self.timeout_s = slots, seqs, pids, rank, timeout_s
        self.step = 0

    @classmethod
    def create(cls, floats: int, group, timeout_s: float) -> "ShmExchange | None":
        """A shared buffer for `floats` floats per rank among the ranks of `group` (all on this host)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        name = torch.zeros(36, dtype=torch.uint8)
        if rank == 0:
            name[:] = torch.frombuffer(bytearray(str(uuid.uuid4()).encode()), dtype=torch.uint8)
        dist.broadcast(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        path = f"/dev/shm/ringctx-{bytes(name.tolist()).decode()}"
        size = 2 * world * floats + 2 * world  # the slots, then the seqs (int64: two float32 words each)
        try:  # the first rank to open it creates it, zero-filled
            storage = torch.from_file(path, shared=True, size=size, dtype=torch.float32)
        except Exception:  # no /dev/shm room, say: every rank then uses the process group
            storage = None
        opened = all_gather_ints([os.getpid(), int(storage is not None)], group, world)
        if rank == 0 and os.path.exists(path):
            os.unlink(path)  # every rank has tried to open it: the name can go, the mappings stay
        pids = [pid for pid, _ in opened]
        # A pid we cannot see lives in another pid namespace: a dead rank would go unnoticed there.
        mine = storage is not None and all(ok for _, ok in opened) and all(process_state(p) != "dead" for p in pids)
        if not all(ok for (ok,) in all_gather_ints([int(mine)], group, world)):  # one answer for all
            return None
        slots = storage[:2 * world * floats].view(2, world, floats)
        seqs = storage.view(torch.int64)[-world:]
        return cls(slots, seqs, pids, rank, timeout_s)

    def exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t [F'] (F' <= F, the same on every rank: a batch of a varying size) as a
        [N, F'] view of the shared buffer (valid until the next exchange but one: copy what must
        outlive it)."""
        self.step += 1
        n = t.numel()
        buffer = self.slots[self.step % 2, :, :n]
        buffer[self.rank].copy_(t)
        self.seqs[self.rank] = self.step  # after the data: x86 keeps the two stores in this order
        self._wait()
        return buffer

    def _wait(self) -> None:
        spins, deadline = 0, None
        while bool((self.seqs < self.step).any()):
            spins += 1
            if spins % SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            late = [r for r in range(len(self.pids)) if int(self.seqs[r]) < self.step]
            gone = [r for r in late if process_state(self.pids[r]) == "dead"]
            if gone:
                raise RuntimeError(f"decode merge: peer rank {gone[0]} (pid {self.pids[gone[0]]}) is gone: connection "
                                   "closed")
            if now > deadline:
                raise RuntimeError(f"decode merge timed out after {self.timeout_s:g} s waiting for rank(s) "
                                   f"{', '.join(map(str, late))}")
