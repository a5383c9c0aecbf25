"""Chunked context-parallel prefill, run on every rank, and the KV hand-off to the decode ranks.

    prompt [T] ──cut into chunks of C tokens──▶ chunk 0, chunk 1, ... chunk k
    for each chunk:
        ShardLayout.balanced(chunk, N, cached_counts = rows each rank already holds)
        each rank: embed its rows, then layer by layer
            q, k, v (RoPE at global positions) -> ring_attention(q, k, v, cached = this rank's shard)
            append this rank's k, v of the chunk to its KV shard          (the shard never leaves the rank)
        the strategy of the chunk: pass-KV or pass-Q (the paper's rule, or forced)
    hand-off: the decode ranks (decode_rank .. decode_rank + decode_ranks - 1, on one host) keep
              their shards; the other ranks' rows are spread over them (runtime/handoff.py), so each
              decode rank ends with a balanced slice of the tokens. With one decode rank the rows are
              gathered there in sequence order.

Chunk k is thus a partial prefill over the k chunks before it: as the cached part grows the rule
moves from pass-KV towards pass-Q. Peak memory per rank is weights + its KV shard + O(chunk / N)
activations; a decode rank ends with about 1/decode_ranks of the KV cache. Shards are stored in
the cache's kv_dtype (8-bit caches are quantized as each chunk is appended); ring messages carry
the model's dtype.

Prefill on top of an existing cache (a follow-up question on a document) works the same way:
either every rank passes its slice of a split cache (`shard`, used in place as its cached rows),
or the decode rank passes a whole cache (`cache`), which is scattered evenly over the ranks first.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..attention.quant import check_kv_dtype
from ..attention.spans import runs_of
from ..model import KVCache
from ..model.decode_step import FusedPrefill
from ..model.tensor_parallel import split_range
from ..model.transformer import HybridAttend, rope_position_problem
from ..parallel import STRATEGIES, CommStats, ShardLayout, ring_attention
from ..parallel.ring import PASS_KV
from ..parallel.comm import (
    agree_across_ranks, all_gather_bytes, all_gather_ints, collective_device, nbytes, rank_and_world,
)
from .handoff import gather_in_order, received_rows, spread_plan, spread_shards
from .linear_layers import linear_layer_over_ranks
from ..parallel.linear_state import ALL_GATHER, RING
from ..telemetry import Tracer, release_free_memory, reset_peak_rss, span, window_peak_rss_bytes
from ..planning.engine_config import LINEAR_EXCHANGES, STRATEGY_CHOICES

RING_KINDS = ("ring-kv", "ring-q", "all2all")
"""CommStats kinds of the ring attention's messages."""
TP_KINDS = ("all-reduce", "tp-embed", "tp-logits")
"""CommStats kinds of the tensor-parallel collectives (ringctx.model.tensor_parallel)."""
EP_KINDS = ("ep-counts", "ep-dispatch", "ep-combine", "ep-all-reduce")
"""CommStats kinds of the expert-parallel collectives (ringctx.model.expert_parallel)."""
TRIM_FROM_TOKENS = 2048
"""Prefills of at least this many tokens hand freed heap memory back to the OS at their start and
before the hand-off (telemetry.release_free_memory), so that each phase's peak memory is its own;
a question's prefill skips it (~0.6 ms a call, more than 1% of the whole prefill)."""


@dataclass(frozen=True)
class PrefillConfig:
    """How a prefill is cut, sharded and handed off (the same on every rank)."""

    chunk_tokens: int
    """Tokens per chunk; the last chunk may be shorter."""
    strategy: str = "auto"
    """"auto" (the paper's rule with `hardware`), or "pass-kv" / "pass-q" for every chunk."""
    hardware: object = "cpu"
    """HardwareProfile (or built-in profile name or JSON path) that "auto" uses for C and BW."""
    rule: str = "alg5"
    """Decision rule of "auto": "alg1", "alg5" or "empirical" (see ringctx.planning.strategy)."""
    decode_rank: int = 0
    """The first decode rank: it receives the logits, samples, and leads the decode."""
    decode_ranks: int = 1
    """How many ranks (decode_rank, decode_rank + 1, ...; one host) keep the KV cache, split by token."""
    decode_room: int = 256
    """Extra KV rows allocated on each decode rank beyond its rows, for question and generated tokens."""
    kv_dtype: str = "model"
    """How the KV cache is stored: the model's dtype, another float dtype, "fp8" or "int8"."""
    ranks_per_host: int = 0
    """Ranks on each host (consecutive ranks share a host); 0: all ranks on one host. Only for
    reporting the bytes that cross hosts."""
    attn_backend: str = "auto"
    """Backend of the local attention blocks (see ringctx.attention)."""
    trace: bool = False
    """Record a Chrome trace of compute and communication on every rank."""
    linear_exchange: str = "auto"
    """How a hybrid's linear layers send their state summaries between the ranks: "auto" (the
    cheaper by planning/linear_attention.py with `hardware`), "all-gather" or "ring" (a relay)."""


@dataclass
class ChunkStats:
    """What happened to one chunk."""

    index: int
    tokens: int
    """New tokens in the chunk."""
    cached: int
    """Tokens before the chunk (its P)."""
    strategy: str
    reason: str
    """Why this strategy, in full: the rule's condition with every number and constant."""
    seconds: float
    short_reason: str = ""
    """The reason in under 60 characters (the condition, its numbers, the verdict) for a table cell."""
    formula: str = ""
    """The rule with its constants, the same for every chunk of a setting ("" when no rule decided)."""


