"""How fast this machine reads memory and decodes: the floor of a decode step, and `dtype="auto"`.

A decode step reads every weight and the whole KV cache once, so its floor is

    (bytes of weights read per token + bytes of KV cache) / read bandwidth

`read_bandwidth` measures the bandwidth (scripts/bench_model.py prints each row's floor beside it,
`ringctx prefill` its decode step's), `decode_bytes_per_token` counts the bytes.

`matmul_flops_per_s` times this machine's peak for a prefill: a short GEMM of the model's MLP
shapes, in float32 and, where bf16 matmuls are native, in bf16. `ringctx prefill` reports the
prefill's FLOP/s (the cost model's FLOPs over the chunks' seconds) as a share of it.

`auto_dtype` answers `dtype="auto"` on a CPU: the dtype that decodes fastest here among those
that meet ringctx's exactness rules, measured. The candidates are float32 and bfloat16 (bf16
passes the rule of docs/ARCHITECTURE.md: at most twice the error of the same computation done unsharded in
bf16 by PyTorch); float16 is not one, as neither ringctx's CPU kernels nor PyTorch's CPU ops
compute it natively. Which is faster depends on the CPU: with ringctx's CPU kernels a bf16 step
reads half the bytes of a float32 one on any x86-64 CPU; without them, PyTorch emulates bf16 on
CPUs without bf16 units and float32 can win. So it is measured, once per machine: decode steps of
a random model of SmolLM2's widths, large enough that its weights do not fit in the caches,
alternating the two dtypes. bfloat16 must be at least `BF16_MARGIN` faster to be chosen (ties go
to the more exact float32, and ranks measuring on like machines do not flip between the two).
The answer is kept in the kernel cache directory, keyed by the CPU, the kernel variant, the torch
version and the thread count; a lock makes the ranks of one host measure once.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..host_memory import host_tensors, huge_pages_enabled
from ..kernels.cpu_features import cpu_has_fast_bf16, cpu_model
from .linear_attention import decode_state_bytes

BF16_MARGIN = 0.9
"""bfloat16 is chosen when its median step takes less than this fraction of float32's."""

_PROBE_BYTES = 512 * 2 ** 20


