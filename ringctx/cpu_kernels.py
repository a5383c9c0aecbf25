"""ringctx's CPU kernels (csrc/cpu_*.c), built for this CPU's vector ISA, with PyTorch as the fallback.

A decode step should take the time to read the weights and the KV cache once. Where PyTorch on a
CPU falls short of that (measured, docs/BENCHMARKS.md):

    small_linear           x [T <= 8, in] @ W^T (T <= 32 on CPUs without bf16 units, a question's
                           prefill). PyTorch's bf16 GEMV streamed the weights at half the memory's
                           speed, on CPUs with bf16 units (AMX) and without; its float32 one at
                           0.8-1x. The kernel widens bf16 weights to float32 in registers, once
                           for four rows (two on AVX-512), prefetches the next rows, accumulates
                           in float32 and rounds once (the contract of a native bf16 GEMM).
    decode_attention,      a few query rows per KV head (a GQA group times B query tokens: one
    decode_attention_q8    token each of B questions about one document) over a token-major
                           [S, Hkv, D] KV cache in the model dtype, or 8-bit (int8 or fp8 e4m3 data
                           with a float32 scale per token and KV head, attention/quant.py), in one
                           pass: each K and V row is read once, in place, for all the rows, the
                           softmax is online over tiles of keys, the keys are split over the
                           threads and merged by log-sum-exp; returns the output and the LSE.
                           PyTorch's bmm walked the cache strided and, in bf16, converted it to
                           float32 first; dequantizing an 8-bit cache in PyTorch would write and
                           read a float copy of it.
    decode_scores,         the two-pass form (QK^T written out, the softmax in PyTorch, then PV)
    decode_pv, *_q8        that decode_attention replaced: kept as the baseline that
                           scripts/bench_batch_attention.py measures it against, and as products
                           the tests check alone.
    small_linear_int8      the same over int8 weights with a power-of-two scale per 64 inputs (the
                           model's `--weights int8`): the same sums bit for bit as over the bf16
                           values the codes stand for, from half the bytes.
    decode_step_batch      a whole decode step of a Llama-family model for B sequences (a lone
                           answer is B = 1; csrc/cpu_decode.c, driven by
                           ringctx/model/decode_step.py): every layer in one call, so that the
                           ~40 small PyTorch ops per layer, whose dispatch cost as much as reading
                           the weights, are not paid.
    rms_norm, rope_,       RMSNorm, RoPE and the SwiGLU gate over many rows (csrc/cpu_token_ops.c):
    swiglu_                one pass per row in float32 with the PyTorch path's roundings, where
                           PyTorch makes several elementwise passes, each converting bf16 to
                           float32 and back (~1 s of a 7 s bf16 prefill of 8K tokens).
    flash_attention        flash attention in float32 (csrc/cpu_flash.c): a prefill's attention
                           blocks on CPUs without bf16 units (a bf16 model computes them in
                           float32 there, widened as it reads them) and a float32 model's
                           everywhere; 0.77-0.99x the time of PyTorch's float32 op (causal blocks
                           0.77-0.91x), AVX2 and AVX-512.
    amx_attention          flash attention in bf16 on CPUs with AMX (csrc/cpu_attention_amx.c):
                           the "amx" attention backend, 1.2-1.9x PyTorch's fused CPU op there.
    amx_linear             x [9 <= T <= 48, in] @ W^T in bf16 on AMX (a question's prefill): the
                           weights read in place, once for all rows; 0.73-0.85x the time of
                           PyTorch's bf16 matmul at 9-16 rows.

Variants: the kernels are written once, on GCC/Clang vector types (csrc/cpu_simd.h), and built
once per vector ISA with that ISA's -m flags (VARIANTS): "avx512" (16 floats a vector; also holds
the AMX attention), "avx2" (8: AVX2, FMA, F16C: x86-64 CPUs since 2013-2015, AMD Zen 1-3) and
"portable" (4: the target's baseline, SSE2 on x86-64, NEON on arm64). The first variant that this
CPU runs is used (`choose_variant`); RINGCTX_CPU_ISA names another.

How: the C files have no PyTorch headers, so the system C compiler builds a variant in a few
seconds the first time it is needed; the library is cached under ~/.cache/ringctx (or
$RINGCTX_CACHE_DIR), keyed by a hash of the sources and flags, written atomically, and called
through ctypes (which releases the GIL). Without a C compiler or a variant this CPU runs,
`small_linear` returns None, `decode_kernels_apply` False and `library()` None, and callers use
PyTorch; `kernel_error()` says why.

Environment:
    RINGCTX_CPU_KERNELS=0   never build or use the kernels
    RINGCTX_CPU_ISA         avx512, avx2 or portable: use that variant (default: auto, the widest
                            this CPU runs)
    RINGCTX_AMX=0           never use the AMX attention kernel (bf16 attention then uses PyTorch's op)
    RINGCTX_CACHE_DIR       where the built libraries are kept (default ~/.cache/ringctx)
    CC                      the C compiler (default: cc, then gcc)
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

MAX_ROWS = 8
"""Most activation rows `small_linear` takes (decode steps and short inputs). Measured against
PyTorch's bf16 matmul on a CPU without bf16 units: 1.5-2x faster at 1, 3 and 8 rows."""

