"""The CPU kernels' library (csrc/cpu_*.c): its variants, its build with the system C compiler, and
its loading through ctypes.

Variants: the kernels are written once, on GCC/Clang vector types (csrc/cpu_simd.h), and built
once per vector ISA with that ISA's -m flags (VARIANTS): "avx512" (16 floats a vector; also holds
the AMX attention), "avx2" (8: AVX2, FMA, F16C: x86-64 CPUs since 2013-2015, AMD Zen 1-3) and
"portable" (4: the target's baseline, SSE2 on x86-64, NEON on arm64). The first variant that this
CPU runs is used (`choose_variant`); RINGCTX_CPU_ISA names another.

How: the C files have no PyTorch headers, so the system C compiler builds a variant in a few
seconds the first time it is needed; the library is cached under ~/.cache/ringctx (or
$RINGCTX_CACHE_DIR), keyed by a hash of the sources and flags, written atomically, and called
through ctypes (which releases the GIL). On loading, the library's struct layout is checked
against kernels/abi.py's copy. Without a C compiler, a variant this CPU runs or a matching layout,
`library()` is None, the wrappers (kernels/cpu.py) return None and callers use PyTorch;
`kernel_error()` says why.

Environment:
    RINGCTX_CPU_KERNELS=0   never build or use the kernels
    RINGCTX_CPU_ISA         avx512, avx2 or portable: use that variant (default: auto, the widest
                            this CPU runs)
    RINGCTX_AMX=0           never use the AMX kernels (bf16 attention then uses PyTorch's op)
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

from . import abi, cpu_features
from .abi import AttentionSource, DecoderLayer, DecoderShape, MERGE_FN
from .paths import csrc_dir

_SOURCES = ("cpu_kernels.c", "cpu_token_ops.c", "cpu_decode.c", "cpu_flash.c", "cpu_gated_delta.c")
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


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runs_here(variant: Variant) -> str | None:
    """None when this CPU runs `variant`, else why not (the flags it lacks)."""
    if variant.x86_only and not _is_x86_64():
        return f"{variant.name} is for x86-64 CPUs; this one is {platform.machine()}"
    missing = sorted(variant.cpu_flags - cpu_features.cpu_flags())
    return f"this CPU has no {', '.join(missing)}" if missing else None


def choose_variant() -> tuple[Variant | None, str]:
    """The variant to use here and why: use_variant's or RINGCTX_CPU_ISA's choice, else the widest
    this CPU runs. (None, reason) when the kernels are off or the named variant cannot run."""
    # Asked before every kernel call (hundreds per question's prefill): the answer is kept per
    # setting, and the settings are read each time, so that a test may change them at run time.
    return _choose(os.environ.get("RINGCTX_CPU_KERNELS", "1"), _forced, os.environ.get("RINGCTX_CPU_ISA", "auto"),
                   cpu_features.cpu_flags())


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
    paths.csrc_dir)."""
    return csrc_dir(_SOURCES + (_AMX_SOURCE, _DETECT_SOURCE) + _HEADERS)


def cache_dir() -> Path:
    """Where the built libraries are kept (and other per-machine results, see
    planning/machine_speed.py): $RINGCTX_CACHE_DIR, else ~/.cache/ringctx."""
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
    target = cache_dir() / f"cpu_kernels-{variant.name}-{digest.hexdigest()[:16]}.so"
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
    lib.ringctx_decode_step_batch.argtypes = [shape, layer, i64, ptr, i64, ptr, ptr, ptr, i64,
                                              ctypes.POINTER(AttentionSource), i64, i64, ptr, i32, MERGE_FN]
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
    lib.ringctx_sum_buffers.argtypes = [ptr, i32, i64, i32, ptr, i32]
    lib.ringctx_merge_rows.argtypes = [ptr, i64, ptr, i64, ptr, i32, i64, i64, ptr, i64, i64, i64, i64]
    # q, k, v (pointer, row and head strides), T, S, Hq, Hkv, D, causal, q_offset, window, scale, softcap,
    # out (pointer, strides), lse, threads
    flash = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i32, i64, i64, f32, f32, ptr, i64,
             i64, ptr, i32]
    assert len(flash) == abi.FLASH_ARGS  # the count the library reports (checked by abi.check_layout)
    for name in ("ringctx_flash_attention", "ringctx_flash_attention_bf16"):
        getattr(lib, name).argtypes = flash
    # q, k, v, g, beta, state, out (pointers), B, T, H, Dk, Dv, threads
    gated_delta = [ptr] * 7 + [i64] * 5 + [i32]
    assert len(gated_delta) == abi.GATED_DELTA_ARGS
    lib.ringctx_gated_delta.argtypes = gated_delta
    if variant.amx:
        lib.ringctx_amx_attention.argtypes = flash
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
            abi.check_layout(lib)
        except Exception as e:  # noqa: BLE001 - no compiler, compile error, unsupported CPU: use PyTorch
            lib = None
            _errors[variant.name] = f"CPU kernels unavailable: {e}"
        _libraries[variant.name] = lib
        return lib


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
    """The library of the variant `choose_variant` picks (built on first use), or None where it is
    unavailable (`kernel_error` says why)."""
    variant, _ = choose_variant()
    return None if variant is None else _load_variant(variant)


def amx_library() -> ctypes.CDLL | None:
    """The kernels' library where its AMX kernels run here, else None: the CPU and OS run them
    (AMX-BF16 and AVX512-BF16, the tile state granted by Linux), the variant holds them and
    RINGCTX_AMX is not 0."""
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
