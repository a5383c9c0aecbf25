"""All-gather of small tensors between the ranks of one host through shared memory.

Why: a decode step over a KV cache split across the decode ranks merges every rank's partial
attention once per layer (runtime/decode.py). The decode ranks are always on one host, and on CPUs
gloo's all-gather of those few KiB took 0.2 ms on an idle 2-core machine and about 1.5 ms while the
other rank computed (TCP loopback and wake-ups): 30-45 ms a token for SmolLM2's 30 layers, a third
of the step at 128K tokens. Here each rank writes its tensor into its slot of a shared buffer and
raises its sequence number; the others spin until every sequence number has reached the step
(the segment, the numbers and the wait are parallel/shm.py's `ShmSegment`).

    slots [2, N, F] float32     two buffers used in turn: a rank can run at most one exchange ahead
                                (it waits for everyone's next write, which each writes only after
                                reading this one), so the buffer it writes is never still being read

On GPUs (NCCL is fast there) and where `shm_supported` says no, the engine keeps the process
group's all-gather. A dead or stuck rank ends the wait with an error naming it (`ShmSegment.wait`).
"""

from __future__ import annotations

import torch

from ..parallel.shm import ShmSegment, shm_supported

__all__ = ["ShmExchange", "shm_supported"]


class ShmExchange:
    """exchange(t [F] float32) -> [N, F]: every rank's t, in rank order (call on every rank alike).

    Build it collectively with `ShmExchange.create`, which returns None (and every rank falls back
    to the process group) when any rank cannot open the shared buffer or see the others' pids.
    """

    def __init__(self, segment: ShmSegment, floats: int):
        self.segment, self.rank = segment, segment.rank
        self.slots = segment.payload[:2 * segment.world * floats * 4].view(torch.float32).view(2, segment.world, floats)
        self.step = 0

    @classmethod
    def create(cls, floats: int, group, timeout_s: float) -> "ShmExchange | None":
        """A shared buffer for `floats` floats per rank among the ranks of `group` (all on this host)."""
        world = torch.distributed.get_world_size(group)
        segment = ShmSegment.create(2 * world * floats * 4, group, timeout_s, "decode merge")
        return None if segment is None else cls(segment, floats)

    def exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t [F'] (F' <= F, the same on every rank: a batch of a varying size) as a
        [N, F'] view of the shared buffer (valid until the next exchange but one: copy what must
        outlive it)."""
        self.step += 1
        n = t.numel()
        buffer = self.slots[self.step % 2, :, :n]
        buffer[self.rank].copy_(t)
        self.segment.post(self.step)
        self.segment.wait(self.step)
        return buffer
