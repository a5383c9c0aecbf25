"""The tensor-parallel all-reduce, its algorithm chosen by message size.

A TP group sums the row-parallel partial outputs twice per layer (model/tensor_parallel.py): a few
KiB per decode step, megabytes per prefill chunk. The ranks of a TP group share one host, so,
as the system ringctx follows does, every rank reads the others' buffers directly:

    one-shot   every rank writes x into its slot; once all have, every rank sums all N slots
               (in rank order) into its x. One wait; each rank reads N x.
    two-shot   every rank writes x into its slot; once all have, rank r sums segment r (1/N of x)
               of all N slots in rank order and writes the sum back over segment r of its own
               slot (nobody else reads that part of it); once all have, every rank copies segment j
               from slot j. Two waits; each rank reads about 2 x: a reduce-scatter, then an
               all-gather.

Both add the same values in the same order (rank 0's, then rank 1's, ...), so every rank ends with
the same bits, whichever algorithm ran. float32 and float64 add in their own dtype, as gloo does;
bfloat16 and float16 accumulate in float32 and round once at the end (gloo rounds after every
addition, so with 3+ ranks its result can differ from this one by the rounding of the partial
sums; this one is the more exact). Other dtypes take the process group's all_reduce. On CUDA the
sum is PyTorch's symmetric-memory kernels' (scripts/gpu_check.py checks that every rank gets the
same bits and the error against float64).

    CPU ranks of one host   `ShmAllReduce`: shared memory (parallel/shm.py), one-shot below
                            `CPU_TWO_SHOT_FROM[N]` bytes, two-shot from there; a message larger
                            than the slots goes through them in chunks
    CUDA ranks              `SymmMemAllReduce`: PyTorch's symmetric memory, one-shot below
                            `GPU_TWO_SHOT_FROM`, two-shot below `GPU_NCCL_FROM`, NCCL above
    anything else           `GroupAllReduce`: the process group's all_reduce (gloo across hosts,
                            or where /dev/shm cannot be shared)

`RINGCTX_TP_ALLREDUCE` forces a choice, for comparisons: "group" (gloo or NCCL: what ringctx did
before), "one-shot" or "two-shot" (every size); unset or "auto", the size decides.

Bytes (what `CommStats` records, as the ring formulas elsewhere count them): the bytes of this
rank's buffer that the other ranks read. One-shot: (N-1) x; two-shot: its N-1 foreign segments of
x, then its summed segment read by N-1 ranks, 2(N-1)/N of x for even segments, as a ring's.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..kernels import cpu as cpu_kernels
from .comm import all_gather_ints
from .shm import ShmSegment, shm_supported

ENV = "RINGCTX_TP_ALLREDUCE"
"""Forces the TP all-reduce: "group", "one-shot", "two-shot"; "auto" (the default) chooses by size."""

CHOICES = ("auto", "group", "one-shot", "two-shot")

CPU_TWO_SHOT_FROM = {2: 1 << 62, 3: 4 << 20, 4: 4 << 20}
"""Message bytes from which CPU ranks use two-shot, by group size (larger groups: 4's). Measured on
a 2-core AMD EPYC (scripts/bench_allreduce.py, docs/BENCHMARKS.md): at 2 ranks one-shot was as fast
or faster at every size to 16 MiB and neither won at 64 MiB (with two ranks both algorithms read
and write the same bytes, and two-shot waits twice): never; at 4 ranks two-shot took 0.8-0.95x
one-shot's time from 4 MiB (one-shot reads N x per rank, two-shot about 2 x). 3 ranks were not
measured: 4's."""

CPU_SLOT_BYTES = 4 << 20
"""Bytes of each rank's shared slot (two of them per rank, used in turn); a larger message goes
through in chunks of this size (each chunk is the same sum, so the bits do not change)."""

GPU_TWO_SHOT_FROM = 512 << 10
"""Bytes from which CUDA ranks use symmetric memory's two-shot (PyTorch's and vLLM's order of
magnitude; not measured here: scripts/gpu_check.py's "allreduce" section times both against NCCL)."""

GPU_NCCL_FROM = 16 << 20
"""Bytes from which CUDA ranks use NCCL (its ring saturates the links; this is also the symmetric buffer)."""

_ACCUMULATE_IN_FLOAT32 = (torch.bfloat16, torch.float16)
_IN_OWN_DTYPE = (torch.float32, torch.float64)


def forced_choice() -> str:
    """RINGCTX_TP_ALLREDUCE, checked: one of CHOICES."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r} is not a TP all-reduce; use one of {', '.join(CHOICES)}")
    return choice


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes`: 2(N-1)/N of them."""
    return 2 * (world - 1) * nbytes // world


class GroupAllReduce:
    """The process group's all_reduce (gloo or NCCL): x summed in place over `group`."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def algorithm(self, nbytes: int) -> str:
        return "group"

    def __call__(self, x: torch.Tensor) -> int:
        """Sum x [any shape] over the group in place; returns the bytes this rank sent."""
        dist.all_reduce(x, group=self.group)
        return ring_bytes(x.numel() * x.element_size(), self.world)


def add_in_rank_order(sources: list[torch.Tensor], out: torch.Tensor) -> None:
    """out [n] = sources[0] + sources[1] + ... (each [n], out's dtype), added left to right: in the
    dtype for float32 / float64, in float32 rounded once for bfloat16 / float16. bfloat16 takes one
    pass of the C kernel where it runs (the same bits as the PyTorch adds below, which widen every
    source into a new float32 buffer: 3-16x its time at 4 MiB)."""
    if not cpu_kernels.sum_buffers(sources, out):
        add_with_torch(sources, out)


def add_with_torch(sources: list[torch.Tensor], out: torch.Tensor) -> None:
    """add_in_rank_order in PyTorch ops (where the C kernel does not apply, and to compare)."""
    if out.dtype in _ACCUMULATE_IN_FLOAT32:
        acc = sources[0].float()
        for s in sources[1:]:
            acc.add_(s)
        out.copy_(acc)
        return
    torch.add(sources[0], sources[1], out=out)
    for s in sources[2:]:
        out.add_(s)


def segments(n: int, world: int, element_size: int) -> list[int]:
    """Bounds [world + 1] of two-shot's segments of n elements: near-equal, 64-byte aligned starts."""
    unit = max(1, 64 // element_size)
    return [r * n // world // unit * unit for r in range(world)] + [n]


class ShmAllReduce:
    """One-shot / two-shot all-reduce of the CPU ranks of one host through shared memory.

    Build it collectively with `ShmAllReduce.create` (None on every rank where shared memory
    cannot be used); then call it on every rank alike with tensors of the same shape and dtype.
    """

    def __init__(self, segment: ShmSegment, slot_bytes: int, group, force: str = "auto"):
        self.segment, self.slot_bytes, self.force = segment, slot_bytes, force
        self.rank, self.world = segment.rank, segment.world
        self.fallback = GroupAllReduce(group, self.world)
        self.calls = 0  # which of the two slot sets a chunk uses: call parity
        self.step = 0   # the sequence number this rank posts next: one per wait

    @classmethod
    def create(cls, group, timeout_s: float, slot_bytes: int = CPU_SLOT_BYTES,
               force: str = "auto") -> "ShmAllReduce | None":
        """Call on every rank of `group` alike (a collective)."""
        world = dist.get_world_size(group)
        segment = ShmSegment.create(2 * world * slot_bytes, group, timeout_s, "TP all-reduce")
        return None if segment is None else cls(segment, slot_bytes, group, force)

    def algorithm(self, nbytes: int) -> str:
        """"one-shot" or "two-shot" for a message of `nbytes` (or the forced one)."""
        if self.force in ("one-shot", "two-shot"):
            return self.force
        threshold = CPU_TWO_SHOT_FROM.get(self.world, CPU_TWO_SHOT_FROM[max(CPU_TWO_SHOT_FROM)])
        return "two-shot" if nbytes >= threshold else "one-shot"

    def __call__(self, x: torch.Tensor, algorithm: str | None = None) -> int:
        """Sum x [any shape] over the group in place; returns the bytes of this rank's that the
        others read. `algorithm` overrides the choice (tests, benchmarks)."""
        if x.dtype not in _ACCUMULATE_IN_FLOAT32 + _IN_OWN_DTYPE:
            return self.fallback(x)
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        algorithm = algorithm or self.algorithm(flat.numel() * flat.element_size())
        run = {"one-shot": self._one_shot, "two-shot": self._two_shot}[algorithm]
        per_chunk = self.slot_bytes // flat.element_size()
        sent = 0
        for start in range(0, flat.numel(), per_chunk):
            sent += run(flat[start:start + per_chunk])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return sent

    def _slots(self, part: torch.Tensor) -> list[torch.Tensor]:
        """This call's N slots, as [n] tensors of part's dtype (every rank's, in rank order)."""
        self.calls += 1
        n, base = part.numel(), (self.calls % 2) * self.world
        return [self.segment.payload[(base + r) * self.slot_bytes:(base + r + 1) * self.slot_bytes]
                .view(part.dtype)[:n] for r in range(self.world)]

    def _all_posted(self) -> None:
        self.step += 1
        self.segment.post(self.step)
        self.segment.wait(self.step)

    def _one_shot(self, part: torch.Tensor) -> int:
        slots = self._slots(part)
        slots[self.rank].copy_(part)
        self._all_posted()
        add_in_rank_order(slots, part)
        return (self.world - 1) * part.numel() * part.element_size()

    def _two_shot(self, part: torch.Tensor) -> int:
        slots = self._slots(part)
        slots[self.rank].copy_(part)
        self._all_posted()
        bounds = segments(part.numel(), self.world, part.element_size())
        a, b = bounds[self.rank], bounds[self.rank + 1]
        add_in_rank_order([s[a:b] for s in slots], part[a:b])
        slots[self.rank][a:b].copy_(part[a:b])  # only this rank reads or writes segment r of its slot now
        self._all_posted()
        for j in range(self.world):
            if j != self.rank:
                part[bounds[j]:bounds[j + 1]].copy_(slots[j][bounds[j]:bounds[j + 1]])
        mine = b - a
        return (part.numel() - mine + (self.world - 1) * mine) * part.element_size()


class SymmMemAllReduce:
    """One-shot / two-shot all-reduce of CUDA ranks through PyTorch's symmetric memory
    (torch.ops.symm_mem), NCCL for large messages; imported and built only on CUDA."""

    why_not: str | None = None
    """Why the last `create` on this rank returned None (its exception), for reports."""

    def __init__(self, buffer: torch.Tensor, group, group_name: str, world: int, force: str = "auto"):
        self.buffer, self.group_name, self.world, self.force = buffer, group_name, world, force
        self.fallback = GroupAllReduce(group, world)

    @classmethod
    def create(cls, group, device: torch.device, force: str = "auto") -> "SymmMemAllReduce | None":
        """Call on every rank of `group` alike; None (on every rank) where symmetric memory fails."""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(GPU_NCCL_FROM, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(buffer, group or dist.group.WORLD)
            name = handle.group_name if hasattr(handle, "group_name") else (group or dist.group.WORLD).group_name
            ok = 1
        except Exception as exc:  # an old torch, no P2P between the GPUs, ...: every rank uses NCCL
            buffer, name, ok = None, "", 0
            cls.why_not = f"{type(exc).__name__}: {exc}"
        everyone = torch.tensor([ok], device=device)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
        world = dist.get_world_size(group)
        return cls(buffer, group, name, world, force) if int(everyone) else None

    def algorithm(self, nbytes: int) -> str:
        if self.force != "auto":
            return self.force
        return "one-shot" if nbytes < GPU_TWO_SHOT_FROM else "two-shot" if nbytes < GPU_NCCL_FROM else "group"

    def __call__(self, x: torch.Tensor, algorithm: str | None = None) -> int:
        nbytes = x.numel() * x.element_size()
        # two-shot wants 16-byte pieces per rank: pad its view of the buffer (the padding's sum is unused)
        padded = -(-nbytes // (16 * self.world)) * 16 * self.world
        algorithm = algorithm or self.algorithm(nbytes)
        if algorithm == "group" or padded > self.buffer.numel() or x.dtype not in _ACCUMULATE_IN_FLOAT32 + _IN_OWN_DTYPE:
            return self.fallback(x)
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        view = self.buffer[:padded].view(x.dtype)
        view[:flat.numel()].copy_(flat)
        if algorithm == "one-shot":
            flat.copy_(torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group_name)[:flat.numel()])
            sent = (self.world - 1) * nbytes
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", self.group_name)
            flat.copy_(view[:flat.numel()])
            sent = ring_bytes(nbytes, self.world)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return sent


def make_all_reduce(group, device: torch.device, timeout_s: float = 300.0):
    """The all-reduce of `group` for tensors on `device` (call on every rank of the group alike):
    shared memory on the CPU ranks of one host, symmetric memory on CUDA, else the group's own;
    RINGCTX_TP_ALLREDUCE may force one. Returns a callable x -> bytes sent (x summed in place)."""
    choice, world = forced_choice(), dist.get_world_size(group)
    device = torch.device(device)
    if choice == "group" or world == 1:
        return GroupAllReduce(group, world)
    kind = 2 if device.type == "cuda" else int(shm_supported(device))  # 0: neither applies here
    if any(k != kind for (k,) in all_gather_ints([kind], group, world)):  # every rank decides alike
        kind = 0
    made = (SymmMemAllReduce.create(group, device, choice) if kind == 2 else
            ShmAllReduce.create(group, timeout_s, force=choice) if kind == 1 else None)
    return made or GroupAllReduce(group, world)