_SOURCES = ("cpu_kernels.c", "cpu_token_ops.c", "cpu_decode.c", "cpu_flash.c")
_AMX_SOURCE = "cpu_attention_amx.c"
_DETECT_SOURCE = "cpu_detect.c"
_HEADERS = ("cpu_kernels.h", "cpu_simd.h")
_CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=gnu11")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One build of the kernels for one vector ISA (see csrc/cpu_simd.h)."""

    name: str
    """What RINGCTX_CPU_ISA calls it, and `ringctx info` shows."""
    vector_floats: int
    """Floats per vector (RINGCTX_VEC of the C sources)."""
    flags: tuple[str, ...]
    """The compiler's ISA flags for every source but cpu_detect.c."""
    cpu_flags: frozenset[str]
    """The /proc/cpuinfo flags an x86-64 CPU must report to run it (none: any CPU)."""
    x86_only: bool
    """Only for x86-64 CPUs (the portable variant builds for any target)."""
    amx: bool
    """The library also holds the AMX bf16 attention kernel."""
    reads_int8_weights: bool
    """Decode steps read int8 weights' codes (ringctx/model/int8_weights.py) rather than their bf16
    values: where widening the codes costs less than the bytes it saves (SmolLM2 decode steps,
    docs/BENCHMARKS.md: avx512 0.77-0.99x the time, avx2 0.93-1.0x; portable 1.44x, so it reads
    the values)."""

    @property
    def sources(self) -> tuple[str, ...]:
        return _SOURCES + ((_AMX_SOURCE,) if self.amx else ())


VARIANTS = (
    Variant("avx512", 16, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
            frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}), x86_only=True, amx=True,
            reads_int8_weights=True),
    Variant("avx2", 8, ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"}), x86_only=True, amx=False,
            reads_int8_weights=True),
    Variant("portable", 4, (), frozenset(), x86_only=False, amx=False, reads_int8_weights=False),
)
"""Widest first: the order `choose_variant` tries them in."""

_VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}  # variant name -> library, None when it failed
_errors: dict[str, str] = {}                    # variant name -> why it is unavailable
_forced: str | None = None                      # use_variant's choice, overriding RINGCTX_CPU_ISA


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split(":", 1)[-1].split())
    except OSError:
        return frozenset()


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runs_here(variant: Variant) -> str | None:
    """None when this CPU runs `variant`, else why not (the flags it lacks)."""
    if variant.x86_only and not _is_x86_64():
        return f"{variant.name} is for x86-64 CPUs; this one is {platform.machine()}"
    missing = sorted(variant.cpu_flags - cpu_flags())
    return f"this CPU has no {', '.join(missing)}" if missing else None


def choose_variant() -> tuple[Variant | None, str]:
    """The variant to use here and why: use_variant's or RINGCTX_CPU_ISA's choice, else the widest
    this CPU runs. (None, reason) when the kernels are off or the named variant cannot run."""
    # Asked before every kernel call (hundreds per question's prefill): the answer is kept per
    # setting, and the settings are read each time, so that a test may change them at run time.
    return _choose(os.environ.get("RINGCTX_CPU_KERNELS", "1"), _forced, os.environ.get("RINGCTX_CPU_ISA", "auto"),
                   cpu_flags())


@functools.lru_cache(maxsize=16)
def _choose(kernels: str, forced: str | None, isa: str, flags: frozenset[str]) -> tuple[Variant | None, str]:
    """choose_variant's answer for these settings and CPU flags (runs_here reads the same flags)."""
    if kernels == "0":
        return None, "disabled by RINGCTX_CPU_KERNELS=0"
    asked = forced or isa.strip().lower() or "auto"
    if asked != "auto":
        variant = _VARIANTS_BY_NAME.get(asked)
        if variant is None:
            return None, f"RINGCTX_CPU_ISA={asked!r} is not a variant; use auto, {', '.join(_VARIANTS_BY_NAME)}"
        why_not = runs_here(variant)
        if why_not:
            return None, f"RINGCTX_CPU_ISA={asked} cannot run here: {why_not}"
        return variant, f"named by {'use_variant' if forced else 'RINGCTX_CPU_ISA'}"
    skipped = []
    for variant in VARIANTS:
        why_not = runs_here(variant)
        if why_not is None:
            return variant, "the widest this CPU runs" + (f" ({'; '.join(skipped)})" if skipped else "")
        skipped.append(f"not {variant.name}: {why_not}")
    return None, "; ".join(skipped)  # not reached: portable runs anywhere


def use_variant(name: str | None) -> None:
    """Use variant `name` from now on in this process (None: back to RINGCTX_CPU_ISA / auto). For
    tests and benchmarks that compare variants on one machine; ranks started later inherit
    RINGCTX_CPU_ISA, not this."""
    global _forced
    if name is not None and name not in _VARIANTS_BY_NAME:
        raise ValueError(f"unknown CPU kernel variant {name!r}; use one of {', '.join(_VARIANTS_BY_NAME)}")
    _forced = name


def _source_dir() -> Path | None:
    """The directory with the C sources, found where the CUDA sources are looked for (see
    kernel_paths.csrc_dir)."""
    from .kernel_paths import csrc_dir

    return csrc_dir(_SOURCES + (_AMX_SOURCE, _DETECT_SOURCE) + _HEADERS)


