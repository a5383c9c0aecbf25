"""The C ABI of the CPU kernels' library: the structs and limits Python shares with csrc/cpu_decode.c
and csrc/cpu_kernels.h, and the check that both sides agree.

ctypes knows nothing of the C headers: each Structure below is a hand copy of a C struct, and each
limit a hand copy of a C macro. A field added, moved or resized on one side only would have a step
read the wrong bytes. So the library reports its own layout (`ringctx_abi_fields`: sizeof of each
struct, offset and size of each field; `ringctx_abi_limits`: the macros' values), and the loader
(kernels/build.py) calls `check_layout` before any kernel runs: on a mismatch the library is not
used (the kernels are reported unavailable, naming the struct and field, and PyTorch runs instead).
Field types of one size (int32 and float) cannot be told apart this way; their names and places can.
"""

from __future__ import annotations

import ctypes

import torch

MAX_BATCH = 64
"""Most rows `ringctx_decode_step_batch` and `ringctx_prefill_rows` take (MAX_BATCH of
csrc/cpu_decode.c)."""

MAX_QUERY_ROWS_PER_KV_HEAD = 64
"""Most query rows per KV head (GQA group x query tokens) the decode attention kernels take (MAX_R
of csrc/cpu_kernels.h); kernels/selection.py gives blocks up to it to the decode kernel, and the
Triton decode kernel (attention/triton_attn.py) takes the same rows on GPUs."""

MAX_HEAD_DIM = 256
"""Widest head the attention kernels, RoPE and the fused steps take (MAX_D of csrc/cpu_kernels.h)."""

MAX_EXPERTS = 512
"""Most experts of a layer the fused decode step routes among (MAX_EXPERTS of csrc/cpu_decode.c)."""

MAX_EXPERTS_PER_TOKEN = 16
"""Most experts a row goes through in the fused decode step (MAX_EXPERTS_PER_TOKEN of
csrc/cpu_decode.c)."""

INT8_MAX_ROWS = 1
"""Most activation rows `small_linear_int8` (and the fused batch step, INT8_MAX_ROWS of
csrc/cpu_decode.c) read int8 codes for: each row widens the codes again, dearer than widening
bf16, so that a batch step at 8K tokens took 0.94x the time of the values' with one row and
1.00-1.20x with 2-8; more rows read the bf16 values (the same sums). kernels/selection.py reads it."""

FLASH_ARGS = 24
"""Arguments of the flash kernels' C entry points (ringctx_flash_attention, its _bf16 twin and
ringctx_amx_attention; FLASH_ARGS of csrc/cpu_kernels.h): q, k, v by pointer and row and head
strides, T, S, Hq, Hkv, D, causal, q_offset, window, scale, softcap, out by pointer and strides,
lse, threads. build.py declares that many argtypes; the library reports its count, so a library of
another signature (21 arguments before the mask's q_offset, window and softcap) is not used."""

GATED_DELTA_ARGS = 13
"""Arguments of `ringctx_gated_delta` (csrc/cpu_gated_delta.c; GATED_DELTA_ARGS of csrc/cpu_kernels.h):
q, k, v, g, beta, state, out by pointer, B, T, H, Dk, Dv, threads. Checked like FLASH_ARGS."""

Q8_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1}
"""The 8-bit cache formats the q8 decode kernels read (ringctx/attention/quant.py), and their `kind`
code in csrc/cpu_kernels.h (Q8_INT8, Q8_FP8)."""

MERGE_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64)
"""The decode step's per-layer callback over several ranks, given the layer's index (see
ringctx_merge_fn in csrc/cpu_decode.c)."""


class DecoderShape(ctypes.Structure):
    """ringctx_decoder_shape of csrc/cpu_decode.c: a model's sizes for `ringctx_decode_step_batch`."""

    _fields_ = [("dim", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("n_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("ffn_dim", ctypes.c_int64), ("norm_eps", ctypes.c_float),
                ("softmax_scale", ctypes.c_float), ("bf16", ctypes.c_int32), ("n_experts", ctypes.c_int64),
                ("experts_per_token", ctypes.c_int64), ("expert_ffn_dim", ctypes.c_int64),
                ("renormalize", ctypes.c_int32), ("weights_in_model_dtype", ctypes.c_int32)]
    """n_experts .. weights_in_model_dtype: the `Experts` of every layer that has a router (0
    experts: none has)."""


class DecoderLayer(ctypes.Structure):
    """ringctx_decoder_layer of csrc/cpu_decode.c: data pointers of one layer's weights (NULL for an
    absent bias and for the q/k norms of models without them), then its attention as data."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "attention_norm", "wqkv", "bqkv", "wo", "bo", "ffn_norm", "w13", "w2", "q_norm", "k_norm", "wqkv_codes",
        "wo_codes", "w13_codes", "w2_codes", "wqkv_exps", "wo_exps", "w13_exps", "w2_exps", "sinks")] + [
        ("window", ctypes.c_int64), ("chunk", ctypes.c_int64), ("rotary_dim", ctypes.c_int64),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("rope", ctypes.c_int32),
        ("router", ctypes.c_void_p)]
    """The *_codes and *_exps fields: int8 weights' codes and exponents beside their bf16 values in
    w* (ringctx/model/int8_weights.py), or NULL. sinks: [Hq] float32 sink logits or NULL; window,
    chunk: the layer's span (0: none); rotary_dim: dims that rotate; scale, softcap: its softmax
    settings; rope: which of the step's cos/sin tables rotates it (-1: a NoPE layer); router: a
    mixture of experts' router [E, dim] (w13, w2 then point to the [E, 2F, dim] and [E, dim, F]
    experts), or NULL: the dense MLP."""


class AttentionSource(ctypes.Structure):
    """ringctx_attention_source of csrc/cpu_decode.c: one KV cache the batched decode step attends,
    and which of the batch's rows attend it (see FusedBatchStep in ringctx/model/decode_step.py)."""

    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("n_rows", ctypes.c_int64),
                ("keys", ctypes.c_int64), ("write_row", ctypes.c_int64), ("kv_q8", ctypes.c_int32),
                ("positions", ctypes.c_void_p), ("first_position", ctypes.c_int64), ("segments", ctypes.c_void_p),
                ("n_segments", ctypes.c_int64), ("stored_from", ctypes.c_void_p)]
    """positions: the rows' global positions (int64) or NULL (row j at first_position + j);
    segments: [n_segments] int64, the first row of each run of rows whose positions increase, or
    NULL (one); stored_from: [n_layers] int64, the first row each layer still stores, or NULL."""


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "ringctx_decoder_shape": DecoderShape,
    "ringctx_decoder_layer": DecoderLayer,
    "ringctx_attention_source": AttentionSource,
}
"""Each C struct the kernels take, by its C name, and the Structure that copies it."""

