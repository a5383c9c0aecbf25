"""Ring attention over torch.distributed: pass-KV (paper Algorithm 2) and pass-Q (Algorithm 3).

Every rank calls `ring_attention` with its own shard of the new tokens (q, k, v from
`ShardLayout.shard`) and of the cache (cached_k/v from `ShardLayout.shard_cached`). Each new token
of sequence s sees every cached token of s and the new tokens of s at positions <= its own.

pass-KV: queries stay; each rank's KV message (its cached + new rows, Hkv heads, padded to the
    largest rank's size) travels N-1 steps around the ring. While step i's block is computed,
    step i+1's message is already in flight (double buffering). Partials are merged as they come.
pass-Q: KV stays; each rank's queries travel around the ring instead, every rank computes the
    visiting queries against its own KV, and one all-to-all returns the partial (out, lse) of
    every query to the rank that owns it, where they are merged.

Which blocks are computed, skipped, full or diagonal comes from `ShardLayout.block_tasks`, i.e.
from global positions and sequence ids. Messages and the local queries are kept head-major in
memory (each head's rows contiguous): the CPU attention kernels read them faster so, and every
backend takes such strides. Positions and sequence ids of travelling queries are not
sent: every rank holds the same layout (checked before any communication), so the receiver
derives them from the source rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..attention import PartialAccumulator, attention_block, reads_kv_in_place
from ..attention.spans import FULL, LayerSoftmax
from ..telemetry import span
from .comm import (CommStats, Ring, agree_across_ranks, all_to_all_equal, nbytes, rank_and_world, start_exchange,
                   wait_all)
from .layout import ShardLayout

PASS_KV = "pass-kv"
PASS_Q = "pass-q"
STRATEGIES = (PASS_KV, PASS_Q)
"""The two ring strategies, as spelled everywhere (ring_attention, plans, profiles, telemetry, the CLI)."""


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: ShardLayout,
    *,
    cached_k: torch.Tensor | None = None,
    cached_v: torch.Tensor | None = None,
    strategy: str = "pass-kv",
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    backend: str = "auto",
    stats: CommStats | None = None,
    check_across_ranks: bool = True,
    softmax: LayerSoftmax | None = None,
    cached_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of the layout's new tokens, computed cooperatively by all ranks.

    Call on every rank of `group` (default: the world; "local" or no process group at all for a
    one-rank layout on this process alone).

    Args:
        q: [T_r, Hq, D] this rank's new-token queries, `layout.shard(q_all, rank)`.
        k, v: [T_r, Hkv, D] this rank's new-token keys and values (Hkv heads, never expanded).
        layout: the same ShardLayout on every rank.
        cached_k, cached_v: [P_r, Hkv, D] this rank's cached keys/values,
            `layout.shard_cached(...)`; None when this rank holds no cached tokens.
        strategy: "pass-kv" or "pass-q"; both give the same result to rounding.
        softmax_scale: defaults to 1/sqrt(D).
        backend: attention backend for the local blocks (see ringctx.attention).
        stats: if given, every communication is recorded there (bytes per step).
        check_across_ranks: compare layout, shapes, dtype and strategy across ranks first (one small
            all-gather). Each rank's own inputs are always checked. Pass False only when the caller
            has already agreed on everything these derive from (the prefill engine does, once per
            prefill, instead of once per layer).
        softmax: the layer's scale, soft-cap and span (None: plain causal attention at
            softmax_scale). A layer with a span (sliding window, chunks) needs the positions of
            every rank's cached rows in the layout (`ShardLayout.balanced(cached_positions=)`) and
            takes neither ring: each rank sends the rows of its KV that another rank's queries see,
            straight to it, and nothing else (a window W needs about W rows from the neighbour
            piece), whichever `strategy` is named. Sinks are not applied (`LayerSoftmax.finish`).
            A dual chunk layer (q [T_r, 3 * Hq, D], its three rotations side by side) sees every
            earlier key: it runs pass-KV whichever `strategy` is named. Its queries would travel
            in three versions under pass-Q, three times the bytes that make pass-Q worth it.
        cached_from: with a span, cached_k/v hold this rank's cached rows from row `cached_from` on
            (a document's windowed or chunked layer dropped the rows before it, which no query of
            this call sees: `KVCache.drop_unseen`); 0 without a span.

    Returns:
        out [T_r, Hq, D] in q's dtype and lse [Hq, T_r] float32 for this rank's rows (a complete
        attention before sinks).

    Raises:
        ValueError on every rank, before any ring communication, when any rank's inputs disagree
        with the layout or with the other ranks (shapes, dtypes, heads, layout, strategy).

    Example (one process; with N ranks each passes its own shards):
        >>> layout = ShardLayout.balanced([7], world_size=1, cached_lens=[3])
        >>> q = torch.randn(7, 4, 16); k = v = torch.randn(7, 2, 16); ck = cv = torch.randn(3, 2, 16)
        >>> out, lse = ring_attention(q, k, v, layout, cached_k=ck, cached_v=cv)
        >>> out.shape, lse.shape
        (torch.Size([7, 4, 16]), torch.Size([4, 7]))
    """
    rank, world = rank_and_world(group)
    problem = _local_problem(q, k, v, cached_k, cached_v, layout, rank, world, strategy, group, cached_from)
    if problem is None and cached_from and (softmax is None or softmax.span.sees_everything):
        problem = f"cached_from={cached_from} drops cached rows, which only a windowed or chunked layer may"

    if world > 1 and check_across_ranks:
        key = "" if softmax is None else f"{softmax.scale}/{softmax.softcap}/{softmax.span}"
        agree_across_ranks("ring_attention", problem, _signature(q, k, layout, strategy, softmax_scale, key), group,
                           stats)
    elif problem:
        raise ValueError(f"ring_attention: {problem}")

    if cached_k is None:
        cached_k = cached_v = k[:0]
    if softmax is None:
        softmax = LayerSoftmax(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    run = _RingRun(q, k, v, cached_k, cached_v, layout, rank, world, group, softmax, backend, stats, cached_from)
    if layout.total_new == 0:
        return run.empty_result()
    if not softmax.span.sees_everything:
        return run.span_exchange()
    if softmax.span.dual_chunk:
        return run.pass_kv()  # see the docstring: DCA's queries stay where they are
    return run.pass_kv() if strategy == "pass-kv" else run.pass_q()


class _RingRun:
    """One ring_attention call on one rank: the inputs, already validated, and the two loops."""

    def __init__(self, q, k, v, cached_k, cached_v, layout, rank, world, group, softmax, backend, stats,
                 cached_from=0):
        self.q, self.k, self.v, self.cached_k, self.cached_v = head_major(q), k, v, cached_k, cached_v
        self.cached_from = cached_from  # cached_k's row 0 is cached row `cached_from` (a span layer's)
        self.layout, self.rank, self.world, self.group = layout, rank, world, group
        self.softmax, self.scale, self.backend, self.stats = softmax, softmax.scale, backend, stats
        self.rows, self.heads, self.head_dim = q.shape
        self.heads //= softmax.span.query_versions  # dual chunk: q holds three versions of each head
        self.ring = Ring(group) if world > 1 else None

    def empty_result(self):
        return (self.q.new_zeros(self.rows, self.heads, self.head_dim),
                torch.full((self.heads, 0), float("-inf"), device=self.q.device))

    def kv_message(self, rows: int, first: int = 0) -> torch.Tensor:
        """This rank's KV message: K and V of its cached + new tokens in message order, stored
        head-major as [2, Hkv, rows, D] (contiguous: it is what travels); see `message_kv`. With
        `first`, only message rows first .. first+rows-1 (what a span layer's peer needs)."""
        buf = self.k.new_empty((2, self.k.shape[1], rows, self.k.shape[2]))
        rows_view = buf.transpose(1, 2)  # [2, rows, Hkv, D]
        for source, src, dst, n in self.layout.kv_message_segments(self.rank):
            lo, hi = max(dst, first), min(dst + n, first + rows)
            if lo >= hi:
                continue
            src += lo - dst
            sk, sv = (self.k, self.v) if source == "new" else (self.cached_k, self.cached_v)
            if source == "cached":
                src -= self.cached_from
                if src < 0:
                    raise RuntimeError("ring_attention: a span layer's block reached cached rows it dropped")
            rows_view[0, lo - first:hi - first] = sk[src:src + hi - lo]
            rows_view[1, lo - first:hi - first] = sv[src:src + hi - lo]
        return buf

    @staticmethod
    def message_kv(message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [rows, Hkv, D] of a KV message (views, head-major memory)."""
        return message[0].transpose(0, 1), message[1].transpose(0, 1)

    def local_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of this rank's own message when it is not sent (one rank, or pass-Q's
        resident KV), sliceable by rows: k and v themselves when the message is just the new rows
        and they are head-major already; views of the cached and new rows (_Segments) where the
        blocks' kernel reads them in place (attention's reads_kv_in_place); else a packed copy."""
        rows = self.layout.num_new(self.rank) + self.layout.num_cached(self.rank)
        segments = self.layout.kv_message_segments(self.rank)
        if segments == (("new", 0, 0, rows),) and is_head_major(self.k) and is_head_major(self.v):
            return self.k, self.v
        if self.cached_from:
            raise RuntimeError("ring_attention: the whole local message of a layer that dropped cached rows")
        if reads_kv_in_place(self.q, self.backend):
            # A rank's own tasks each lie in one segment (its cached rows, then its new ones): the
            # blocks are views of them, and the cached rows (a long document's, in the shard's own
            # token-major layout) are not copied for every layer. The AMX kernel reads K in place
            # (packs it for many queries) and packs V itself, as fast from that layout (measured,
            # 2 cores, SmolLM2 bf16, 8K-token document: a 20-token question's prefill 0.86x the
            # time, an ingest in 512-token chunks 0.97x); the float32 flash kernel reads (and
            # widens bf16) both in place.
            return (_Segments(segments, self.cached_k, self.k), _Segments(segments, self.cached_v, self.v))
        return self.message_kv(self.kv_message(rows))

    def attend(self, acc: PartialAccumulator, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               q_rank: int, kv_rank: int, first_row: int = 0):
        """Accumulate q_rank's queries against kv_rank's keys/values, block by block (masked blocks
        skipped); keys/values hold kv_rank's message rows from `first_row` on."""
        softmax = self.softmax
        with span("attention", "compute", q_rank=q_rank, kv_rank=kv_rank):
            for t in self.layout.block_tasks(q_rank, kv_rank, softmax.span):
                k0, k1 = t.k_start - first_row, t.k_end - first_row
                versions = queries[t.q_start:t.q_end]
                if softmax.span.dual_chunk:  # the block's rotation of the queries (BlockTask.query)
                    versions = versions[:, t.query * self.heads:(t.query + 1) * self.heads]
                out, lse = attention_block(versions, keys[k0:k1], values[k0:k1], causal=t.causal,
                                           q_offset=t.q_offset, window=t.window, softcap=softmax.softcap,
                                           softmax_scale=self.scale, backend=self.backend, one_sequence=True)
                acc.add(out, lse, t.q_start, owned=True)

    def record(self, kind: str, step: int, n: int) -> None:
        if self.stats is not None:
            self.stats.record(kind, step, n)

    def pass_kv(self):
        acc = PartialAccumulator(self.rows, self.heads, self.head_dim, device=self.q.device)
        if self.world == 1:  # nothing travels: attend to the local KV without packing a message
            self.attend(acc, self.q, *self.local_kv(), 0, 0)
            return acc.result(self.q.dtype)
        current = self.kv_message(self.layout.kv_message_rows)
        incoming = torch.empty_like(current)
        for step in range(self.world):
            works = []
            if step < self.world - 1:  # post the next block's transfer before computing this one
                works = self.ring.start_shift(current, incoming)
                self.record("ring-kv", step, nbytes(current))
            self.attend(acc, self.q, *self.message_kv(current), self.rank, (self.rank - step) % self.world)
            with span("wait kv", "comm", step=step):
                wait_all(works)
            current, incoming = incoming, current
        return acc.result(self.q.dtype)

    def span_exchange(self):
        """A windowed or chunked layer: every rank sends each other rank the rows of its KV message
        that rank's queries see (`ShardLayout.needed_rows`; none for most pairs, a window's worth
        from a neighbour piece) in one batch of point-to-point transfers, computes its own blocks
        while they travel, then the received ones. Nothing a span excludes is sent or computed."""
        layout, rank, span_ = self.layout, self.rank, self.softmax.span
        acc = PartialAccumulator(self.rows, self.heads, self.head_dim, device=self.q.device)
        sends, recvs, firsts = {}, {}, {}
        if self.world > 1:
            for peer in range(self.world):
                if peer == rank:
                    continue
                lo, hi = layout.needed_rows(peer, rank, span_)  # what peer's queries see of ours
                if hi > lo:
                    sends[peer] = self.kv_message(hi - lo, lo)
                lo, hi = layout.needed_rows(rank, peer, span_)  # what our queries see of peer's
                if hi > lo:
                    recvs[peer] = self.k.new_empty((2, self.k.shape[1], hi - lo, self.k.shape[2]))
                    firsts[peer] = lo
        works = start_exchange(sends, recvs, self.group)
        self.record("span-kv", 0, sum(nbytes(t) for t in sends.values()))
        lo, hi = layout.needed_rows(rank, rank, span_)  # our own rows our queries see
        if hi > lo:
            self.attend(acc, self.q, *self.message_kv(self.kv_message(hi - lo, lo)), rank, rank, lo)
        with span("wait kv", "comm", step=0):
            wait_all(works)
        for peer in sorted(recvs):
            self.attend(acc, self.q, *self.message_kv(recvs[peer]), rank, peer, firsts[peer])
        return acc.result(self.q.dtype)

    def pass_q(self):
        layout, world = self.layout, self.world
        own_k, own_v = self.local_kv()
        if world == 1:
            acc = PartialAccumulator(self.rows, self.heads, self.head_dim, device=self.q.device)
            self.attend(acc, self.q, own_k, own_v, 0, 0)
            return acc.result(self.q.dtype)

        q_rows = layout.q_message_rows
        current = self.q.new_zeros((self.heads, q_rows, self.head_dim))  # head-major, like the KV messages
        current.transpose(0, 1)[:self.rows] = self.q
        incoming = torch.empty_like(current)
        # partial_*[j]: rank j's queries against this rank's KV, merged in float32.
        partial_out = torch.zeros(world, q_rows, self.heads, self.head_dim, dtype=torch.float32, device=self.q.device)
        partial_lse = torch.full((world, self.heads, q_rows), float("-inf"), device=self.q.device)
        for step in range(world):
            works = []
            if step < world - 1:
                works = self.ring.start_shift(current, incoming)
                self.record("ring-q", step, nbytes(current))
            owner = (self.rank - step) % world
            self.attend(PartialAccumulator.over(partial_out[owner], partial_lse[owner]), current.transpose(0, 1),
                        own_k, own_v, owner, self.rank)
            with span("wait q", "comm", step=step):
                wait_all(works)
            current, incoming = incoming, current

        # One all-to-all returns every partial to the owner of its queries (on the critical path).
        # Outputs travel in the input dtype (paper: (D+1)*T*e bytes), LSE in float32.
        send_out = partial_out.to(self.q.dtype)
        with span("all2all", "comm"):
            received_out = all_to_all_equal(send_out, self.group)
            received_lse = all_to_all_equal(partial_lse, self.group)
        self.record("all2all", 0, (world - 1) * (nbytes(send_out[0]) + nbytes(partial_lse[0])))
        acc = PartialAccumulator(self.rows, self.heads, self.head_dim, device=self.q.device)
        for j in range(world):
            acc.add(received_out[j, :self.rows], received_lse[j, :, :self.rows])  # views: not owned
        return acc.result(self.q.dtype)


# ---------------------------------------------------------------------- memory layout


class _Segments:
    """A rank's KV message rows without assembling them: rows [dst, dst + n) are rows [src, src + n)
    of its cached or new tensor (`ShardLayout.kv_message_segments`). Slicing gives a view of one
    tensor when the slice lies in one segment, else the pieces copied together."""

    def __init__(self, segments, cached: torch.Tensor, new: torch.Tensor):
        self.segments, self.cached, self.new = segments, cached, new

    def __getitem__(self, rows: slice) -> torch.Tensor:
        pieces = []
        for source, src, dst, n in self.segments:
            lo, hi = max(rows.start, dst), min(rows.stop, dst + n)
            if lo < hi:
                pieces.append((self.cached if source == "cached" else self.new)[src + lo - dst:src + hi - dst])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def is_head_major(x: torch.Tensor) -> bool:
    """True when x [rows, H, D] keeps each head's rows contiguous (memory [H, rows, D])."""
    return x.transpose(0, 1).is_contiguous()


def head_major(x: torch.Tensor) -> torch.Tensor:
    """x [rows, H, D] with head-major memory: x itself when it is, else a copy. The attention
    blocks read it faster so (PyTorch's float32 CPU op: 3-6% on 4K-16K blocks, measured), and the
    prefill engine's blocks already hand q, k, v over that way (Block.forward)."""
    return x if is_head_major(x) else x.transpose(0, 1).contiguous().transpose(0, 1)


# ---------------------------------------------------------------------- validation


def _local_problem(q, k, v, cached_k, cached_v, layout, rank, world, strategy, group, cached_from=0) -> str | None:
    """What is wrong with this rank's inputs, or None. Never raises: every rank must reach the check."""
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}"
    if not isinstance(layout, ShardLayout):
        return f"layout must be a ShardLayout, got {type(layout).__name__}"
    if layout.world_size != world:
        return f"the layout is for {layout.world_size} ranks but the group has {world}"
    tensors = {"q": q, "k": k, "v": v}
    if cached_k is not None or cached_v is not None:
        if cached_k is None or cached_v is None:
            return "give both cached_k and cached_v, or neither"
        tensors.update(cached_k=cached_k, cached_v=cached_v)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 3:
            return f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}"
        if not t.is_floating_point():
            return f"{name} must be a floating-point tensor, got {t.dtype}"
        if t.dtype != q.dtype:
            return f"{name} has dtype {t.dtype} but q has {q.dtype}; cast all inputs to one dtype"
        if t.device != q.device:
            return f"{name} is on {t.device} but q is on {q.device}"
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    if v.shape != k.shape:
        return f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}"
    if k.shape[2] != d:
        return f"q has head_dim {d} but k has {k.shape[2]}"
    if hkv == 0 or hq % hkv:
        return f"q has {hq} heads, not a multiple of k's {hkv} heads (GQA needs Hq = g * Hkv)"
    if q.shape[0] != layout.num_new(rank) or k.shape[0] != q.shape[0]:
        return (f"rank {rank} was given {q.shape[0]} query rows and {k.shape[0]} key rows but the layout "
                f"places {layout.num_new(rank)} new tokens on it; pass layout.shard(x, {rank})")
    cached_rows = 0 if cached_k is None else cached_k.shape[0]
    if cached_rows != layout.num_cached(rank) - cached_from:
        return (f"rank {rank} was given {cached_rows} cached rows but the layout places "
                f"{layout.num_cached(rank)} cached tokens on it; pass layout.shard_cached(x, {rank})")
    if cached_k is not None and (cached_k.shape[1:] != k.shape[1:] or cached_v.shape != cached_k.shape):
        return f"cached_k/v have shape {tuple(cached_k.shape)}/{tuple(cached_v.shape)}, expected [P, {hkv}, {d}]"
    if world > 1:
        backend = dist.get_backend(group)
        if backend == "gloo" and q.device.type != "cpu":
            return f"the gloo process group needs CPU tensors, got {q.device}"
        if backend == "nccl" and q.device.type != "cuda":
            return f"the nccl process group needs CUDA tensors, got {q.device}"
    return None


def _signature(q, k, layout, strategy, scale, softmax_key="") -> str:
    """What every rank must agree on; compared as text so a mismatch can be shown."""
    try:
        return (f"layout={layout.fingerprint()} {layout!r} heads={q.shape[1]}/{k.shape[1]} "
                f"head_dim={q.shape[2]} dtype={q.dtype} strategy={strategy} scale={scale} softmax={softmax_key}")
    except Exception as exc:  # malformed inputs: _local_problem reports them
        return f"unavailable ({type(exc).__name__})"