def _cache_dir() -> Path:
    if os.environ.get("RINGCTX_CACHE_DIR"):
        return Path(os.environ["RINGCTX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ringctx"


def _run_compiler(args: list[str], directory: Path) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{args[0]} failed on {directory}: {done.stderr.strip()[-2000:]}")


def _compile(directory: Path, variant: Variant) -> Path:
    """The library of `variant` built from the sources in `directory`: compiled once into the
    cache, atomically, then reused."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    vec = f"-DRINGCTX_VEC={variant.vector_floats}"
    digest = hashlib.sha256(" ".join((compiler, *_CFLAGS, vec, *variant.flags)).encode())
    for name in variant.sources + (_DETECT_SOURCE,) + _HEADERS:
        digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
    target = _cache_dir() / f"cpu_kernels-{variant.name}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=target.stem + ".", dir=target.parent) as tmp:
        # cpu_detect.c without the variant's flags: it must run on any CPU to say whether the rest can.
        detect = os.path.join(tmp, "detect.o")
        _run_compiler([compiler, *_CFLAGS, vec, "-c", str(directory / _DETECT_SOURCE), "-o", detect], directory)
        built = os.path.join(tmp, target.name)
        _run_compiler([compiler, *_CFLAGS, "-shared", vec, *variant.flags,
                       *(str(directory / name) for name in variant.sources), detect, "-lm", "-o", built], directory)
        os.replace(built, target)  # concurrent ranks each build their own file; the last one wins
    return target


def _bind(lib: ctypes.CDLL, variant: Variant) -> None:
    """Declare the argument and result types of the library's entry points."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ringctx_gemv.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, i32]
    lib.ringctx_gemv_q8.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32]
    lib.ringctx_decode_scores.argtypes = [ptr, i64, i64, i64, ptr, i32, i64, f32, ptr, i32]
    lib.ringctx_decode_pv.argtypes = [ptr, i64, i64, i64, ptr, i32, i64, ptr, i32]
    lib.ringctx_decode_scores_q8.argtypes = [ptr, i64, i64, i64, ptr, ptr, i32, i64, f32, ptr, i32]
    lib.ringctx_decode_pv_q8.argtypes = [ptr, i64, i64, i64, ptr, ptr, i32, i64, ptr, i32]
    lib.ringctx_decode_attention.argtypes = [ptr, i64, i64, i64, ptr, ptr, i32, ptr, ptr, i32, i64, f32, ptr, ptr, i32]
    shape, layer = ctypes.POINTER(DecoderShape), ctypes.POINTER(DecoderLayer)
    lib.ringctx_encode_e4m3.argtypes = [ptr, i64, ptr]
    lib.ringctx_encode_e4m3.restype = None
    lib.ringctx_decode_step_batch.argtypes = [shape, layer, i64, ptr, i64, ptr, ptr, ctypes.POINTER(AttentionSource),
                                              i64, i64, ptr, i32, MERGE_FN]
    lib.ringctx_decode_batch_work_floats.argtypes = [shape, i64, i32]
    lib.ringctx_decode_batch_work_floats.restype = i64
    lib.ringctx_decode_batch_offsets.argtypes = [shape, i64, ptr]
    lib.ringctx_decode_batch_offsets.restype = None
    lib.ringctx_prefill_rows.argtypes = [shape, layer, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i32]
    lib.ringctx_prefill_work_floats.argtypes = [shape, i64, i32]
    lib.ringctx_prefill_work_floats.restype = i64
    lib.ringctx_rms_norm_rows.argtypes = [ptr, i64, ptr, i64, i64, f32, i32, ptr, i64, i32]
    lib.ringctx_rope_rows.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i32, i32]
    lib.ringctx_swiglu_rows.argtypes = [ptr, i64, i64, i64, i32, i32]
    lib.ringctx_merge_rows.argtypes = [ptr, i64, ptr, i64, ptr, i32, i64, i64, ptr, i64, i64, i64, i64]
    for name in ("ringctx_flash_attention", "ringctx_flash_attention_bf16"):
        getattr(lib, name).argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i32, f32,
                                       ptr, i64, i64, ptr, i32]
    if variant.amx:
        lib.ringctx_amx_attention.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64,
                                              i32, f32, ptr, i64, i64, ptr, i32]
        lib.ringctx_amx_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32, i32]
    # ringctx_gemv, ringctx_decode_*, the *_rows kernels, ringctx_amx_*: int (ctypes' default)


def _load_variant(variant: Variant) -> ctypes.CDLL | None:
    """The built and checked library of `variant` (once per process), or None (see _errors)."""
    if variant.name in _libraries:  # asked before every kernel call: no lock once it is known
        return _libraries[variant.name]
    with _lock:
        if variant.name in _libraries:
            return _libraries[variant.name]
        lib = None
        try:
            directory = _source_dir()
            if directory is None:
                raise RuntimeError("the C sources (csrc/cpu_*.c) were not found (set RINGCTX_CSRC_DIR)")
            lib = ctypes.CDLL(str(_compile(directory, variant)))
            _bind(lib, variant)
            if lib.ringctx_simd_width() != variant.vector_floats or not lib.ringctx_cpu_kernels_supported():
                raise RuntimeError(f"the {variant.name} library does not run on this CPU")
        except Exception as e:  # noqa: BLE001 - no compiler, compile error, unsupported CPU: use PyTorch
            lib = None
            _errors[variant.name] = f"CPU kernels unavailable: {e}"
        _libraries[variant.name] = lib
        return lib


