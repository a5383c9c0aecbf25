"""Moving the prefill's KV shards to the decode ranks: only what must move.

After a prefill every rank holds a KV shard (its balanced share of every chunk). The decode ranks
(several ranks of one host, `decode_ranks`) keep theirs where they are; each other rank sends its
rows to the decode ranks, split so that every decode rank ends with the same number of rows (to
within one) and all decode ranks receive at once:

    rows held   rank 0: 40   rank 1: 40   rank 2: 40   rank 3: 40      decode ranks {0, 1}
    plan        rank 2 -> rank 0 (40 rows), rank 3 -> rank 1 (40 rows)  each decode rank: 80

The plan is plain arithmetic on the row counts, computed identically on every rank, so no
message says who sends what. Rows travel as stored (8-bit caches with their scales), one layer at
a time, with point-to-point sends that run concurrently. With one decode rank the gather is the
one in `gather_in_order`, which also puts the rows in sequence order (the single-rank cache layout
that the fused CPU decode step and KV files use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.cuda_ext import scatter_kv
from ..model import KVCache
from ..model.kvcache import write_rows
from ..parallel.comm import nbytes
from ..telemetry import release_free_memory


@dataclass(frozen=True)
class Transfer:
    """Rows src_start .. src_start+n-1 of rank `src`'s shard go to rows dst_start.. of rank `dst`."""

    src: int
    dst: int
    src_start: int
    dst_start: int
    n: int


def fill_levels(held: list[int], extra: int) -> list[int]:
    """How many of `extra` rows each holder receives so that the holders end as level as possible.

    Water filling: the emptiest holders are raised first; the result adds up to `extra` and the
    final counts differ by at most one among the holders that received anything.

    >>> fill_levels([10, 12, 11], 5)
    [3, 1, 1]
    """
    if extra <= 0:
        return [0] * len(held)
    lo, hi = min(held), max(held) + extra
    while lo < hi:  # the lowest level whose deficit covers `extra`
        mid = (lo + hi) // 2
        if sum(max(0, mid - h) for h in held) >= extra:
            hi = mid
        else:
            lo = mid + 1
    take = [max(0, lo - 1 - h) for h in held]  # everyone up to lo - 1 ...
    left = extra - sum(take)
    for i, h in enumerate(held):  # ... then one more for the first `left` holders below lo
        if left and h + take[i] < lo:
            take[i] += 1
            left -= 1
    return take


def spread_plan(rows: list[int], decode_ranks: list[int]) -> list[Transfer]:
    """The transfers that level the decode ranks, given every rank's row count.

    Each non-decode rank's rows are poured, in order, into the decode ranks' free room; sender j
    starts at the decode rank j mod N so that different senders feed different receivers at once.
    """
    decode = list(decode_ranks)
    senders = [r for r in range(len(rows)) if r not in decode]
    room = fill_levels([rows[d] for d in decode], sum(rows[s] for s in senders))
    filled = [rows[d] for d in decode]  # next free row of each decode rank
    plan = []
    for j, src in enumerate(senders):
        start, left = 0, rows[src]
        i = j % len(decode)
        while left:
            while room[i] == 0:
                i = (i + 1) % len(decode)
            n = min(left, room[i])
            plan.append(Transfer(src, decode[i], start, filled[i], n))
            room[i] -= n
            filled[i] += n
            start += n
            left -= n
    return plan


