"""The memory check before a prefill: the planner's estimate for this rank against the memory
really available to it, refused on every rank alike with the settings that would fit.

    available_memory       the GPU's free memory or the host's available RAM (RINGCTX_MEMORY_LIMIT caps it)
    prefill_memory_need    bytes a prefill adds on this rank's device, by part (the planner's formulas)
    memory_problem         one line when the prefill would not fit, naming the fixes; None otherwise
"""

from __future__ import annotations

import os
import socket

import torch

from ..parallel.ring import STRATEGIES
from ..planning.hardware import element_bytes
from ..planning.linear_attention import state_bytes_per_rank
from ..planning.memory import (
    MEMORY_USABLE_FRACTION, activation_bytes_per_rank, document_kv_bytes, kv_row_bytes, layer_kv_row_bytes,
    prefill_kv_bytes_per_rank,
)
from ..planning.strategy import cached_rows_per_rank, tokens_per_rank
from ..units import fmt_bytes

MEMORY_LIMIT_ENV = "RINGCTX_MEMORY_LIMIT"
MEMORY_CHECK_ENV = "RINGCTX_MEMORY_CHECK"


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
                        kv_dtype: str = "model", drop_unseen: bool = False) -> dict:
    """Bytes a prefill adds on this rank's device (host RAM on CPU: all its local ranks), by part.

    From the planner's formulas: the KV shard at its fullest (prefill_kv_bytes_per_rank, stored in
    kv_dtype; with drop_unseen its windowed and chunked layers hold only what the next chunk still
    sees), the one-layer working set of a chunk (activation_bytes_per_rank, the larger of pass-KV
    and pass-Q), and what the hand-off adds on the decode host: with one decode rank the whole
    decode KV cache (a document's rows with drop_unseen: document_kv_bytes), with several the rows
    the other ranks send them plus each decode rank's room. A hybrid's linear-attention states
    (`state_bytes_per_rank`) are held whole by every rank and again by each decode rank's cache.
    Weights are already loaded and not counted again. `cfg` is this rank's (its tensor-parallel
    share of the heads).
    """
    chunk = max(1, min(chunk, tokens))
    full, rest = divmod(tokens, chunk)
    chunks = [chunk] * full + ([rest] if rest else [])
    rows = cached_rows_per_rank(cached, world) + sum(tokens_per_rank(t, world) for t in chunks)
    shard = prefill_kv_bytes_per_rank(cfg, cached, chunks, world, 1, dtype_name, kv_dtype, drop_unseen)
    activations = max(activation_bytes_per_rank(cfg, world, 1, chunk, rows, s, dtype_name) for s in STRATEGIES)
    per_token = kv_row_bytes(cfg, 1, dtype_name, kv_dtype)
    states = state_bytes_per_rank(cfg, 1, element_bytes(dtype_name))
    if decode_ranks == 1 and drop_unseen:
        decode_cache = document_kv_bytes(cfg, layer_kv_row_bytes(cfg, 1, dtype_name, kv_dtype), cached + tokens) \
            + per_token * decode_room
    elif decode_ranks == 1:
        decode_cache = per_token * (cached + tokens + decode_room)
    else:  # decode ranks keep their shards: only the other ranks' rows arrive, and the room
        moved = (cached + tokens) * max(0, world - decode_ranks) // world
        decode_cache = per_token * (moved + decode_room * decode_ranks)
    decode_cache += states * decode_ranks
    per_rank = shard + states + activations + 16 * tokens  # + the token ids
    total = per_rank * local_ranks + (decode_cache if decode_here else 0)
    return {"shard": shard, "activations": activations, "decode_cache": decode_cache if decode_here else 0,
            "per_rank": per_rank, "total": total, "local_ranks": local_ranks}


def memory_problem(model, tokens: int, cached: int, chunk: int, world: int, rank: int, decode_rank: int,
                   decode_room: int, *, local_ranks: int = 1, local_decode: bool | None = None,
                   decode_ranks: int = 1, kv_dtype: str = "model", drop_unseen: bool = False) -> str | None:
    """A one-line problem when the prefill would not fit the memory available to this rank, else None.

    On CPU the ranks of one host share its RAM: `local_ranks` of them, and what the hand-off
    brings to the decode ranks when `local_decode` (default: this is the decode rank). Every fix
    it suggests is checked to fit. drop_unseen: the prefill drops what later chunks no longer see
    (PrefillRun's drop_unseen on a CPU rank). Set RINGCTX_MEMORY_CHECK=0 to
    skip the check, RINGCTX_MEMORY_LIMIT=<size> to cap the memory it assumes available.
    """
    if os.environ.get(MEMORY_CHECK_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if tokens < 1 or chunk < 1 or model.device.type == "meta":
        return None

    cfg = model.config
    dtype_name = str(model.dtype).removeprefix("torch.")
    on_gpu = model.device.type == "cuda"
    local_ranks = 1 if on_gpu else max(1, local_ranks)
    decode_here = (rank == decode_rank) if (local_decode is None or on_gpu) else local_decode

    weight_bytes = cfg.n_params * element_bytes(dtype_name)

    def need_at(n_world: int, n_chunk: int, dtype: str = dtype_name, kv: str = kv_dtype, n_tokens: int = tokens,
                n_local: int = local_ranks) -> int:
        """The need with some settings changed; n_local > local_ranks: more ranks on this CPU host,
        each with its own copy of the weights and, when every local rank decodes, its decode slice."""
        n_decode = decode_ranks * n_local // local_ranks if decode_ranks == local_ranks else decode_ranks
        extra_weights = (n_local - local_ranks) * weight_bytes * element_bytes(dtype) // element_bytes(dtype_name)
        return extra_weights + prefill_memory_need(
            cfg, dtype, n_world * n_local // local_ranks, n_tokens, cached, n_chunk, decode_room=decode_room,
            local_ranks=n_local, decode_here=decode_here, decode_ranks=n_decode, kv_dtype=kv,
            drop_unseen=drop_unseen)["total"]

    try:
        free, where = available_memory(model.device)
    except ValueError as exc:
        return str(exc)
    usable = int(free * MEMORY_USABLE_FRACTION)
    need = prefill_memory_need(cfg, dtype_name, world, tokens, cached, chunk, decode_room=decode_room,
                               local_ranks=local_ranks, decode_here=decode_here, decode_ranks=decode_ranks,
                               kv_dtype=kv_dtype, drop_unseen=drop_unseen)
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


KV_BUDGET_SHARE = 0.5
"""Of the memory free once the model is loaded (times the planner's usable fraction), the share kept
documents and prompts may hold (a server's KV budget, unless given): the rest stays free for an
ingest in flight (its shards live on every rank until the hand-off) and for answers' rows."""


def auto_kv_budget(engine) -> int:
    """KV bytes the decode ranks may keep of documents and prompts: KV_BUDGET_SHARE of the memory
    free after loading (every decode GPU's, or the host's once: CPU ranks share it)."""
    from ..planning.memory import MEMORY_USABLE_FRACTION

    free, _ = available_memory(engine.model.device)
    per_device = free if engine.model.device.type == "cpu" else free * engine.decode_ranks
    return int(per_device * MEMORY_USABLE_FRACTION * KV_BUDGET_SHARE)