def _load() -> ctypes.CDLL | None:
    """The library of the variant `choose_variant` picks (built on first use), or None."""
    variant, _ = choose_variant()
    return None if variant is None else _load_variant(variant)


def active_variant() -> Variant | None:
    """The variant the kernels run as here (None when they do not run)."""
    variant, _ = choose_variant()
    return variant if variant is not None and _load_variant(variant) is not None else None


def kernel_error() -> str | None:
    """Why the kernels are not in use (None when they are, or were not tried yet)."""
    variant, why = choose_variant()
    if variant is None:
        return f"CPU kernels unavailable: {why}"
    return _errors.get(variant.name)


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first use), or None where it is unavailable."""
    return _load()


KERNEL_NAMES = ("fused decode step", "fused short prefill", "GEMV", "int8 weights GEMV", "decode attention (model dtype)",
                "decode attention (int8, fp8)", "RMSNorm/RoPE/SwiGLU rows", "float32 flash attention",
                "AMX bf16 attention")
"""What `cpu_kernels_report` says of, one entry each."""


def cpu_kernels_report() -> dict:
    """What runs on this CPU, for `ringctx info` (builds the kernels): the variant and why it was
    chosen, the variants this CPU runs, and for each kernel "in use" or why it is not."""
    variant, why = choose_variant()
    lib = None if variant is None else _load_variant(variant)
    if lib is None:
        reason = kernel_error() or why
        kernels = {name: f"not in use: {reason} (PyTorch runs instead)" for name in KERNEL_NAMES}
    else:
        kernels = {name: "in use" for name in KERNEL_NAMES}
        if not variant.reads_int8_weights:
            kernels["int8 weights GEMV"] = (f"not in use: the {variant.name} variant widens int8 codes slower than "
                                            "it reads bf16 (--weights int8 decodes from the bf16 values)")
        from .cpu_features import cpu_has_fast_bf16

        if cpu_has_fast_bf16():
            kernels["fused short prefill"] = ("not in use: this CPU computes bf16 natively (a question's rows "
                                              "take the AMX or PyTorch kernels)")
        amx_reason = amx_unavailable_reason()
        if amx_reason is not None:
            kernels["AMX bf16 attention"] = f"not in use: {amx_reason} (bf16 attention uses PyTorch's op)"
    return {
        "variant": None if lib is None else variant.name,
        "vector_floats": None if lib is None else variant.vector_floats,
        "why": why if lib is not None else (kernel_error() or why),
        "variants_this_cpu_runs": [v.name for v in VARIANTS if runs_here(v) is None],
        "kernels": kernels,
    }


def cpu_kernels_status() -> str:
    """One line of `cpu_kernels_report`: the variant in use, or why none is."""
    report = cpu_kernels_report()
    if report["variant"] is None:
        return report["why"]
    off = [f"{name} ({state[len('not in use: '):]})" for name, state in report["kernels"].items() if state != "in use"]
    return (f"{report['variant']} ({report['vector_floats']} floats a vector; {report['why']}): "
            + ", ".join(name for name, state in report["kernels"].items() if state == "in use")
            + (f"; not in use: {'; '.join(off)}" if off else ""))


MERGE_FN = ctypes.CFUNCTYPE(None)
"""The decode step's per-layer callback over several ranks (see ringctx_merge_fn in csrc/cpu_decode.c)."""

MAX_BATCH = 64
"""Most rows `ringctx_decode_step_batch` takes (MAX_BATCH of csrc/cpu_decode.c)."""