@dataclass
class PrefillStats:
    """Measurements of one prefill (on the decode rank: every rank's numbers)."""

    tokens: int
    """New tokens prefilled."""
    cached: int
    """Tokens already in the cache before this prefill."""
    world_size: int
    """All ranks: cp_size x tp_size."""
    chunk_tokens: int
    ttft_s: float = 0.0
    """Wall time from the start of the prefill to logits and KV cache on the decode rank."""
    handoff_s: float = 0.0
    """Part of ttft_s spent moving KV shards to the decode ranks."""
    decode_ranks: int = 1
    """Ranks that hold the KV cache after the prefill."""
    cp_size: int = 1
    """CP ranks: the ring's size."""
    tp_size: int = 1
    """Tensor-parallel ranks per CP rank. The per-rank lists below have one entry per CP rank, that
    of its TP rank 0 (the other TP ranks of a CP rank send and hold the same amounts)."""
    kv_dtype: str = "model"
    """Storage of the KV cache."""
    chunks: list[ChunkStats] = field(default_factory=list)
    bytes_sent_per_rank: list[int] = field(default_factory=list)
    """Bytes each rank sent (ring messages, all-to-alls, TP collectives, checks, hand-off)."""
    ring_bytes_per_rank: list[int] = field(default_factory=list)
    """Part of bytes_sent_per_rank that the ring attention sent (ring shifts and pass-Q's all-to-all)."""
    tp_bytes_per_rank: list[int] = field(default_factory=list)
    """Part of bytes_sent_per_rank that the tensor-parallel collectives sent (all-reduces of the
    layers and the embedding, the logits' all-gather), as a ring all-reduce moves them."""
    peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    """Peak resident memory of each rank while it prefilled the chunks (from the start of the
    prefill to the last chunk's logits; Linux VmHWM window, else the process's lifetime peak)."""
    handoff_peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    """Peak resident memory of each rank during the hand-off, when the decode rank gathers the whole
    KV cache (weights + full cache there, weights + shard elsewhere)."""
    kv_shard_bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes of the KV shard each rank held at the end of the chunks (before the hand-off)."""
    handoff_bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes each rank sent in the hand-off (0 on decode ranks, which keep their shards)."""
    handoff_cross_host_bytes_per_rank: list[int] = field(default_factory=list)
    """Part of handoff_bytes_per_rank that left the sender's host."""
    decode_slice_rows_per_rank: list[int] = field(default_factory=list)
    """KV rows (tokens) each rank holds for decoding after the hand-off (0 off the decode ranks)."""
    decode_kv_bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes of those rows each rank keeps over all layers: fewer than rows x bytes per token when a
    document's windowed and chunked layers dropped what later tokens cannot see."""
    ep_bytes_per_rank: list[int] = field(default_factory=list)
    """Part of bytes_sent_per_rank that expert parallelism sent (the counts, the rows to the experts'
    ranks and their outputs back: ringctx.model.expert_parallel)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass
class PrefillResult:
    """The outcome of a prefill on one rank."""

    logits: torch.Tensor
    """float32 [vocab]: logits of the last prompt token (on every rank)."""
    cache: KVCache | None
    """This decode rank's KV cache: the whole sequence in order with one decode rank, else this
    rank's slice (rows in any order, `cache.positions`); None off the decode ranks."""
    stats: PrefillStats
    token_ids: torch.Tensor
    """All tokens of the sequence (earlier ones, then this prefill's), on the decode ranks."""
    trace_events: list[list[dict]] | None = None
    """Chrome-trace events per rank (decode rank, when tracing)."""
    document: object | None = None
    """The Engine's Document of this prefill on the decode ranks, when it was asked to keep one."""


def _broadcast_int(value: int, src: int, group) -> int:
    t = torch.tensor([value], dtype=torch.long, device=collective_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, src) if group else src, group=group)
    return int(t.item())


def decode_rank_list(config: PrefillConfig) -> list[int]:
    """The group-relative ranks that keep the KV cache after the prefill."""
    return list(range(config.decode_rank, config.decode_rank + config.decode_ranks))


def cp_prefill(
    model,
    token_ids: torch.Tensor,
    config: PrefillConfig,
    *,
    group: dist.ProcessGroup | str | None = None,
    cache: KVCache | None = None,
    cache_token_ids: torch.Tensor | None = None,
    shard: KVCache | None = None,
    on_chunk: Callable[[int, int, ChunkStats], None] | None = None,
) -> PrefillResult:
    """Prefill `token_ids` with context parallelism over `group`; call on every rank.

    Args:
        model: a ringctx Transformer (the same weights on every rank).
        token_ids: [T] long, the new tokens, identical on every rank.
        config: chunking, strategy and hand-off options, identical on every rank.
        group: the ranks to use; None: the world; "local": this process alone.
        cache: on the decode rank only, an existing whole KVCache to prefill on top of (None: a
            new prompt). Its tokens are scattered to the ranks as cached tokens first.
        cache_token_ids: the tokens `cache` (or the split cache) holds (kept in the result's token_ids).
        shard: on every rank, this rank's slice of a cache split over all ranks of `group` (all
            of them decode ranks): its rows are used in place as this rank's cached tokens and the
            new rows are appended to it (it may be replaced by a larger one: use result.cache).
        on_chunk: called on every rank after each chunk as on_chunk(done, total, chunk_stats).

    Returns:
        PrefillResult; `cache` on the decode ranks, full stats on every rank.

    The same prefill a step at a time (what a scheduler interleaves with other work) is
    `PrefillRun`: this function runs its chunks one after another.
    """
    run = PrefillRun(model, token_ids, config, group=group, cache=cache, cache_token_ids=cache_token_ids,
                     shard=shard, on_chunk=on_chunk)
    while not run.done:
        run.step()
    return run.finish()