def read_bandwidth(*, threads: int | None = None, nbytes: int = _PROBE_BYTES, repeats: int = 7) -> float:
    """The read bandwidth of this machine in bytes/s, with `threads` threads (default: torch's):
    the best of `repeats` float32 sums over `nbytes` of memory, well past the caches, placed as
    ringctx places weights and KV caches (ringctx.host_memory)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        (x,) = host_tensors([((nbytes // 4,), torch.float32)])
        x.fill_(0.5)  # page the buffer in
        best = min(_seconds(lambda: x.sum()) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best


def matmul_flops_per_s(rows: int, dim: int, ffn_dim: int, dtype: torch.dtype = torch.float32, *,
                       threads: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of the MLP's two GEMM shapes of one prefill chunk on this CPU, with `threads`
    threads (default: torch's): [rows, dim] x [dim, ffn_dim] and [rows, ffn_dim] x [ffn_dim, dim],
    the best of `repeats` of each (after one warm-up), 2*rows*dim*ffn_dim FLOPs each."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        x, w_up = (torch.randn(shape, generator=generator).to(dtype) for shape in ((rows, dim), (dim, ffn_dim)))
        h, w_down = (torch.randn(shape, generator=generator).to(dtype) for shape in ((rows, ffn_dim), (ffn_dim, dim)))
        best = 0.0
        with torch.inference_mode():
            for a, b in ((x, w_up), (h, w_down)):
                a @ b  # warm-up: oneDNN picks and builds its kernel
                best += min(_seconds(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return 2 * (2 * rows * dim * ffn_dim) / best


def attention_flops_per_s(rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                          dtype: torch.dtype = torch.float32, *, repeats: int = 3) -> float:
    """FLOP/s of one full attention block of `rows` queries against `rows` keys through the
    kernel the ring calls (`attention_block`, the best of `repeats` after one warm-up), FLOPs
    counted as 4*rows*rows*D per query head, as the planner counts them."""
    from ..attention import attention_block

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, n_heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(rows, n_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    with torch.inference_mode():
        attention_block(q, k, v)  # warm-up: the kernel's first call builds or loads it
        best = min(_seconds(lambda: attention_block(q, k, v)) for _ in range(repeats))
    return 4 * rows * rows * head_dim * n_heads / best


def decode_bytes_per_token(model, context: float, kv_bytes_per_token: float | None = None) -> float:
    """Bytes a decode step reads once: every parameter but the embedding table (one row of it is
    read; a tied table is read whole as the output head, and counted once; int8 weights as their
    codes and exponents, which the decode reads instead; of a mixture of experts the router and the
    experts_per_token experts a token goes through), plus K and V of `context` cached tokens
    in every attention layer (`kv_bytes_per_token` each, the sum over the layers; default: in the
    weights' dtype, every layer's KV heads), plus, with a context, a hybrid's linear-attention
    states read and written (`linear_attention.decode_state_bytes`, in the weights' dtype)."""
    from ..kernels.selection import reads_int8_weights
    from ..model.int8_weights import int8_of

    codes_read = model.device.type == "cpu" and reads_int8_weights()

    def read(p) -> int:
        codes = int8_of(p) if codes_read else None
        return p.numel() * p.element_size() if codes is None else codes.codes.numel() + codes.exponents.numel()

    config = model.config
    weights = sum(read(p) for p in model.parameters())
    for i, block in enumerate(model.layers):  # a mixture of experts: a token reads its k experts only
        experts = config.experts(i)
        if experts is not None:
            unread = 1 - experts.experts_per_token / experts.n_experts
            weights -= unread * sum(read(p) for p in (block.feed_forward.w13, block.feed_forward.w2))
    if not config.tie_embeddings:
        weights -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    element = model.tok_embeddings.weight.element_size()
    if kv_bytes_per_token is None:
        kv_bytes_per_token = 2 * sum(h * d for h, d in config.kv_shapes) * element
    # windowed and chunked layers read only the rows they see: a share of the full layers' rows
    # (the mean over the attention layers: a linear layer keeps none, its state is read instead)
    seen = config.decode_kv_rows(int(context)) / len(config.attention_layers) if context else 0.0
    states = decode_state_bytes(config, element) if context else 0
    return weights + seen * kv_bytes_per_token + states


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """What `auto_dtype` chose, and the measurement it chose by."""

    dtype: str
    """"bfloat16" or "float32"."""
    why: str
    """One sentence: the measured step times, or why nothing was measured (a GPU)."""
    step_ms: dict[str, float]
    """Median decode step of the probe model, per dtype, in milliseconds (empty on a GPU)."""
    measured: str
    """When and where: ISO date, CPU model, kernel variant, threads."""


def auto_dtype(device: str | None = None) -> DtypeChoice:
    """The dtype `dtype="auto"` means on `device` (None: a GPU when there is one, else the CPU)."""
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if on_gpu:
        return DtypeChoice("bfloat16", "GPUs compute bf16 natively (tensor cores); float32 reads twice the bytes",
                           {}, "")
    path = _choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of this host wait, then read the answer
        try:
            return DtypeChoice(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        choice = measure_dtype_choice()
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(choice), f)
        os.replace(tmp, path)
        return choice


def measure_dtype_choice(rounds: int = 3, steps: int = 6) -> DtypeChoice:
    """Decode steps of the probe model in float32 and bfloat16, alternating for `rounds` rounds
    of `steps` steps each; the faster (by BF16_MARGIN) wins."""
    from ..kernels import build

    probes = {name: _probe_step(dtype) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    times: dict[str, list[float]] = {name: [] for name in probes}
    with torch.inference_mode():
        for step in probes.values():  # warm-up: builds the kernels, touches the weights
            step(1)
        for _ in range(rounds):
            for name, step in probes.items():
                times[name] += [_seconds(lambda t=t: step(t)) for t in range(2, 2 + steps)]
    ms = {name: round(1e3 * statistics.median(ts), 3) for name, ts in times.items()}
    dtype, ratio = faster_dtype(ms)
    variant = build.active_variant()
    path = f"ringctx's {variant.name} CPU kernels" if variant else "PyTorch's ops (no CPU kernels)"
    why = (f"a decode step took {ms['bfloat16']:.2f} ms in bf16 and {ms['float32']:.2f} ms in float32 "
           f"({ratio:.2f}x) through {path}; bf16 is chosen below {BF16_MARGIN}x")
    measured = (f"{datetime.date.today().isoformat()}, {cpu_model()}, "
                f"{variant.name if variant else 'no kernels'}, {torch.get_num_threads()} threads")
    return DtypeChoice(dtype, why, ms, measured)


def faster_dtype(step_ms: dict[str, float]) -> tuple[str, float]:
    """("bfloat16" or "float32", bf16's time / float32's) for median step times per dtype:
    bfloat16 only when it takes less than BF16_MARGIN of float32's time."""
    ratio = step_ms["bfloat16"] / step_ms["float32"]
    return ("bfloat16" if ratio < BF16_MARGIN else "float32"), ratio


def _probe_step(dtype: torch.dtype):
    """A decode step over a random model of SmolLM2's head and MLP widths (6 layers, 52M
    parameters: 208 MB in float32, 104 MB in bf16) and a 1K-token cache."""
    from ..model.presets import get_preset
    from ..model import KVCache
    from ..model.decode_step import DecodeStep
    from ..model.weights import empty_model

    config = dataclasses.replace(get_preset("tiny"), name="dtype-probe", vocab_size=1024, dim=768, n_layers=6,
                                 n_heads=12, n_kv_heads=4, head_dim=64, ffn_dim=3072)
    model = empty_model(config, dtype=dtype, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)
    cache = KVCache(config.n_layers, 1024 + 64, config.n_kv_heads, config.head_dim, dtype=dtype, device="cpu")
    for k, v in zip(cache.k, cache.v):
        k.fill_(0.01)
        v.fill_(0.01)
    cache.length = 1024
    step = DecodeStep(model, cache)

    def one(token: int):
        cache.length = 1024  # every step attends to the same 1K rows
        return step(token)

    return one


def preferred_dtype(device: str | None = None) -> str:
    """What dtype="auto" means here: bfloat16 on GPUs; on a CPU the dtype that decodes fastest,
    measured once (see auto_dtype above)."""
    return auto_dtype(device).dtype


def _choice_path() -> Path:
    from ..kernels import build, cpu_features

    lib = build.library()  # its file name carries the hash of the kernel sources and flags
    key = "|".join((cpu_model(), ",".join(sorted(cpu_features.cpu_flags())), getattr(lib, "_name", "no kernels"),
                    torch.__version__, torch.backends.cpu.get_cpu_capability(), f"bf16 units {cpu_has_fast_bf16()}",
                    str(torch.get_num_threads()), f"huge pages {huge_pages_enabled()}"))
    return build.cache_dir() / f"dtype-choice-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