class DecoderShape(ctypes.Structure):
    """ringctx_decoder_shape of csrc/cpu_decode.c: a model's sizes for `ringctx_decode_step_batch`."""

    _fields_ = [("dim", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("n_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("ffn_dim", ctypes.c_int64), ("norm_eps", ctypes.c_float),
                ("softmax_scale", ctypes.c_float), ("bf16", ctypes.c_int32)]


class DecoderLayer(ctypes.Structure):
    """ringctx_decoder_layer of csrc/cpu_decode.c: data pointers of one layer's weights (NULL for an
    absent bias and for the q/k norms of models without them)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "attention_norm", "wqkv", "bqkv", "wo", "bo", "ffn_norm", "w13", "w2", "q_norm", "k_norm", "wqkv_codes", "wo_codes", "w13_codes", "w2_codes", "wqkv_exps",
        "wo_exps", "w13_exps", "w2_exps")]
    """The *_codes and *_exps fields: int8 weights' codes and exponents beside their bf16 values in
    w* (ringctx/model/int8_weights.py), or NULL."""


class AttentionSource(ctypes.Structure):
    """ringctx_attention_source of csrc/cpu_decode.c: one KV cache the batched decode step attends,
    and which of the batch's rows attend it (see FusedBatchStep in ringctx/model/decode_step.py)."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("n_rows", ctypes.c_int64),
                ("keys", ctypes.c_int64), ("write_row", ctypes.c_int64), ("kv_q8", ctypes.c_int32)]


def encode_e4m3(x: torch.Tensor) -> torch.Tensor | None:
    """The fused decode step's float -> float8 e4m3 bytes (uint8, |x| <= 448), or None without the
    kernels: to check it against PyTorch's cast."""
    lib = _load()
    if lib is None:
        return None
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.ringctx_encode_e4m3(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 max_rows: int = MAX_ROWS) -> torch.Tensor | None:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out] in x's dtype, or None where the kernel does
    not apply (the caller then uses F.linear).

    Applies to inference on the CPU with 1 <= T <= max_rows rows, weight contiguous, no gradient
    wanted, and x and weight both bf16 or both float32. Float32 accumulation, one rounding at the end;
    a row's sums in the same order whatever T (the same bits alone or among other rows).
    """
    dtype = x.dtype
    if not (dtype == weight.dtype and dtype in (torch.float32, torch.bfloat16)
            and x.device.type == weight.device.type == "cpu" and x.dim() == 2 and weight.dim() == 2
            and 1 <= x.shape[0] <= max_rows and x.shape[1] == weight.shape[1] and weight.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    lib = _load()
    if lib is None:
        return None
    rows, n_in = x.shape
    n_out = weight.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(rows, n_out, dtype=torch.float32)
    status = lib.ringctx_gemv(xf.data_ptr(), rows, n_in, weight.data_ptr(), int(dtype == torch.bfloat16), n_out,
                              y.data_ptr(), torch.get_num_threads())
    if status != 0:
        return None
    if bias is not None:
        y.add_(bias.float())
    return y.to(dtype)


INT8_MAX_ROWS = 1
"""Most activation rows `small_linear_int8` (and the fused batch step, csrc/cpu_decode.c) read int8
codes for: each row widens the codes again, dearer than widening bf16, so that a batch step at 8K
tokens took 0.94x the time of the values' with one row and 1.00-1.20x with 2-8; more rows read
the bf16 values (the same sums)."""


def reads_int8_weights() -> bool:
    """Whether decode kernels here read int8 weights' codes (see Variant.reads_int8_weights)."""
    variant, _ = choose_variant()
    return variant is not None and variant.reads_int8_weights and _load_variant(variant) is not None