class PrefillRun:
    """One CP prefill on this rank, cut into the steps a scheduler may interleave with other work.

        run = PrefillRun(model, token_ids, config, group=...)   # agree on the inputs, plan the shards
        while not run.done:
            run.step()                                           # the next chunk, on every rank
        result = run.finish()                                    # hand-off to the decode ranks

    Every rank of `group` makes the same calls in the same order (each is collective); between
    two calls a rank may run other collectives on other groups or on this one (another prefill's
    chunk, a decode step), as long as every rank does the same. Arguments as `cp_prefill`'s.
    Construction raises ValueError on every rank alike for bad input, before any ring message.
    """

    def __init__(self, model, token_ids: torch.Tensor, config: PrefillConfig, *,
                 group: dist.ProcessGroup | str | None = None, cache: KVCache | None = None,
                 cache_token_ids: torch.Tensor | None = None, shard: KVCache | None = None,
                 on_chunk: Callable[[int, int, ChunkStats], None] | None = None, drop_unseen: bool = False,
                 own_cached: bool = False, checkpoint=None):
        """drop_unseen: the decode ranks' caches of windowed and chunked layers keep only the rows
        tokens after the prompt see, once it is handed off (KVCache.drop_unseen: a document's);
        each rank's shard drops what the next chunk no longer sees after every chunk too.
        own_cached: `shard`'s rows (every rank's) are this prefill's own, the tokens
        `cache_token_ids` that an earlier run of it prefilled (a resumed ingest,
        runtime/checkpoint.py): they are handed off to the decode ranks with the new rows.
        checkpoint: a `ChunkWriter`: each chunk's new rows on this rank are appended to it as the
        chunk completes (CP rank 0's with the linear-attention states, and the last chunk's logits)."""
        rank, world = rank_and_world(group)
        self.own_cached, self.checkpoint = own_cached, checkpoint
        self.drop_unseen = drop_unseen
        self.model, self.token_ids, self.config, self.group = model, token_ids, config, group
        self.rank, self.world, self.cache, self.cache_token_ids = rank, world, cache, cache_token_ids
        self.on_chunk = on_chunk
        self.t_start = time.perf_counter()
        if token_ids.numel() >= TRIM_FROM_TOKENS:
            release_free_memory()
        reset_peak_rss()  # memory is reported per phase: this prefill's chunks, then the hand-off
        self.tracer = Tracer(rank) if config.trace else None
        self.comm = comm = CommStats()

        # --- agree on the inputs before any ring communication ------------------------------------
        problem = _local_problem(model, token_ids, config, world, rank, cache, shard, own_cached)
        if shard is not None:
            held = all_gather_ints([shard.length if problem is None else 0], group, world)
            held = [h[0] for h in held]
        else:
            cached_len = cache.length if (cache is not None and rank == config.decode_rank) else 0
            if world > 1:
                valid_decode_rank = config.decode_rank if 0 <= config.decode_rank < world else 0
                cached_len = _broadcast_int(cached_len, valid_decode_rank, group)
            held = [b - a for a, b in (split_range(cached_len, world, r) for r in range(world))]
        self.cached_len = cached_len = sum(held)
        if problem is None:  # every rank knows the whole length: all refuse together, before the ring
            problem = rope_position_problem(model.config, cached_len + int(token_ids.numel()))
        if world > 1:
            agree_across_ranks("prefill", problem, _signature(model, token_ids, config, cached_len), group, comm)
        elif problem:
            raise ValueError(f"prefill: {problem}")

        self.T = T = int(token_ids.numel())
        chunk = config.chunk_tokens
        self.chunks = [(s, min(s + chunk, T)) for s in range(0, T, chunk)]

        # --- the sharding plan: every rank computes every chunk's layout (they are tiny) ----------
        # a resumed ingest hands off its restored rows too: from its first row on
        self.first_new_row = 0 if own_cached else held[rank]
        self.layouts = []
        # Windowed and chunked layers see cached rows by position: every rank's runs of positions,
        # extended chunk by chunk (None: every layer sees all cached rows, positions not needed).
        base_runs = self._cached_runs(shard, held, cached_len, group) if model.has_spans or own_cached else None
        runs = base_runs if model.has_spans else None
        # every rank's own rows before the first chunk (positions), which the hand-off moves too
        self.base_positions = [torch.cat([torch.arange(p, p + n) for p, n in r] or [torch.empty(0, dtype=torch.long)])
                               for r in base_runs] if own_cached else [torch.empty(0, dtype=torch.long)] * world
        for s, e in self.chunks:
            layout = ShardLayout.balanced([e - s], world, cached_counts=[[h] for h in held],
                                          cached_runs=None if runs is None else [[r] for r in runs])
            self.layouts.append(layout)
            held = [h + layout.num_new(r) for r, h in enumerate(held)]
            if runs is not None:
                runs = [r + layout.new_runs(i) for i, r in enumerate(runs)]
        decoders = decode_rank_list(config)
        spread = config.decode_ranks > 1 and (shard is None or own_cached) and world > config.decode_ranks
        self.plan = spread_plan(held, decoders) if spread else []
        rows = held[rank] + received_rows(self.plan, rank)

        cfg = model.config
        dtype, device = model.dtype, model.device
        # One rank with a new prompt: its shard is the whole prompt in order, so the shard buffers are
        # allocated with decode room and become the decode cache without a copy. Decode ranks that
        # keep their shard (several decode ranks) get their room now too.
        # A split cache on one rank (a question under tensor parallelism with one decode rank) is its
        # whole cache, in order, and grows in place too.
        in_place = world == 1 and (cached_len == 0 or shard is not None)
        self.keeps_shard = in_place or (config.decode_ranks > 1 and rank in decoders)
        if self.keeps_shard:
            rows += config.decode_room
        if shard is not None:
            shard = shard.grown(rows)
        else:
            # in ordinary pages: the first touch of 2 MiB pages stalled the chunks writing it (on a VM
            # up to 5.8 s per GiB: an 8K-token document's first chunk took 1.5 s instead of 0.3 s);
            # decode steps over it take ~1.04x their time from 2 MiB pages (docs/BENCHMARKS.md)
            shard = KVCache.for_model(cfg, max(rows, 1), dtype=dtype, device=device, kv_dtype=config.kv_dtype,
                                      sliced=not in_place, small_pages=True)
            if cached_len:
                _scatter_cache(cache, shard, cached_len, rank, world, config.decode_rank, group, comm)
        self.shard = shard
        self.linear_exchange = _linear_exchange(model, world, config)
        self.stats = PrefillStats(tokens=T, cached=cached_len, world_size=world * model.tp.size, chunk_tokens=chunk,
                                  decode_ranks=config.decode_ranks, kv_dtype=config.kv_dtype, cp_size=world,
                                  tp_size=model.tp.size)
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=device)
        self.next_chunk = 0
        self._slice: _ChunkInProgress | None = None  # a chunk that step(layers=...) has begun

    def _cached_runs(self, shard, held, cached_len, group) -> list[list[tuple[int, int]]]:
        """Every rank's (position, rows) runs of its cached rows before the first chunk: a split
        cache's own positions (one small all-gather of runs), else the contiguous split of the
        decode rank's whole cache (`_scatter_cache`)."""
        if shard is None:
            bounds = [split_range(cached_len, self.world, r) for r in range(self.world)]
            return [[(a, b - a)] if b > a else [] for a, b in bounds]
        mine = runs_of(shard.row_positions()[:held[self.rank]])
        flat = torch.tensor([x for r in mine for x in (r.position, r.length)], dtype=torch.long)
        everyone = all_gather_bytes(flat.numpy().tobytes(), group, self.world)
        out = []
        for data in everyone:
            values = torch.frombuffer(bytearray(data), dtype=torch.long).tolist() if data else []
            out.append([(values[i], values[i + 1]) for i in range(0, len(values), 2)])
        return out

    @property
    def done(self) -> bool:
        """Whether every chunk has run (then `finish`)."""
        return self.next_chunk == len(self.chunks)

    @property
    def total_chunks(self) -> int:
        return len(self.chunks)

    @property
    def layer_in_chunk(self) -> int:
        """Layers of the current chunk already run by `step(layers=...)` (0 between two chunks)."""
        return 0 if self._slice is None else self._slice.next_layer

    def step(self, layers: int | None = None) -> ChunkStats | None:
        """Run the next chunk on this rank (with every other rank of the group) and return its stats.

        layers: run only the next `layers` layers of the current chunk (a slice of it) and return
        None until its last layer has run, then its stats. A chunk run in slices gives the same bits
        as run whole (the same operations on the same data, with pauses between layers), so a
        scheduler may cut it wherever it likes; every rank must be given the same slices."""
        if self.done:
            raise RuntimeError("every chunk of this prefill has run: call finish()")
        if layers is not None and layers < 1:
            raise ValueError(f"a prefill slice runs at least one layer, got layers={layers}")
        n_layers = len(self.model.layers)
        t0 = time.perf_counter()
        # The modes are entered per slice: between two slices this rank may run other work.
        with torch.inference_mode(), (self.tracer or contextlib.nullcontext()), _counting_tp(self.model, self.comm):
            if self._slice is None:
                self._slice = self._begin_chunk()
            chunk = self._slice
            end = n_layers if layers is None else min(n_layers, chunk.next_layer + layers)
            with span(f"chunk {chunk.index}", "compute", strategy=chunk.record.strategy,
                      layers=f"{chunk.next_layer}-{end - 1}"):
                if chunk.fused is not None:  # the same kernels in one call: the same bits
                    chunk.x = chunk.fused(chunk.x, chunk.rope, self.shard, chunk.rows_before, chunk.next_layer, end)
                else:
                    for layer_index in range(chunk.next_layer, end):
                        chunk.x = self.model.layers[layer_index](chunk.x, chunk.rope, chunk.attend, layer_index)
                chunk.next_layer = end
                if end == n_layers and chunk.index == len(self.chunks) - 1:
                    self.logits = _last_token_logits(self.model, chunk.x, chunk.layout, self.rank, self.world,
                                                     self.group, self.logits)
        chunk.seconds += time.perf_counter() - t0
        return self._end_chunk() if end == n_layers else None

    def _begin_chunk(self) -> "_ChunkInProgress":
        """The next chunk's strategy, this rank's rows embedded, their RoPE, and its attention (in
        step's modes: the embedding is a TP collective)."""
        index = self.next_chunk
        (s, e), layout = self.chunks[index], self.layouts[index]
        model, rank, group, config, shard = self.model, self.rank, self.group, self.config, self.shard
        strategy, reason, short_reason, formula = _decide(e - s, self.cached_len + s, model, self.world, config)
        rows_before = layout.num_cached(rank)

        lengths = layout.piece_lengths(rank)

        def mix_linear(layer: int, module, x):
            # a linear-attention layer: the state crosses the ranks in two small exchanges, not a KV
            # ring (runtime/linear_layers.py); after an all-gather every rank's shard holds the
            # chunk's end state, after a relay rank 0's (`_share_linear_states` before the hand-off)
            y, shard.linear_states[layer] = linear_layer_over_ranks(module, x, lengths, shard.linear_states[layer],
                                                                    group, self.comm, layer, self.linear_exchange)
            return y

        def attend(layer: int, q, k, v):
            cached = {}
            if rows_before:  # views of the shard; a dequantized copy of it for 8-bit caches
                # (a document's windowed or chunked layer holds its rows from kept_from on)
                first = min(shard.kept_from(layer), rows_before)
                cached_k, cached_v = shard.read_rows(layer, first, rows_before)
                cached = dict(cached_k=cached_k, cached_v=cached_v, cached_from=first)
            # Inputs were agreed across ranks once for the whole prefill (above): no per-layer check.
            softmax = model.layer_softmax(layer)
            out, lse = ring_attention(q, k, v, layout, strategy=strategy, group=group, stats=self.comm,
                                      check_across_ranks=False, backend=config.attn_backend, softmax=softmax,
                                      **cached)
            shard.update(layer, rows_before, k, v)
            return softmax.finish(out, lse)

        x = model.embed(layout.shard(self.token_ids[s:e].to(model.device), rank))
        positions = layout.positions(rank).to(model.device)
        rope = model.rope(positions, sequence_end=self.cached_len + self.T)  # the whole prompt's (LongRoPE)
        record = ChunkStats(index, e - s, self.cached_len + s, strategy, reason, 0.0, short_reason, formula)
        return _ChunkInProgress(index, layout, record, HybridAttend(attend, mix_linear) if model.config.has_linear
                                else attend, x, positions, rope, rows_before, self._fused_prefill(e - s, rows_before))

    def _fused_prefill(self, rows: int, rows_before: int) -> FusedPrefill | None:
        """The fused prefill for a chunk of `rows` tokens after `rows_before` rows of this rank's shard
        where it gives the layer-by-layer path's bits (one rank: a question's tokens over its
        document on a CPU without bf16 units), else None."""
        if self.world != 1 or self.model.tp.size != 1:
            return None
        fused = FusedPrefill.build(self.model)  # kept per model
        return fused if fused is not None and fused.takes(rows, self.shard, rows_before,
                                                          self.config.attn_backend) else None

    def _end_chunk(self) -> ChunkStats:
        """Account for the chunk whose last layer has run: its record in the checkpoint, the shard's
        new rows, its stats."""
        chunk = self._slice
        self._slice = None
        record = chunk.record
        record.seconds = chunk.seconds
        if self.checkpoint is not None:  # before `_chunk_in` drops rows: every new row is still stored
            self._checkpoint_chunk(chunk, chunk.layout.num_new(self.rank))
        self._chunk_in(chunk.index, chunk.positions, record)
        if self.on_chunk is not None:
            self.on_chunk(chunk.index + 1, len(self.chunks), record)
        return record

    def _chunk_in(self, index: int, positions: torch.Tensor, record: ChunkStats) -> None:
        """Chunk `index`'s rows are in the shard (computed, or restored): their positions, the
        shard's length, its stats; then what the next chunk's tokens no longer see leaves memory
        now, not at the hand-off (a windowed layer's shard stays about its window however long the
        prompt)."""
        shard, layout = self.shard, self.layouts[index]
        rows_before, n_new = layout.num_cached(self.rank), layout.num_new(self.rank)
        if shard.positions is not None:
            shard.positions[rows_before:rows_before + n_new] = positions.cpu()
        shard.length = rows_before + n_new
        if self.drop_unseen and self.model.has_spans and shard.in_position_order():
            shard.drop_unseen(self.model.config.layer_spans, self.cached_len + self.chunks[index][1], in_place=True)
        self.stats.chunks.append(record)
        self.next_chunk += 1

    def _checkpoint_chunk(self, chunk: "_ChunkInProgress", n_new: int) -> None:
        """Hand this rank's rows of the chunk (copies) to the checkpoint's writer: CP rank 0's with
        the linear-attention states at the chunk's end, and the last chunk's with its logits."""
        from .checkpoint import rows_record

        lead = self.rank == 0
        tensors = rows_record(self.shard, chunk.rows_before, chunk.rows_before + n_new, chunk.positions,
                              states=lead and self.model.config.has_linear)
        if lead and chunk.index == len(self.chunks) - 1:
            tensors["logits"] = self.logits.detach().to("cpu", copy=True)
        self.checkpoint.append({"kind": "chunk", "chunk": chunk.index, "rows": n_new,
                                "stats": asdict(chunk.record)}, tensors)

    def restore(self, chunks: list[dict], read: Callable[[dict], dict]) -> None:
        """Put back the first `len(chunks)` chunks of this prefill as a run of it that stopped after
        them left them (a resumed ingest: runtime/checkpoint.py), before any step: this rank's rows
        of each (`read(record)` gives a record's tensors, as `_checkpoint_chunk` wrote them), its
        stats, and from CP rank 0 the linear-attention states at the last one's end and, when every
        chunk is back, the last token's logits. The same mesh, settings and tokens as that run
        (the caller checked them) give the same layouts, so the shard is the one it held.
        Collective; a record that does not fit (altered, or another layout) is a ValueError on every rank."""
        if self.next_chunk or self._slice is not None:
            raise RuntimeError("restore() comes before the first step")
        from ..model.gated_deltanet import LinearState

        shard, rank, problem, last = self.shard, self.rank, None, None
        names = ["k", "v"] + (["k_scale", "v_scale"] if shard.quantized else [])
        try:
            for record in chunks:
                index = self.next_chunk
                layout = self.layouts[index]
                rows_before, n_new = layout.num_cached(rank), layout.num_new(rank)
                tensors = read(record)
                if int(record["rows"]) != n_new or not torch.equal(tensors["positions"], layout.positions(rank)):
                    raise ValueError(f"chunk {index}'s rows on rank {rank} are not the ones this prefill's layout "
                                     "gives it")
                for layer in range(shard.n_layers):
                    if shard.shapes[layer][0] == 0:
                        continue
                    for target, name in zip(shard.stored_rows(layer, rows_before, rows_before + n_new), names):
                        target.copy_(tensors[f"{name}.{layer}"])
                self._chunk_in(index, tensors["positions"], ChunkStats(**record["stats"]))
                last = tensors
        except (ValueError, OSError, KeyError, RuntimeError) as exc:
            problem = f"the checkpoint does not resume: {exc}; start over with --restart (restart=True)"
        if self.world > 1:
            agree_across_ranks("resume", problem, "resume", self.group, self.comm)
        elif problem:
            raise ValueError(problem)
        if last is None:
            return
        src = dist.get_global_rank(self.group, 0) if self.world > 1 and self.group is not None else 0
        for layer, state in enumerate(shard.linear_states or ()):
            if state is None:
                continue
            if rank == 0:
                state = shard.linear_states[layer] = LinearState(last[f"linear_conv.{layer}"].to(state.conv),
                                                                 last[f"linear_state.{layer}"].to(state.recurrent))
            if self.world > 1:
                dist.broadcast(state.conv, src=src, group=self.group)
                dist.broadcast(state.recurrent, src=src, group=self.group)
        if self.done:
            if rank == 0:
                self.logits.copy_(last["logits"])
            if self.world > 1:
                dist.broadcast(self.logits, src=src, group=self.group)

    def _row_positions(self) -> list[torch.Tensor]:
        """Every rank's rows' positions in its shard's order: its restored rows' (a resumed ingest's),
        then each chunk's."""
        return [torch.cat([self.base_positions[r]] + [layout.positions(r) for layout in self.layouts])
                for r in range(self.world)]

    def finish(self) -> PrefillResult:
        """Hand the KV cache off to the decode ranks and gather every rank's numbers (collective)."""
        if not self.done:
            raise RuntimeError(f"{len(self.chunks) - self.next_chunk} chunk(s) of this prefill have not run yet")
        model, rank, world, group, config, shard, comm = (self.model, self.rank, self.world, self.group, self.config,
                                                          self.shard, self.comm)
        stats = self.stats
        with torch.inference_mode(), (self.tracer or contextlib.nullcontext()), _counting_tp(model, comm):
            # --- hand-off ---------------------------------------------------------------------------
            prefill_peak_rss = window_peak_rss_bytes()
            shard_bytes = shard.stored_bytes
            if self.token_ids.numel() >= TRIM_FROM_TOKENS:  # the chunks' freed activations, before the
                release_free_memory()                       # decode ranks fill their caches
            reset_peak_rss()
            t_handoff = time.perf_counter()
            if self.linear_exchange == RING and world > 1:  # the relay left the end states on rank 0 only
                _share_linear_states(shard, group, comm)
            with span("hand-off", "comm"):
                out_cache, moved = _hand_off(model, self.cache, shard, self._row_positions(), self.plan,
                                             self.first_new_row,
                                             self.cached_len, self.T, config, rank, world, group, comm,
                                             self.keeps_shard, self.drop_unseen)
            if self.drop_unseen and out_cache is not None:
                out_cache.drop_unseen(model.config.layer_spans, self.cached_len + self.T)
            stats.handoff_s = time.perf_counter() - t_handoff
        stats.ttft_s = time.perf_counter() - self.t_start

        if self.checkpoint is not None:  # the last records on disk before any rank returns
            self.checkpoint.close()
        slice_rows = out_cache.length if out_cache is not None else 0
        kept_bytes = out_cache.stored_bytes if out_cache is not None else 0
        ring = sum(comm.bytes_sent(kind) for kind in RING_KINDS)
        tp = sum(comm.bytes_sent(kind) for kind in TP_KINDS)
        ep = sum(comm.bytes_sent(kind) for kind in EP_KINDS)
        per_rank = all_gather_ints([comm.bytes_sent(), ring, tp, prefill_peak_rss, window_peak_rss_bytes(),
                                    shard_bytes, moved["sent"], moved["cross_host"], slice_rows, kept_bytes, ep], group,
                                   world)
        (stats.bytes_sent_per_rank, stats.ring_bytes_per_rank, stats.tp_bytes_per_rank, stats.peak_rss_bytes_per_rank,
         stats.handoff_peak_rss_bytes_per_rank,
         stats.kv_shard_bytes_per_rank, stats.handoff_bytes_per_rank, stats.handoff_cross_host_bytes_per_rank,
         stats.decode_slice_rows_per_rank, stats.decode_kv_bytes_per_rank,
         stats.ep_bytes_per_rank) = (list(column) for column in zip(*per_rank))
        all_ids = self.token_ids.cpu()
        if self.cache_token_ids is not None:
            all_ids = torch.cat([self.cache_token_ids.cpu(), all_ids])
        trace = _gather_trace(self.tracer, group, world) if config.trace else None
        return PrefillResult(logits=self.logits, cache=out_cache, stats=stats, token_ids=all_ids,
                             trace_events=trace if rank == config.decode_rank else None)