LIMITS: dict[str, int] = {
    "MAX_BATCH": MAX_BATCH,
    "MAX_R": MAX_QUERY_ROWS_PER_KV_HEAD,
    "MAX_D": MAX_HEAD_DIM,
    "INT8_MAX_ROWS": INT8_MAX_ROWS,
    "Q8_INT8": Q8_KINDS[torch.int8],
    "Q8_FP8": Q8_KINDS[torch.float8_e4m3fn],
    "FLASH_ARGS": FLASH_ARGS,
    "MAX_EXPERTS": MAX_EXPERTS,
    "MAX_EXPERTS_PER_TOKEN": MAX_EXPERTS_PER_TOKEN,
    "GATED_DELTA_ARGS": GATED_DELTA_ARGS,
}
"""Each C macro Python copies, by its C name, and the copy."""


class _Field(ctypes.Structure):
    """ringctx_abi_field of csrc/cpu_decode.c: a struct (offset 0, its sizeof) or one of its fields."""

    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_int64), ("size", ctypes.c_int64)]


class _Limit(ctypes.Structure):
    """ringctx_abi_limit of csrc/cpu_decode.c: a macro's name and value."""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def bind(lib: ctypes.CDLL) -> None:
    """Declare the two reporting entry points' types."""
    lib.ringctx_abi_fields.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.ringctx_abi_fields.restype = ctypes.POINTER(_Field)
    lib.ringctx_abi_limits.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.ringctx_abi_limits.restype = ctypes.POINTER(_Limit)


def c_layout(lib: ctypes.CDLL) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """What the library says: {"struct" or "struct.field": (offset, size)} and {macro: value}."""
    bind(lib)
    count = ctypes.c_int64()
    fields = lib.ringctx_abi_fields(ctypes.byref(count))
    layout = {fields[i].name.decode(): (fields[i].offset, fields[i].size) for i in range(count.value)}
    limits = lib.ringctx_abi_limits(ctypes.byref(count))
    return layout, {limits[i].name.decode(): limits[i].value for i in range(count.value)}


def layout_problems(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] | None = None,
                    limits: dict[str, int] | None = None) -> list[str]:
    """One line per difference between the library's layout and the Python copies (STRUCTS and
    LIMITS unless given), each naming the struct and field or the limit; [] when they agree."""
    structs = STRUCTS if structs is None else structs  # read at call time: a test may replace them
    limits = LIMITS if limits is None else limits
    c_fields, c_limits = c_layout(lib)
    problems = []
    for c_name, structure in structs.items():
        here = f"{structure.__module__}.{structure.__qualname__}"
        if c_name not in c_fields:
            problems.append(f"struct {c_name} ({here}) is not in the library's layout")
            continue
        size = ctypes.sizeof(structure)
        if size != c_fields[c_name][1]:
            problems.append(f"struct {c_name} is {c_fields[c_name][1]} bytes in C, {size} in {here}")
        names = [name for name, *_ in structure._fields_]
        for name in names:
            field = getattr(structure, name)
            c = c_fields.get(f"{c_name}.{name}")
            if c is None:
                problems.append(f"{c_name}.{name}: a field of {here} that the C struct does not have")
            elif c != (field.offset, field.size):
                problems.append(f"{c_name}.{name}: offset {c[0]}, {c[1]} bytes in C; offset {field.offset}, "
                                f"{field.size} bytes in {here}")
        for key in c_fields:
            if key.startswith(c_name + ".") and key.split(".", 1)[1] not in names:
                problems.append(f"{key}: a field of the C struct that {here} does not have")
    for name, value in limits.items():
        if c_limits.get(name) != value:
            problems.append(f"{name} is {c_limits.get(name, 'not reported')} in C, {value} in ringctx/kernels/abi.py")
    return problems


def check_layout(lib: ctypes.CDLL) -> None:
    """Raise RuntimeError naming every difference when the library's layout is not the Python one."""
    problems = layout_problems(lib)
    if problems:
        raise RuntimeError("the library's C structs differ from ringctx/kernels/abi.py (csrc/cpu_decode.c and "
                           "abi.py change together): " + "; ".join(problems))