def small_linear_int8(x: torch.Tensor, codes: torch.Tensor, exponents: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, in] @ W^T (+ bias) -> [T, out] bf16 for W[o, i] = codes[o, i] * 2^exponents[o, i // 64]
    (ringctx/model/int8_weights.py), or None where the kernel does not apply (the caller then uses
    the bf16 weights holding the same values).

    Applies to bf16 x on the CPU with 1 <= T <= INT8_MAX_ROWS rows, codes int8 [out, in] and exponents
    int8 [out, in // 64] contiguous, in a multiple of 64, with a kernel variant that reads int8
    weights (`reads_int8_weights`). The result equals `small_linear` over the bf16 weights
    codes * 2^exponents bit for bit (the same products summed in the same order).
    """
    if not (x.dtype == torch.bfloat16 and x.device.type == codes.device.type == "cpu" and x.dim() == 2
            and 1 <= x.shape[0] <= INT8_MAX_ROWS and codes.dtype == exponents.dtype == torch.int8
            and codes.dim() == 2 and x.shape[1] == codes.shape[1] and codes.shape[1] % 64 == 0
            and exponents.shape == (codes.shape[0], codes.shape[1] // 64)
            and codes.is_contiguous() and exponents.is_contiguous()):
        return None
    if (torch.is_grad_enabled() and x.requires_grad) or not reads_int8_weights():
        return None
    lib = _load()
    rows, n_in = x.shape
    n_out = codes.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(rows, n_out, dtype=torch.float32)
    status = lib.ringctx_gemv_q8(xf.data_ptr(), rows, n_in, codes.data_ptr(), exponents.data_ptr(), n_out,
                                 y.data_ptr(), torch.get_num_threads())
    if status != 0:
        return None
    if bias is not None:
        y.add_(bias.float())
    return y.to(torch.bfloat16)


MAX_QUERY_ROWS_PER_KV_HEAD = 64
"""Most query rows per KV head (GQA group x query tokens) the decode attention kernels take (MAX_R)."""


def decode_kernels_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `decode_attention` (and the two-pass `decode_scores`, `decode_pv`) take these inputs
    (and the kernels are built):
    q [T, Hq, D], k and v [S, Hkv, D] contiguous, all float32 or all bf16, on the CPU, S >= 1,
    D a multiple of 16 up to 256, at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV head."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)
            and q.device.type == k.device.type == v.device.type == "cpu" and k.shape == v.shape
            and k.shape[0] > 0 and Hq % Hkv == 0 and D % 16 == 0 and D <= 256
            and Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD and k.is_contiguous() and v.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return _load() is not None


def decode_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """softmax(scale Q K^T) V per KV head and its log-sum-exp, in one pass over the token-major cache
    (see decode_kernels_apply; S == 0 allowed).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read; k, v:
    [S, Hkv, D] float32 or bf16. Returns (out [Hkv, R, D] float32, lse [Hkv, R] float32, natural
    log; zeros and -inf when S == 0), or None if the kernel refused.
    """
    return _decode_attention(qg, k, v, None, None, -1, int(k.dtype == torch.bfloat16), scale)


def decode_attention_q8(qg: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                        v_scale: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`decode_attention` over an 8-bit cache read in place (see decode_q8_kernels_apply; S == 0
    allowed): k_data, v_data [S, Hkv, D] int8 or float8_e4m3fn (one format for both), k_scale,
    v_scale [S, Hkv] float32 contiguous. Returns (out [Hkv, R, D], lse [Hkv, R]) float32, or None
    if the kernel refused (K and V in different formats)."""
    if k_data.dtype != v_data.dtype:
        return None
    return _decode_attention(qg, k_data, v_data, k_scale, v_scale, Q8_KINDS[k_data.dtype], 0, scale)


def _decode_attention(qg, k, v, k_scale, v_scale, q8_kind: int, bf16: int, scale: float):
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    out = torch.empty(Hkv, rows, D)
    lse = torch.empty(Hkv, rows)
    status = lib.ringctx_decode_attention(
        qg.data_ptr(), Hkv, rows, D, k.data_ptr(), v.data_ptr(), bf16,
        None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
        q8_kind, k.shape[0], scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    return (out, lse) if status == 0 else None


def decode_scores(qg: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor | None:
    """scale * Q K^T per KV head, reading the token-major cache in place (see decode_kernels_apply).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read;
    k: [S, Hkv, D]. Returns float32 [Hkv, R, S], or None if the kernel refused.
    """
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    S = k.shape[0]
    scores = torch.empty(Hkv, rows, S)
    status = lib.ringctx_decode_scores(qg.data_ptr(), Hkv, rows, D, k.data_ptr(), int(k.dtype == torch.bfloat16),
                                       S, scale, scores.data_ptr(), torch.get_num_threads())
    return scores if status == 0 else None


def decode_pv(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """P V per KV head, reading the token-major cache in place (see decode_kernels_apply).

    probs: [Hkv, R, S] float32 contiguous; v: [S, Hkv, D]. Returns float32 [Hkv, R, D], or None if
    the kernel refused (it allocates one partial sum per thread).
    """
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, S = probs.shape
    D = v.shape[2]
    out = torch.empty(Hkv, rows, D)
    status = lib.ringctx_decode_pv(probs.data_ptr(), Hkv, rows, S, v.data_ptr(), int(v.dtype == torch.bfloat16),
                                   D, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


Q8_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1}
"""The 8-bit cache formats the q8 decode kernels read (ringctx/attention/quant.py), and their `kind`
code in csrc/cpu_kernels.c."""


def decode_q8_kernels_apply(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                            v_scale: torch.Tensor) -> bool:
    """True when `decode_attention_q8` (K and V in one format; and the two-pass `decode_scores_q8`,
    `decode_pv_q8`) take these inputs (and the kernels are built):
    q [T, Hq, D] float32, bf16 or fp16; k_data and v_data [S, Hkv, D] int8 or float8_e4m3fn (each
    its own), contiguous; k_scale and v_scale [S, Hkv] float32 contiguous; all on the CPU, S >= 1, D
    a multiple of 16 up to 256, at most MAX_QUERY_ROWS_PER_KV_HEAD query rows per KV head."""
    T, Hq, D = q.shape
    S, Hkv = k_data.shape[:2]
    tensors = (q, k_data, k_scale, v_data, v_scale)
    if not (q.dtype in (torch.float32, torch.bfloat16, torch.float16) and k_data.dtype in Q8_KINDS
            and v_data.dtype in Q8_KINDS and k_scale.dtype == v_scale.dtype == torch.float32
            and all(t.device.type == "cpu" for t in tensors) and k_data.dim() == 3 and k_data.shape == v_data.shape
            and k_scale.shape == v_scale.shape == (S, Hkv) and S > 0 and k_data.shape[2] == D
            and Hq % Hkv == 0 and D % 16 == 0 and D <= 256 and Hq // Hkv * T <= MAX_QUERY_ROWS_PER_KV_HEAD
            and all(t.is_contiguous() for t in tensors[1:])):
        return False
    if torch.is_grad_enabled() and q.requires_grad:
        return False
    return _load() is not None


def decode_scores_q8(qg: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, scale: float) -> torch.Tensor | None:
    """scale * Q K^T per KV head over an 8-bit cache read in place (see decode_q8_kernels_apply).

    qg: [Hkv, R, D] float32 contiguous, the query rows grouped by the KV head they read; k_data:
    [S, Hkv, D] int8 or float8_e4m3fn; k_scale: [S, Hkv] float32 (key j of head h is
    k_data[j, h] * k_scale[j, h]). Returns float32 [Hkv, R, S], or None if the kernel refused.
    """
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, D = qg.shape
    S = k_data.shape[0]
    scores = torch.empty(Hkv, rows, S)
    status = lib.ringctx_decode_scores_q8(qg.data_ptr(), Hkv, rows, D, k_data.data_ptr(), k_scale.data_ptr(),
                                          Q8_KINDS[k_data.dtype], S, scale, scores.data_ptr(), torch.get_num_threads())
    return scores if status == 0 else None


def decode_pv_q8(probs: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor | None:
    """P V per KV head over an 8-bit cache read in place (see decode_q8_kernels_apply).

    probs: [Hkv, R, S] float32 contiguous; v_data: [S, Hkv, D] int8 or float8_e4m3fn; v_scale:
    [S, Hkv] float32. Returns float32 [Hkv, R, D], or None if the kernel refused (it allocates one
    partial sum per thread).
    """
    lib = _load()
    if lib is None:
        return None
    Hkv, rows, S = probs.shape
    D = v_data.shape[2]
    out = torch.empty(Hkv, rows, D)
    status = lib.ringctx_decode_pv_q8(probs.data_ptr(), Hkv, rows, S, v_data.data_ptr(), v_scale.data_ptr(),
                                      Q8_KINDS[v_data.dtype], D, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def _rows_apply(*tensors: torch.Tensor) -> bool:
    """The row kernels take CPU tensors of one dtype, float32 or bf16, unit stride along the last
    dim, when no gradient is wanted."""
    dtype = tensors[0].dtype
    if not all(t.dtype == dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors):
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """round(x * rsqrt(mean(x^2) + eps) * weight) for x [T, dim] -> new [T, dim] in x's dtype,
    float32 inside (what F.rms_norm computes); None where the kernel does not apply."""
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1] or not weight.is_contiguous() \
            or not _rows_apply(x, weight):
        return None
    lib = _load()
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    status = lib.ringctx_rms_norm_rows(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                       int(x.dtype == torch.bfloat16), out.data_ptr(), out.stride(0),
                                       torch.get_num_threads())
    return out if status == 0 else None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE of x [T, H, D] in place: x = round(round(x cos) + roll(x, D/2) sin), with cos,
    sin [T, 1, D] contiguous (ringctx's RopeAngles). False (x untouched) where the kernel does not
    apply."""
    T, H, D = x.shape
    if cos.shape != (T, 1, D) or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()) \
            or D % 2 or D > 256 or not _rows_apply(x, cos, sin):
        return False
    lib = _load()
    if lib is None:
        return False
    return lib.ringctx_rope_rows(x.data_ptr(), T, H, D, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                 int(x.dtype == torch.bfloat16), torch.get_num_threads()) == 0


def merge_rows(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Merge a partial attention result (out [n, H, D] float32 or bf16, lse [H, n]) into running
    float32 state acc_out [n, H, D] (rows contiguous) and acc_lse [H, n], in place, as
    attention/merge.py's PartialAccumulator.add does (empty-row markers, -inf weighs 0). False
    (nothing touched) where the kernel does not apply."""
    n, H, D = out.shape
    if not (acc_out.dtype == acc_lse.dtype == torch.float32 and out.dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" for t in (acc_out, acc_lse, out, lse))
            and acc_out.shape == out.shape and acc_lse.shape == lse.shape == (H, n)
            and acc_out.stride(1) == D and acc_out.stride(2) == 1 and out.stride(2) == 1 and acc_lse.stride(1) == 1):
        return False
    if torch.is_grad_enabled() and out.requires_grad:
        return False
    lib = _load()
    if lib is None:
        return False
    lse = lse.float()
    if lse.stride(1) != 1:
        lse = lse.contiguous()
    return lib.ringctx_merge_rows(acc_out.data_ptr(), acc_out.stride(0), acc_lse.data_ptr(), acc_lse.stride(0),
                                  out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0), out.stride(1),
                                  lse.data_ptr(), lse.stride(0), n, H, D) == 0


def swiglu_(gate_up: torch.Tensor, ffn: int) -> bool:
    """gate = round(round(silu(gate)) * up) in place over the gate half of gate_up [T, 2 ffn] (gate
    columns first). False (untouched) where the kernel does not apply."""
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * ffn or not _rows_apply(gate_up):
        return False
    lib = _load()
    if lib is None:
        return False
    return lib.ringctx_swiglu_rows(gate_up.data_ptr(), gate_up.shape[0], ffn, gate_up.stride(0),
                                   int(gate_up.dtype == torch.bfloat16), torch.get_num_threads()) == 0


AMX_HEAD_DIMS = "a multiple of 32 up to 256"


def amx_available() -> bool:
    """True when this CPU and OS run the AMX attention kernel (AMX-BF16 and AVX512-BF16, the tile
    state granted by Linux) and the kernels are built."""
    return _amx_library() is not None


def _amx_library() -> ctypes.CDLL | None:
    """The kernels' library where its AMX kernels run here (see amx_available), else None."""
    if os.environ.get("RINGCTX_AMX", "1") == "0":
        return None
    variant, _ = choose_variant()
    if variant is None or not variant.amx:
        return None
    lib = _load_variant(variant)
    return lib if lib is not None and _amx_granted(lib) else None


@functools.lru_cache(maxsize=None)
def _amx_granted(lib: ctypes.CDLL) -> bool:
    """The library's answer to "may this process use the tiles" (it asks Linux once per process)."""
    return bool(lib.ringctx_amx_available())


def amx_unavailable_reason() -> str | None:
    """Why the AMX attention kernel is not in use here (None when it is)."""
    if amx_available():
        return None
    if os.environ.get("RINGCTX_AMX", "1") == "0":
        return "disabled by RINGCTX_AMX=0"
    if kernel_error():
        return kernel_error()
    variant = active_variant()
    if variant is not None and not variant.amx:
        return f"the {variant.name} variant has no AMX kernel"
    return "this CPU has no AMX-BF16, or Linux did not grant the tile state"


def amx_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `amx_attention` takes these inputs: q [T, Hq, D], k and v [S, Hkv, D], all bf16 on
    the CPU with unit stride along D, T and S >= 1, Hq a multiple of Hkv, D a multiple of 32 up to
    256, no gradient wanted, and AMX available."""
    return _flash_inputs_fit(q, k, v, torch.bfloat16) and q.shape[2] % 32 == 0 and amx_available()


def _flash_inputs_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> bool:
    """What both flash kernels need of their inputs (the head dim's multiple aside): q [T, Hq, D], k
    and v [S, Hkv, D], all `dtype` on the CPU with unit stride along D, T and S >= 1, Hq a multiple
    of Hkv, D up to 256, no gradient wanted."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    if not (q.dtype == k.dtype == v.dtype == dtype and q.device.type == k.device.type == v.device.type == "cpu"
            and k.shape == v.shape and T >= 1 and S >= 1 and Hkv >= 1 and Hq % Hkv == 0 and D <= 256
            and q.stride(2) == k.stride(2) == v.stride(2) == 1):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention with AMX (see amx_attention_applies for what it takes; causal needs T == S).

    Returns out [T, Hq, D] bf16 (contiguous) and lse [Hq, T] float32, natural log, -inf and zeros
    for rows that see no key.
    """
    return _flash_call(_load().ringctx_amx_attention, q, k, v, causal, scale, torch.bfloat16)


def _flash_call(kernel, q, k, v, causal: bool, scale: float, out_dtype: torch.dtype):
    """Call a flash kernel of the C signature ringctx_amx_attention and ringctx_flash_attention share
    (q, k, v and out by row and head strides; lse [Hq, T]) on all of torch's threads."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    out = torch.empty(T, Hq, D, dtype=out_dtype)
    lse = torch.empty(Hq, T, dtype=torch.float32)
    status = kernel(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                    v.stride(0), v.stride(1), T, S, Hq, Hkv, D, int(causal), scale, out.data_ptr(), out.stride(0),
                    out.stride(1), lse.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"{kernel.__name__} failed with status {status} "
                           f"(q {tuple(q.shape)}, k {tuple(k.shape)}, causal={causal})")
    return out, lse


def flash_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `flash_attention` takes these inputs: q [T, Hq, D], k and v [S, Hkv, D], all
    float32 or all bf16 on the CPU with unit stride along D, T and S >= 1, Hq a multiple of Hkv, D
    a multiple of the variant's vector (16 floats on avx512, 8 on avx2, 4 portable) up to 256, no
    gradient wanted, and the kernels built."""
    if not (_flash_inputs_fit(q, k, v, torch.float32) or _flash_inputs_fit(q, k, v, torch.bfloat16)):
        return False
    return flash_attention_built(q.shape[2])


def flash_attention_built(head_dim: int) -> bool:
    """True when the kernels are built and `flash_attention` takes this head dim (a multiple of the
    variant's vector, up to 256)."""
    variant = active_variant()
    return variant is not None and head_dim <= 256 and head_dim % variant.vector_floats == 0


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention in float32 on the vector units (csrc/cpu_flash.c; see flash_attention_applies
    for what it takes; causal needs T == S, query t then sees keys 0..t). bf16 inputs are widened
    as the kernel reads them: the same bits as on their float32 copies, without making them.

    Returns out [T, Hq, D] float32 (contiguous) and lse [Hq, T] float32, natural log. A row's
    result depends on its own query and the keys alone, not on the threads or the other rows.
    """
    lib = _load()
    kernel = lib.ringctx_flash_attention_bf16 if q.dtype == torch.bfloat16 else lib.ringctx_flash_attention
    return _flash_call(kernel, q, k, v, causal, scale, torch.float32)


AMX_LINEAR_ROWS = (9, 48)
"""Rows of x that `amx_linear` takes: above small_linear's MAX_ROWS (decode steps keep their own
kernel, whose rows do not depend on the batch) up to 48, where PyTorch's matmul caught up
(measured: csrc/cpu_attention_amx.c; the kernel itself takes up to 64)."""


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out] bf16 on AMX's tiles, or None where it does
    not apply (the caller then uses F.linear): bf16 x and weight on the CPU, AMX_LINEAR_ROWS rows,
    `in` a multiple of 32, `out` of 16, weight contiguous, no gradient wanted. Exact products,
    float32 sums, one rounding at the end (a native bf16 GEMM's contract); the weight is read in
    place, once for all rows (csrc/cpu_attention_amx.c)."""
    lo, hi = AMX_LINEAR_ROWS
    if not (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and x.dim() == 2 and weight.dim() == 2 and lo <= x.shape[0] <= hi and x.shape[1] == weight.shape[1]
            and x.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0 and weight.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    lib = _amx_library()
    if lib is None:
        return None
    x = x.contiguous()
    # float32 out only to add a bias before the one rounding
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32 if bias is not None else torch.bfloat16)
    status = lib.ringctx_amx_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                                    y.data_ptr(), int(bias is None), torch.get_num_threads())
    if status != 0:
        return None
    return y if bias is None else y.add_(bias.float()).to(torch.bfloat16)