@dataclass
class _ChunkInProgress:
    """A chunk between two slices: this rank's hidden rows after `next_layer` layers, and what its
    remaining layers need."""

    index: int
    layout: ShardLayout
    record: ChunkStats
    attend: Callable
    x: torch.Tensor
    positions: torch.Tensor
    rope: object
    rows_before: int
    fused: FusedPrefill | None = None
    """The chunk's layers in one C call, where they take the kernels of that call (one rank)."""
    next_layer: int = 0
    seconds: float = 0.0
    """Time this rank spent on the chunk's slices (not the time between them)."""


def _local_problem(model, token_ids, config, world, rank, cache, shard, own_cached=False) -> str | None:
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        return "token_ids must be a 1-D tensor of token ids"
    if token_ids.dtype not in (torch.long, torch.int32, torch.int64):
        return f"token_ids must be integers, got {token_ids.dtype}"
    if token_ids.numel() == 0:
        return "the prompt is empty: give at least one token"
    lo, hi = int(token_ids.min()), int(token_ids.max())
    if lo < 0 or hi >= model.config.vocab_size:
        bad = lo if lo < 0 else hi
        return f"token id {bad} is outside the vocabulary [0, {model.config.vocab_size}); tokenize with this model"
    if not 0 <= config.decode_rank < world:
        return f"decode_rank {config.decode_rank} is not a rank of this {world}-rank group"
    if not 1 <= config.decode_ranks <= world - config.decode_rank:
        return (f"decode_ranks={config.decode_ranks} does not fit this {world}-rank group from decode rank "
                f"{config.decode_rank}: use 1 to {world - config.decode_rank}")
    try:
        check_kv_dtype(config.kv_dtype)
    except ValueError as exc:
        return str(exc)
    if shard is not None:
        if config.decode_ranks != world and not own_cached:
            return (f"a split cache is prefilled on its decode ranks only: the group has {world} ranks but "
                    f"decode_ranks={config.decode_ranks}")
        if cache is not None:
            return "give either a whole cache (decode rank) or this rank's slice (shard), not both"
        problem = _cache_problem(model, shard, config)
        if problem:
            return problem
    if config.chunk_tokens < 1:
        return f"chunk_tokens must be >= 1, got {config.chunk_tokens}"
    if config.strategy not in STRATEGY_CHOICES:
        return f"unknown strategy {config.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}"
    if config.linear_exchange not in LINEAR_EXCHANGES:
        return f"unknown linear_exchange {config.linear_exchange!r}; use one of {', '.join(LINEAR_EXCHANGES)}"
    if cache is not None and rank == config.decode_rank:
        return _cache_problem(model, cache, config)
    return None


