"""How close a prefill and a decode step ran to this machine, measured in the same run.

    prefill share = cost-model FLOPs of the chunks (attention + matmuls, `chunk_flops`)
                    / the chunks' seconds / peak
    peak          = a GEMM of the model's MLP shapes, one chunk's rows, every core of this host,
                    in the dtype the prefill computes in (`kernels.cpu_features.compute_dtype`: float32
                    where bf16 is emulated, bf16 where the CPU has bf16 units)
    decode share  = floor / measured step, floor = bytes a step reads / read bandwidth
                    (every decode rank reads the weights once and its slice of the KV cache)

Both peaks are measured before the prefill (its ranks idle) and after the run (its ranks gone),
about a second each (`machine_speed.matmul_flops_per_s`, `machine_speed.read_bandwidth`); the
larger counts. CPU only: on a GPU nothing is measured yet (`measure_efficiency` returns None).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from ..kernels.cpu_features import compute_dtype
from ..planning.linear_attention import decode_state_bytes
from ..planning.machine_speed import decode_bytes_per_token, matmul_flops_per_s, read_bandwidth
from ..planning.work import chunk_flops

PEAK_ROWS_MAX = 4096
"""Rows of the peak GEMM: one chunk's, at most this many (enough to reach the GEMM's plateau)."""
BANDWIDTH_PROBE_BYTES = 256 * 2 ** 20
"""Memory the read-bandwidth probe sums over: well past the caches, in a fraction of a second."""


@dataclass
class RunEfficiency:
    """A prefill's FLOP/s against this machine's GEMM peak, and a decode step against its memory floor."""

    compute_dtype: str
    """The dtype the prefill's big matmuls and attention blocks computed in."""
    threads: int
    """Threads of the peak measurements: every core this process may run on."""
    gemm_shape: str
    """The peak GEMMs: "[rows, dim] x [dim, ffn] and [rows, ffn] x [ffn, dim]"."""
    gemm_flops_per_s: dict[str, float]
    """Measured GEMM FLOP/s per dtype: float32, and the compute dtype when it is another."""
    peak_flops_per_s: float
    """The GEMM FLOP/s in the compute dtype: the peak the prefill is measured against."""
    prefill_flops: float
    """Cost-model FLOPs of the prefill's chunks (attention + matmuls, every layer and rank)."""
    prefill_seconds: float
    """Sum of the chunks' seconds (the hand-off is not in it)."""
    prefill_flops_per_s: float
    prefill_share_of_peak: float
    """prefill_flops_per_s / peak_flops_per_s."""
    read_bandwidth_bytes_per_s: float | None = None
    """Measured read bandwidth of this host (every core), what the decode floor divides by."""
    decode_ms_per_token: float | None = None
    """Mean decode step of the run's short answer (None when it decoded nothing)."""
    decode_floor_ms: float | None = None
    """Bytes the decode ranks read per step / read bandwidth."""
    decode_share_of_floor: float | None = None
    """decode_floor_ms / decode_ms_per_token: 1 is the memory floor."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def prefill_flops(stats, model_config) -> float:
    """Cost-model FLOPs of a PrefillStats' chunks."""
    return sum(chunk_flops(c.tokens, c.cached, model_config) for c in stats.chunks)


def measure_peaks(engine) -> dict:
    """This host's peaks for `engine`'s model, now: {"gemm_flops_per_s": {dtype: FLOP/s},
    "read_bandwidth_bytes_per_s": B/s} (GEMMs in float32 and in the prefill's compute dtype), or
    {} off the CPU. Call with the ranks idle: before a prefill, and after engine.close()."""
    model = engine.model
    if model.device.type != "cpu":
        return {}
    config, threads = model.full_config, _threads()
    rows = min(engine.chunk_tokens, PEAK_ROWS_MAX)
    gemm = {}
    for dtype in dict.fromkeys((torch.float32, compute_dtype(model.dtype, "cpu"))):
        gemm[str(dtype).removeprefix("torch.")] = matmul_flops_per_s(rows, config.dim, config.ffn_dim, dtype,
                                                                     threads=threads)
    return {"gemm_flops_per_s": gemm,
            "read_bandwidth_bytes_per_s": read_bandwidth(threads=threads, nbytes=BANDWIDTH_PROBE_BYTES)}