def received_rows(plan: list[Transfer], rank: int) -> int:
    """Rows `rank` receives under `plan`."""
    return sum(t.n for t in plan if t.dst == rank)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous row range (gloo has no float8 type; one code path for all)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def spread_shards(shard: KVCache, plan: list[Transfer], rank: int, group, *, host_of, comm=None) -> dict:
    """Run `plan` on this rank's shard: send rows to decode ranks, receive rows into free rows.

    `group` ranks in the plan are group-relative; host_of(rank) tells which host a rank is on (for
    the cross-host byte count). The receiver's shard must have room (see `received_rows`). Returns
    {"sent": bytes, "cross_host": bytes of those that left this host}.
    """
    sent = cross = 0
    mine = [t for t in plan if t.src == rank or t.dst == rank]
    if not mine:
        return {"sent": 0, "cross_host": 0}
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    for layer in range(shard.n_layers):
        works, pieces = [], []  # the sent pieces stay referenced until their sends complete
        for t in mine:
            if t.src == rank:  # rows the shard dropped (a windowed layer's older ones) travel as zeros
                for rows in shard.rows_as_sent(layer, t.src_start, t.src_start + t.n):
                    piece = _as_bytes(rows.contiguous())
                    pieces.append(piece)
                    works.append(dist.isend(piece, to_global(t.dst), group=group))
                    sent += nbytes(piece)
                    cross += nbytes(piece) if host_of(t.src) != host_of(t.dst) else 0
                    if comm is not None:
                        comm.record("hand-off", layer, nbytes(piece))
            else:  # after the receiver's own rows: rows it holds
                for rows in shard.stored_rows(layer, t.dst_start, t.dst_start + t.n):
                    works.append(dist.irecv(_as_bytes(rows), to_global(t.src), group=group))
        for w in works:
            w.wait()
    return {"sent": sent, "cross_host": cross}


def gather_in_order(shard: KVCache, out: KVCache | None, positions: list[torch.Tensor], first_row: int, rank: int,
                    world: int, decode: int, group, comm=None, *, free: bool = True) -> int:
    """Gather every rank's rows first_row.. (positions[r] of rank r) into `out` on rank `decode`, at
    rows = positions (sequence order), layer by layer; with `free`, each layer of the shard is
    released once sent (the hand-off). Returns the bytes this rank sent."""
    sent = 0
    rows = max(p.numel() for p in positions)
    n_mine = positions[rank].numel()
    dst = dist.get_global_rank(group, decode) if group is not None else decode
    for layer in range(shard.n_layers):
        # rows the shard dropped (what no later token sees) travel as zeros; the receiver skips them
        parts = shard.rows_as_sent(layer, first_row, first_row + n_mine)
        if world == 1:
            gathered = [parts]
        else:
            send = [t.new_zeros((rows, *t.shape[1:])) for t in parts]
            for s, p in zip(send, parts):
                s[:n_mine] = p
            packed = torch.cat([_as_bytes(s) for s in send], dim=1)  # one message per layer
            everyone = [torch.empty_like(packed) for _ in range(world)] if rank == decode else None
            dist.gather(packed, everyone, dst=dst, group=group)
            if rank != decode:
                sent += nbytes(packed)
                if comm is not None:
                    comm.record("hand-off", layer, nbytes(packed))
            else:
                gathered = [_unpack(block, parts) for block in everyone]
        if rank == decode:
            first = out.kept_from(layer)  # `out` may keep only a windowed layer's last rows
            for r, pieces in enumerate(gathered):
                n = positions[r].numel()
                where = positions[r].to(out.device)
                if first:
                    wanted = where >= first
                    where, n = where[wanted] - first, int(wanted.sum())
                    pieces = [p[:positions[r].numel()][wanted] for p in pieces]
                targets = out.storage_tensors(layer)
                if not out.quantized:
                    scatter_kv(targets[0], targets[1], pieces[0][:n], pieces[1][:n], where)
                else:
                    for target, piece in zip(targets, pieces):
                        write_rows(target, where, piece[:n])
        if free:  # the decode rank never keeps a second copy of a layer
            shard.k[layer] = shard.v[layer] = None
            if shard.quantized:
                shard.k_scale[layer] = shard.v_scale[layer] = None
            release_free_memory()
    return sent


def _unpack(block: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split a packed uint8 [rows, bytes] message back into tensors shaped and typed like `like`."""
    out, offset = [], 0
    for t in like:
        width = math.prod(t.shape[1:]) * t.element_size()
        if width == 0:  # a layer without rows (a linear-attention layer's): nothing to reinterpret
            out.append(t.new_empty((block.shape[0], *t.shape[1:])))
            continue
        out.append(block[:, offset:offset + width].contiguous().view(t.dtype).reshape(block.shape[0], *t.shape[1:]))
        offset += width
    return out