def _cache_problem(model, cache: KVCache, config: PrefillConfig) -> str | None:
    try:
        cache.check_model(model.config)
    except ValueError as exc:
        return str(exc)
    if cache.dtype != model.dtype:
        return f"the KV cache is {cache.dtype} but the model runs in {model.dtype}; load both in one dtype"
    if cache.kv_dtype != config.kv_dtype:
        return (f"the KV cache is stored as {cache.kv_dtype!r} but this prefill asks for kv_dtype="
                f"{config.kv_dtype!r}; use the cache's kv_dtype")
    return None


def _signature(model, token_ids, config, cached_len) -> str:
    digest = hashlib.sha256(token_ids.cpu().numpy().tobytes()).hexdigest()[:16] if token_ids.dim() == 1 else "?"
    return (f"model={model.config.fingerprint()} dtype={model.dtype} tokens={token_ids.numel()} ids={digest} "
            f"cached={cached_len} chunk={config.chunk_tokens} strategy={config.strategy} rule={config.rule} "
            f"decode_rank={config.decode_rank} decode_ranks={config.decode_ranks} kv_dtype={config.kv_dtype}")


def _decide(new_tokens: int, cached_tokens: int, model, world: int,
            config: PrefillConfig) -> tuple[str, str, str, str]:
    """The chunk's strategy, the reason as a sentence, the reason in short, and the rule's formula."""
    if world == 1:
        return PASS_KV, "one rank: nothing travels", "one rank: nothing travels", ""
    from ..planning.strategy import pass_kv_only

    only = pass_kv_only(model.full_config)
    if only:
        return PASS_KV, only, only, ""
    if config.strategy != "auto":
        forced = f"forced: strategy={config.strategy}"
        return config.strategy, forced, forced, ""
    from ..planning.strategy import choose_strategy

    dtype = str(model.dtype).removeprefix("torch.")
    # Under tensor parallelism the ring carries this TP rank's heads: the rule sees heads per TP rank.
    choice = choose_strategy(new_tokens, cached_tokens, model.full_config, world, config.hardware, config.rule,
                             dtype=dtype, tp_size=model.tp.size)
    return choice.strategy, choice.reason, choice.short_reason, choice.formula


