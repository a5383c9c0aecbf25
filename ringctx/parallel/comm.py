"""Point-to-point ring shifts and all-to-all, with a byte counter.

Everything that moves tensors between ranks for ring attention goes through here, so the bytes
each rank sends can be counted per step (tests check them against the paper's formulas; the
planner and the CLI report them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommEvent:
    """One communication a rank took part in."""

    kind: str
    """"ring-kv" (pass-KV shift), "ring-q" (pass-Q shift), "all2all" (pass-Q partials), "span-kv"
    (a windowed or chunked layer's KV rows sent straight to the ranks whose queries see them), "check"."""
    step: int
    """Ring step (0-based) or 0 for collectives."""
    bytes_sent: int
    """Bytes this rank sent to other ranks (excluding anything it kept for itself)."""


@dataclass
class CommStats:
    """Per-rank record of communication, appended to by ring_attention when passed in."""

    events: list[CommEvent] = field(default_factory=list)
    """Every communication, in order."""

    def record(self, kind: str, step: int, nbytes: int) -> None:
        self.events.append(CommEvent(kind, step, nbytes))

    def bytes_sent(self, kind: str | None = None) -> int:
        """Total bytes sent, optionally only of one kind."""
        return sum(e.bytes_sent for e in self.events if kind is None or e.kind == kind)

    def per_step(self, kind: str) -> list[int]:
        """Bytes sent at each event of `kind`, in order."""
        return [e.bytes_sent for e in self.events if e.kind == kind]


LOCAL = "local"
"""Pass as `group` to compute on this process alone, even when a default process group exists."""


def rank_and_world(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) for LOCAL or when no process group is initialized."""
    if isinstance(group, str) or not (dist.is_available() and dist.is_initialized()):
        if isinstance(group, str) and group != LOCAL:
            raise ValueError(f"group must be a ProcessGroup, None (the world) or {LOCAL!r}, got {group!r}")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group) -> torch.device:
    """Where small tensors of a collective over `group` must live: NCCL moves GPU tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: list[int], group, world: int) -> list[list[int]]:
    """Every rank's `values` (the same count on each), in rank order; no communication at world 1."""
    if world == 1:
        return [list(map(int, values))]
    mine = torch.tensor(values, dtype=torch.long, device=collective_device(group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def all_gather_bytes(data: bytes, group, world: int) -> list[bytes]:
    """Every rank's `data` (any length), in rank order: bytes in a tensor, no pickling between ranks."""
    if world == 1:
        return [data]
    sizes = [s[0] for s in all_gather_ints([len(data)], group, world)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
    padded = padded.to(collective_device(group))
    everyone = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    return [bytes(t[:n].tolist()) for t, n in zip(everyone, sizes)]


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Ring:
    """This rank's place in a ring over `group`: sends go to rank+1, receives come from rank-1."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.send_peer = (self.rank + 1) % self.world_size  # ranks within `group`
        self.recv_peer = (self.rank - 1) % self.world_size

    def start_shift(self, send: torch.Tensor, recv: torch.Tensor) -> list[dist.Work]:
        """Post the send of `send` to the next rank and the receive into `recv` from the previous.

        Returns the pending works; compute on other buffers, then `wait` them. Both tensors must
        keep their storage untouched until then (double buffering).
        """
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=self.send_peer),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.recv_peer)]
        return dist.batch_isend_irecv(ops)


def start_exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor],
                   group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Post point-to-point sends (sends[peer] to rank peer of `group`) and receives (into
    recvs[peer] from rank peer); `wait_all` the returned works. Every pair of ranks must post
    matching sizes (both sides derive them from the same layout)."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for peer, t in sorted(sends.items())]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for peer, t in sorted(recvs.items())]
    return dist.batch_isend_irecv(ops) if ops else []


def wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def all_to_all_equal(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all of equal slices: send[j] goes to rank j; returns recv with recv[j] from rank j."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


_CHECK_BYTES = 512  # per-rank slot of a cross-rank check: status byte + UTF-8 text


def agree_across_ranks(what: str, problem: str | None, signature: str, group: dist.ProcessGroup | None = None,
                       stats: CommStats | None = None) -> None:
    """Make every rank raise the same ValueError if any rank has a problem or the signatures differ.

    Each rank contributes its local problem (or None) and a signature text (what all ranks must
    agree on); one small all-gather shares them. Call it before communication that would hang or
    produce garbage on mismatched inputs: every rank reaches it, so nobody is left waiting.
    """
    world = dist.get_world_size(group)
    text = (problem or signature).encode()[: _CHECK_BYTES - 1]
    slot = torch.zeros(_CHECK_BYTES, dtype=torch.uint8)
    slot[0] = 0 if problem else 1
    slot[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    device = collective_device(group)
    gathered = torch.empty(world * _CHECK_BYTES, dtype=torch.uint8, device=device)
    # all_gather_single is the current name (torch >= 2.12); older releases call it all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, slot.to(device), group=group)
    if stats is not None:
        stats.record("check", 0, (world - 1) * _CHECK_BYTES)
    gathered = gathered.cpu().view(world, _CHECK_BYTES)
    decoded = [bytes(gathered[r, 1:].tolist()).rstrip(b"\0").decode(errors="replace") for r in range(world)]
    bad = [r for r in range(world) if gathered[r, 0] == 0]
    if bad:
        r = bad[0]
        raise ValueError(f"{what}: invalid input on rank {r}: {decoded[r]}")
    mismatched = [r for r in range(world) if decoded[r] != decoded[0]]
    if mismatched:
        r = mismatched[0]
        raise ValueError(f"{what}: ranks disagree: rank 0 has [{decoded[0]}] but rank {r} has [{decoded[r]}]")
