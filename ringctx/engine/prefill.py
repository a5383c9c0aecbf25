"""Chunked context-parallel prefill, run on every rank, and the KV hand-off to the decode rank.

    prompt [T] ──cut into chunks of C tokens──▶ chunk 0, chunk 1, ... chunk k
    for each chunk:
        ShardLayout.balanced(chunk, N, cached_counts = rows each rank already holds)
        each rank: embed its rows, then layer by layer
            q, k, v (RoPE at global positions) -> ring_attention(q, k, v, cached = this rank's shard)
            append this rank's k, v of the chunk to its KV shard          (the shard never leaves the rank)
        the strategy of the chunk: pass-KV or pass-Q (the paper's rule, or forced)
    hand-off: layer by layer, every rank's shard is gathered to the decode rank and written into
              the decode KVCache at the tokens' positions (sequence order)

Chunk k is thus a partial prefill over the k chunks before it: as the cached part grows the rule
moves from pass-KV towards pass-Q. Peak memory per rank is weights + its KV shard + O(chunk / N)
activations; only the decode rank ever holds the whole KV cache, after the prefill.

Prefill on top of an existing cache (a follow-up question on a saved document) works the same way:
the decode rank scatters the cache evenly over the ranks first (its rows are "cached tokens" that
every new token sees), then the new tokens are prefilled and only their K/V are gathered back.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..attention.cuda_ext import scatter_kv
from ..model import KVCache
from ..parallel import CommStats, ShardLayout, ring_attention
from ..parallel.comm import agree_across_ranks, nbytes, rank_and_world
from ..telemetry import Tracer, release_free_memory, reset_peak_rss, span, window_peak_rss_bytes

STRATEGY_CHOICES = ("auto", "pass-kv", "pass-q")


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
    """Decision rule of "auto": "alg1", "alg5" or "empirical" (see ringctx.parallel.strategy)."""
    decode_rank: int = 0
    """Rank that receives the KV cache and the logits, and decodes."""
    decode_room: int = 256
    """Extra KV rows allocated on the decode rank beyond the prompt, for generated tokens."""
    attn_backend: str = "auto"
    """Backend of the local attention blocks (see ringctx.attention)."""
    trace: bool = False
    """Record a Chrome trace of compute and communication on every rank."""


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
    seconds: float


@dataclass
class PrefillStats:
    """Measurements of one prefill (on the decode rank: every rank's numbers)."""

    tokens: int
    """New tokens prefilled."""
    cached: int
    """Tokens already in the cache before this prefill."""
    world_size: int
    chunk_tokens: int
    ttft_s: float = 0.0
    """Wall time from the start of the prefill to logits and KV cache on the decode rank."""
    handoff_s: float = 0.0
    """Part of ttft_s spent gathering the KV shards to the decode rank."""
    chunks: list[ChunkStats] = field(default_factory=list)
    bytes_sent_per_rank: list[int] = field(default_factory=list)
    """Bytes each rank sent (ring messages, all-to-alls, checks, hand-off)."""
    peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    """Peak resident memory of each rank while it prefilled the chunks (from the start of the
    prefill to the last chunk's logits; Linux VmHWM window, else the process's lifetime peak)."""
    handoff_peak_rss_bytes_per_rank: list[int] = field(default_factory=list)
    """Peak resident memory of each rank during the hand-off, when the decode rank gathers the whole
    KV cache (weights + full cache there, weights + shard elsewhere)."""
    kv_shard_bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes of the KV shard each rank held at the end of the prefill."""

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
    """The decode KVCache in sequence order (decode rank only; None elsewhere)."""
    stats: PrefillStats
    token_ids: torch.Tensor
    """All tokens the cache holds (earlier ones, then this prefill's), on the decode rank."""
    trace_events: list[list[dict]] | None = None
    """Chrome-trace events per rank (decode rank, when tracing)."""


def _even_split(total: int, world: int, rank: int) -> tuple[int, int]:
    return rank * total // world, (rank + 1) * total // world


def _broadcast_int(value: int, src: int, group) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.broadcast(t, src=dist.get_global_rank(group, src) if group else src, group=group)
    return int(t.item())


def cp_prefill(
    model,
    token_ids: torch.Tensor,
    config: PrefillConfig,
    *,
    group: dist.ProcessGroup | str | None = None,
    cache: KVCache | None = None,
    cache_token_ids: torch.Tensor | None = None,
    on_chunk: Callable[[int, int, ChunkStats], None] | None = None,
) -> PrefillResult:
    """Prefill `token_ids` with context parallelism over `group`; call on every rank.

    Args:
        model: a ringctx Transformer (the same weights on every rank).
        token_ids: [T] long, the new tokens, identical on every rank.
        config: chunking, strategy and hand-off options, identical on every rank.
        group: the ranks to use; None: the world; "local": this process alone.
        cache: on the decode rank only, an existing KVCache to prefill on top of (None: a new
            prompt). Its tokens are scattered to the ranks as cached tokens first.
        cache_token_ids: the tokens `cache` holds (kept in the result's token_ids).
        on_chunk: called on every rank after each chunk as on_chunk(done, total, chunk_stats).

    Returns:
        PrefillResult; `cache` and full stats on the decode rank.
    """
    rank, world = rank_and_world(group)
    distributed = world > 1
    t_start = time.perf_counter()
    release_free_memory()
    reset_peak_rss()  # memory is reported per phase: this prefill's chunks, then the hand-off
    tracer = Tracer(rank) if config.trace else None
    comm = CommStats()

    # --- agree on the inputs before any ring communication ------------------------------------
    problem = _local_problem(model, token_ids, config, world, rank, cache)
    cached_len = cache.length if (cache is not None and rank == config.decode_rank) else 0
    if distributed:
        valid_decode_rank = config.decode_rank if 0 <= config.decode_rank < world else 0
        cached_len = _broadcast_int(cached_len, valid_decode_rank, group)
        agree_across_ranks("prefill", problem, _signature(model, token_ids, config, cached_len), group, comm)
    elif problem:
        raise ValueError(f"prefill: {problem}")

    T = int(token_ids.numel())
    chunk = config.chunk_tokens
    chunks = [(s, min(s + chunk, T)) for s in range(0, T, chunk)]

    # --- the sharding plan: every rank computes every chunk's layout (they are tiny) ----------
    held = [_even_split(cached_len, world, r)[1] - _even_split(cached_len, world, r)[0] for r in range(world)]
    first_new_row = held[rank]
    layouts = []
    for s, e in chunks:
        layout = ShardLayout.balanced([e - s], world, cached_counts=[[h] for h in held])
        layouts.append(layout)
        held = [h + layout.num_new(r) for r, h in enumerate(held)]
    capacity = held[rank]

    cfg = model.config
    dtype, device = model.dtype, model.device
    # One rank with a new prompt: its shard is the whole prompt in order, so the shard buffers are
    # allocated with decode room and become the decode cache without a copy (see _hand_off).
    in_place = world == 1 and cached_len == 0
    rows = capacity + (config.decode_room if in_place else 0)
    k_shard = [torch.empty(rows, cfg.n_kv_heads, cfg.head_dim, dtype=dtype, device=device)
               for _ in range(cfg.n_layers)]
    v_shard = [torch.empty_like(k) for k in k_shard]
    if cached_len:
        _scatter_cache(cache, k_shard, v_shard, cached_len, rank, world, config.decode_rank, group, comm)

    # --- chunk by chunk, layer by layer -------------------------------------------------------
    stats = PrefillStats(tokens=T, cached=cached_len, world_size=world, chunk_tokens=chunk)
    logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=device)
    with torch.inference_mode(), (tracer or contextlib.nullcontext()):
        for index, ((s, e), layout) in enumerate(zip(chunks, layouts)):
            t0 = time.perf_counter()
            strategy, reason = _decide(e - s, cached_len + s, model, world, config)
            rows_before = layout.num_cached(rank)
            n_new = layout.num_new(rank)
            chunk_ids = token_ids[s:e].to(device)

            def attend(layer: int, q, k, v, rows_before=rows_before, n_new=n_new, layout=layout, strategy=strategy):
                cached = {}
                if rows_before:
                    cached = dict(cached_k=k_shard[layer][:rows_before], cached_v=v_shard[layer][:rows_before])
                # Inputs were agreed across ranks once for the whole prefill (above): no per-layer check.
                out, _ = ring_attention(q, k, v, layout, strategy=strategy, group=group, stats=comm,
                                        check_across_ranks=False,
                                        backend=config.attn_backend, **cached)
                k_shard[layer][rows_before:rows_before + n_new] = k
                v_shard[layer][rows_before:rows_before + n_new] = v
                return out

            with span(f"chunk {index}", "compute", strategy=strategy):
                x = model.embed(layout.shard(chunk_ids, rank))
                rope = model.rope(layout.positions(rank).to(device))
                for layer_index, block in enumerate(model.layers):
                    x = block(x, rope, attend, layer_index)
                if index == len(chunks) - 1:
                    logits = _last_token_logits(model, x, layout, rank, world, group, logits)
            record = ChunkStats(index, e - s, cached_len + s, strategy, reason, time.perf_counter() - t0)
            stats.chunks.append(record)
            if on_chunk is not None:
                on_chunk(index + 1, len(chunks), record)

        # --- hand-off ---------------------------------------------------------------------------
        prefill_peak_rss = window_peak_rss_bytes()
        release_free_memory()  # the chunks' freed activations, before the decode rank gathers the cache
        reset_peak_rss()
        t_handoff = time.perf_counter()
        with span("hand-off", "comm"):
            out_cache = _hand_off(model, cache, layouts, k_shard, v_shard, first_new_row, cached_len, T, config,
                                  rank, world, group, comm)
        stats.handoff_s = time.perf_counter() - t_handoff
    stats.ttft_s = time.perf_counter() - t_start

    kv_bytes = capacity * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    per_rank = _gather_ints([comm.bytes_sent(), prefill_peak_rss, window_peak_rss_bytes(), kv_bytes], group, world)
    stats.bytes_sent_per_rank = [r[0] for r in per_rank]
    stats.peak_rss_bytes_per_rank = [r[1] for r in per_rank]
    stats.handoff_peak_rss_bytes_per_rank = [r[2] for r in per_rank]
    stats.kv_shard_bytes_per_rank = [r[3] for r in per_rank]
    is_decode = rank == config.decode_rank
    all_ids = token_ids.cpu()
    if cache_token_ids is not None and is_decode:
        all_ids = torch.cat([cache_token_ids.cpu(), all_ids])
    trace = _gather_trace(tracer, group, world, config.decode_rank) if config.trace else None
    return PrefillResult(logits=logits, cache=out_cache if is_decode else None, stats=stats,
                         token_ids=all_ids, trace_events=trace if is_decode else None)


def _local_problem(model, token_ids, config, world, rank, cache) -> str | None:
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
    if config.chunk_tokens < 1:
        return f"chunk_tokens must be >= 1, got {config.chunk_tokens}"
    if config.strategy not in STRATEGY_CHOICES:
        return f"unknown strategy {config.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}"
    if cache is not None and rank == config.decode_rank:
        try:
            cache.check_model(model.config)
        except ValueError as exc:
            return str(exc)
        if cache.dtype != model.dtype:
            return f"the KV cache is {cache.dtype} but the model runs in {model.dtype}; load both in one dtype"
    return None


def _signature(model, token_ids, config, cached_len) -> str:
    digest = hashlib.sha256(token_ids.cpu().numpy().tobytes()).hexdigest()[:16] if token_ids.dim() == 1 else "?"
    return (f"model={model.config.fingerprint()} dtype={model.dtype} tokens={token_ids.numel()} ids={digest} "
            f"cached={cached_len} chunk={config.chunk_tokens} strategy={config.strategy} rule={config.rule} "
            f"decode_rank={config.decode_rank}")


def _decide(new_tokens: int, cached_tokens: int, model, world: int, config: PrefillConfig) -> tuple[str, str]:
    """The chunk's strategy and the reason, as a sentence."""
    if world == 1:
        return "pass-kv", "one rank: nothing travels"
    if config.strategy != "auto":
        return config.strategy, f"forced: strategy={config.strategy}"
    from ..parallel.strategy import choose_strategy

    dtype = str(model.dtype).removeprefix("torch.")
    choice = choose_strategy(new_tokens, cached_tokens, model.config, world, config.hardware, config.rule,
                             dtype=dtype)
    return choice.strategy, choice.reason


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


def _scatter_cache(cache, k_shard, v_shard, cached_len, rank, world, decode_rank, group, comm) -> None:
    """Split the decode rank's cache evenly (contiguous rows) over the ranks, layer by layer."""
    bounds = [_even_split(cached_len, world, r) for r in range(world)]
    rows = max(b - a for a, b in bounds)
    lo, hi = bounds[rank]
    for layer in range(len(k_shard)):
        if world == 1:
            k_shard[layer][:hi - lo] = cache.k[layer][lo:hi]
            v_shard[layer][:hi - lo] = cache.v[layer][lo:hi]
            continue
        recv = k_shard[layer].new_empty((2, rows, *k_shard[layer].shape[1:]))
        pieces = None
        if rank == decode_rank:
            pieces = []
            for a, b in bounds:
                piece = recv.new_zeros(recv.shape)
                piece[0, :b - a], piece[1, :b - a] = cache.k[layer][a:b], cache.v[layer][a:b]
                pieces.append(piece)
            comm.record("scatter", layer, (world - 1) * nbytes(recv))
        dist.scatter(recv, pieces, src=dist.get_global_rank(group, decode_rank) if group else decode_rank, group=group)
        k_shard[layer][:hi - lo], v_shard[layer][:hi - lo] = recv[0, :hi - lo], recv[1, :hi - lo]


def _hand_off(model, cache, layouts, k_shard, v_shard, first_new_row, cached_len, T, config, rank, world, group, comm):
    """Gather every rank's new K/V rows to the decode rank, layer by layer, in sequence order."""
    cfg = model.config
    decode = config.decode_rank
    # Global position of each rank's new rows (chunk by chunk, in shard order).
    positions = [torch.cat([layout.positions(r) for layout in layouts]) for r in range(world)]
    out = None
    if world == 1 and cached_len == 0:  # the shard is the prompt in sequence order (see cp_prefill)
        return KVCache.from_tensors(k_shard, v_shard, length=T)
    if rank == decode:
        need = cached_len + T + config.decode_room
        if cache is None:
            out = KVCache.for_model(cfg, need, dtype=model.dtype, device=model.device)
        elif cache.max_tokens < cached_len + T:
            out = KVCache.from_tensors(cache.k, cache.v, length=cached_len, max_tokens=need)
        else:
            out = cache
    rows = max(p.numel() for p in positions)
    for layer in range(cfg.n_layers):
        mine_k = k_shard[layer][first_new_row:first_new_row + positions[rank].numel()]
        mine_v = v_shard[layer][first_new_row:first_new_row + positions[rank].numel()]
        if world == 1:
            scatter_kv(out.k[layer], out.v[layer], mine_k, mine_v, positions[0].to(model.device))
        else:
            send = mine_k.new_zeros((2, rows, cfg.n_kv_heads, cfg.head_dim))
            send[0, :mine_k.shape[0]], send[1, :mine_v.shape[0]] = mine_k, mine_v
            gathered = [torch.empty_like(send) for _ in range(world)] if rank == decode else None
            dist.gather(send, gathered, dst=dist.get_global_rank(group, decode) if group else decode, group=group)
            if rank != decode:
                comm.record("hand-off", layer, nbytes(send))
            else:
                for r, part in enumerate(gathered):
                    n = positions[r].numel()
                    scatter_kv(out.k[layer], out.v[layer], part[0, :n], part[1, :n], positions[r].to(model.device))
        k_shard[layer] = v_shard[layer] = None  # the decode rank never keeps a second copy
        release_free_memory()  # and hands the freed shard pages back while the cache fills
    if out is not None:
        out.length = cached_len + T
    return out


def _gather_ints(values: list[int], group, world: int) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.long)
    if world == 1:
        return [mine.tolist()]
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def _gather_trace(tracer, group, world: int, decode_rank: int) -> list[list[dict]] | None:
    """Every rank's trace events on the decode rank (as JSON bytes: no pickling between ranks)."""
    import json

    data = torch.frombuffer(bytearray(json.dumps(tracer.events).encode()), dtype=torch.uint8)
    if world == 1:
        return [tracer.events]
    sizes = _gather_ints([data.numel()], group, world)
    longest = max(s[0] for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    everyone = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    return [json.loads(bytes(t[:s[0]].tolist())) for t, s in zip(everyone, sizes)]