def _linear_exchange(model, world: int, config: PrefillConfig) -> str:
    """How this prefill's linear layers send their state summaries (ALL_GATHER without any)."""
    if not model.config.has_linear or world == 1:
        return ALL_GATHER
    if config.linear_exchange != "auto":
        return config.linear_exchange
    from ..planning.strategy import choose_linear_exchange

    dtype = str(model.dtype).removeprefix("torch.")
    return choose_linear_exchange(model.full_config, world, config.hardware, dtype, model.tp.size).strategy


def _share_linear_states(shard, group, comm) -> None:
    """Every rank takes rank 0's linear-layer recurrent states (the chunks' end, which a relay
    leaves there alone), so that whichever ranks decode start from them."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for layer, state in enumerate(shard.linear_states or ()):
        if state is not None:
            dist.broadcast(state.recurrent, src=src, group=group)
            comm.record("linear-state", layer, nbytes(state.recurrent))


def _last_token_logits(model, x, layout, rank, world, group, logits):
    """Logits of the chunk's last token, computed by the rank holding it and broadcast to all."""
    last = layout.total_new - 1
    owner = next(r for r in range(world) if (layout.new_token_index(r) == last).any())
    if rank == owner:
        row = int((layout.new_token_index(rank) == last).nonzero()[0])
        logits = model.head(model.norm(x[row:row + 1]))[0].float()
    if world > 1:
        dist.broadcast(logits, src=dist.get_global_rank(group, owner) if group else owner, group=group)
    return logits