def measure_efficiency(engine, stats, decode=None, before: dict | None = None) -> RunEfficiency | None:
    """Rate `stats` (a PrefillStats of `engine`) against this host's peaks, measured now and
    taken together with `before` (measure_peaks before the prefill; the larger counts: a shared
    machine only ever slows a measurement down), and `decode` (a GenerationResult over the
    prefilled document, or None) against its floor. Call after engine.close(), so that no rank
    competes for the cores. None off the CPU."""
    after = measure_peaks(engine)
    if not after:
        return None
    before = before or {}
    gemm = {name: max(flops, before.get("gemm_flops_per_s", {}).get(name, 0.0))
            for name, flops in after["gemm_flops_per_s"].items()}
    bandwidth = max(after["read_bandwidth_bytes_per_s"], before.get("read_bandwidth_bytes_per_s", 0.0))
    model, config = engine.model, engine.model.full_config
    name = str(compute_dtype(model.dtype, "cpu")).removeprefix("torch.")
    rows = min(engine.chunk_tokens, PEAK_ROWS_MAX)
    flops = prefill_flops(stats, config)
    seconds = sum(c.seconds for c in stats.chunks)
    achieved = flops / seconds if seconds > 0 else 0.0
    result = RunEfficiency(
        compute_dtype=name, threads=_threads(),
        gemm_shape=f"[{rows}, {config.dim}] x [{config.dim}, {config.ffn_dim}] and its transpose",
        gemm_flops_per_s=gemm, peak_flops_per_s=gemm[name], prefill_flops=flops, prefill_seconds=seconds,
        prefill_flops_per_s=achieved, prefill_share_of_peak=achieved / gemm[name],
        read_bandwidth_bytes_per_s=bandwidth)
    if decode is not None and decode.token_times_s:
        context = stats.cached + stats.tokens + decode.prompt_tokens + len(decode.token_times_s) / 2
        weights = decode_bytes_per_token(model, 0) * engine.decode_ranks * engine.tp_size
        # windowed layers: W rows each; a hybrid's linear layers keep none, their states are read and written
        rows = config.decode_kv_rows(int(context)) / len(config.attention_layers)
        states = decode_state_bytes(config, model.tok_embeddings.weight.element_size())
        floor_ms = 1e3 * (weights + rows * kv_bytes_per_token(engine) + states) / bandwidth
        result.decode_ms_per_token = decode.decode_ms_per_token
        result.decode_floor_ms = floor_ms
        result.decode_share_of_floor = floor_ms / decode.decode_ms_per_token
    return result


def _threads() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def kv_bytes_per_token(engine) -> int:
    """KV bytes one token takes over all decode ranks (every KV head and layer, in the cache's kv_dtype)."""
    return sum(kv_layer_row_bytes(engine))


def document_state_bytes(engine) -> int:
    """Bytes a document's linear-attention states take over all decode ranks (a hybrid's: each
    decode rank runs every layer of a token, so each keeps the states whole, twice: the document's
    copy that every question starts from and its cache's working one, runtime/document.py; 0 for
    other models)."""
    element = torch.empty((), dtype=engine.model.dtype).element_size()
    return 2 * engine.model.full_config.linear_state_bytes(element) * engine.decode_ranks


def kv_layer_row_bytes(engine) -> list[int]:
    """Per layer, the KV bytes one token takes there over all decode ranks (every KV head, in the
    cache's kv_dtype; a layer's own head shape where it has one)."""
    from ..model import KVCache

    probe = KVCache.for_model(engine.model.full_config, 1, dtype=engine.model.dtype, device="meta",
                              kv_dtype=engine.kv_dtype)
    return [sum(math.prod(t.shape[1:]) * t.element_size() for t in probe.storage_tensors(layer))
            for layer in range(probe.n_layers)]