def _scatter_cache(cache, shard, cached_len, rank, world, decode_rank, group, comm) -> None:
    """Split the decode rank's whole cache evenly (contiguous rows) over the ranks, layer by layer."""
    if cache is not None and cache.trimmed:
        raise ValueError("a prefill on top of a whole cache whose windowed or chunked layers dropped rows runs on "
                         "one rank (its rows cannot be split evenly over several): ask about it as a Document")
    bounds = [split_range(cached_len, world, r) for r in range(world)]
    rows = max(b - a for a, b in bounds)
    lo, hi = bounds[rank]
    src = dist.get_global_rank(group, decode_rank) if (group is not None and world > 1) else decode_rank
    for layer in range(shard.n_layers):
        for j, target in enumerate(shard.storage_tensors(layer)):
            if world == 1:
                target[:hi - lo] = cache.storage_tensors(layer)[j][lo:hi]
                continue
            recv = target.new_empty((rows, *target.shape[1:]))
            pieces = None
            if rank == decode_rank:
                source = cache.storage_tensors(layer)[j]
                pieces = []
                for a, b in bounds:
                    piece = recv.new_zeros(recv.shape)
                    piece[:b - a] = source[a:b]
                    pieces.append(piece.view(torch.uint8))
                comm.record("scatter", layer, (world - 1) * nbytes(recv))
            dist.scatter(recv.view(torch.uint8), pieces, src=src, group=group)
            target[:hi - lo] = recv[:hi - lo]
    for layer, state in enumerate(shard.linear_states or ()):  # a hybrid's states: the same on every rank
        if state is None:
            continue
        source = cache.linear_states[layer] if rank == decode_rank else None
        for part in ("conv", "recurrent"):
            target = getattr(state, part)
            if source is not None:
                target.copy_(getattr(source, part))
            if world > 1:
                dist.broadcast(target, src=src, group=group)
                if rank == decode_rank:
                    comm.record("scatter", layer, (world - 1) * nbytes(target))
    if shard.positions is not None:
        shard.positions[:hi - lo] = torch.arange(lo, hi)
    shard.length = hi - lo


def _hand_off(model, cache, shard, positions, plan, first_new_row, cached_len, T, config, rank, world, group, comm,
              keeps_shard, drop_unseen=False):
    """Leave the KV cache on the decode ranks: (this rank's decode cache or None, bytes moved).

    Several decode ranks: they keep their shards and receive the others' rows (`spread_plan`).
    One decode rank: every rank's new rows are gathered there in sequence order (into `cache` when
    it was given, else a new cache), as the single-rank decode and the KV files expect; with
    drop_unseen a new cache holds only the rows later tokens see of its windowed layers.
    """
    none = {"sent": 0, "cross_host": 0}
    if world == 1 and keeps_shard:  # the shard is the sequence in order (see cp_prefill)
        return shard, none
    if config.decode_ranks > 1:
        per_host = config.ranks_per_host or world
        moved = spread_shards(shard, plan, rank, group if world > 1 else None, host_of=lambda r: r // per_host,
                              comm=comm)
        if keeps_shard:
            shard.length += received_rows(plan, rank)
            for t in plan:  # every rank knows every row's position: none travel
                if t.dst == rank:
                    src_positions = positions[t.src]  # (a resumed ingest's: its restored rows', then the chunks')
                    shard.positions[t.dst_start:t.dst_start + t.n] = src_positions[t.src_start:t.src_start + t.n]
            return shard, moved
        return None, moved
    decode = config.decode_rank
    out = None
    if rank == decode:
        need = cached_len + T + config.decode_room
        if cache is None:  # in ordinary pages, as the shards (a server moves it into 2 MiB ones when idle)
            spans = model.config.layer_spans
            # row = position: a windowed layer's rows start where the next token's window does
            kept = [0 if span.sees_everything else span.first_visible(cached_len + T) for span in spans] \
                if drop_unseen else None
            out = KVCache.for_model(model.config, need, dtype=model.dtype, device=model.device,
                                    kv_dtype=config.kv_dtype, small_pages=True, kept=kept)
            if drop_unseen:
                out.spans = spans
        else:
            out = cache.grown(need)
            out.length = cached_len
    sent = gather_in_order(shard, out, positions, first_new_row, rank, world, decode, group if world > 1 else None,
                           comm)
    if out is not None:
        out.length = cached_len + T
        if shard.linear_states is not None:  # the chunks' end state, the same on every rank: the decode rank's own
            out.linear_states = [None if st is None else st.clone() for st in shard.linear_states]
    per_host = config.ranks_per_host or world
    cross = sent if rank // per_host != decode // per_host else 0
    return out, {"sent": sent, "cross_host": cross}


@contextlib.contextmanager
def _counting_tp(model, comm: CommStats):
    """Count the TP (and EP) collectives' bytes in `comm` while the prefill runs (nothing without them)."""
    counted = [p for p in (model.tp, model.ep) if p.size > 1]  # never NO_TP / NO_EP, which every model shares
    for p in counted:
        p.stats = comm
    try:
        yield
    finally:
        for p in counted:
            p.stats = None


def _gather_trace(tracer, group, world: int) -> list[list[dict]]:
    """Every rank's trace events (as JSON bytes: no pickling between ranks)."""
    import json

    return [json.loads(data) for data in all_gather_bytes(json.dumps(tracer.events).encode(), group, world)]
