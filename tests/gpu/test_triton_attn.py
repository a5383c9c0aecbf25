"""The Triton attention kernel against the float64 reference.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before the
kernel is first built), with float32 (and float16) inputs: bf16 math is broken in the
interpreter. Shapes stay tiny because the interpreter executes every program in Python. On a
GPU machine the same tests run on CUDA.

The last tests compile the kernel for sm_90 with Triton's real compiler (no GPU needed): the
interpreter does not type-check constexpr branches the way the compiler does, so this is what
catches a kernel that would fail to build on the device.

Triton is required: a missing install fails here with a message (set RINGCTX_SKIP_TRITON=1 to
skip deliberately on a machine that cannot have it).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is first built

try:
    import triton  # noqa: F401

    _TRITON_ERROR = None
except Exception as e:  # noqa: BLE001
    _TRITON_ERROR = e

from ringctx.attention.reference import band_mask, reference_attention
from ringctx.attention.triton_attn import _forward, _plan, triton_attention_block, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5  # float32 against float64 (docs/ARCHITECTURE.md)


@pytest.fixture(autouse=True)
def _need_triton():
    if _TRITON_ERROR is not None:
        if os.environ.get("RINGCTX_SKIP_TRITON") == "1":
            pytest.skip("triton not installed (RINGCTX_SKIP_TRITON=1)")
        pytest.fail(f"triton is required for these tests (pip install triton): {_TRITON_ERROR!r}; "
                    "set RINGCTX_SKIP_TRITON=1 to skip them deliberately")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no GPU and TRITON_INTERPRET is not 1: the Triton tests cannot run")


def _qkv(T, S, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hq, d, generator=g)
    k = torch.randn(S, hkv, d, generator=g)
    v = torch.randn(S, hkv, d, generator=g)
    return (x.to(DEVICE, dtype) for x in (q, k, v))


def _visible(cu_q, cu_k, causal):
    """[T, S] mask of packed sequences: block-diagonal, lower-triangular inside when causal."""
    vis = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        blk = torch.ones(cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], dtype=torch.bool)
        vis[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = blk.tril() if causal else blk
    return vis


def _check(out, lse, q, k, v, visible, scale=None, tol=TOL, softcap=0.0):
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), visible, scale, softcap=softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows differ"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= tol if fin.any() else True
    assert (lse[~fin] == float("-inf")).all()
    assert (out - ref_out).abs().max().item() <= tol


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_head_dims_block_kinds(group, d, causal):
    # T != S for full blocks; lengths that are not multiples of the tiles.
    T, S = (45, 45) if causal else (37, 58)
    hkv = 2 if group == 1 else 1
    q, k, v = _qkv(T, S, group * hkv, hkv, d, seed=group * 1000 + d)
    out, lse = triton_attention_block(q, k, v, causal=causal)
    vis = torch.ones(T, S, dtype=torch.bool)
    _check(out, lse, q, k, v, vis.tril() if causal else vis)


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (64, 32), (64, 64)])
def test_tilings_cover_diagonal_split(tiles):
    # BLOCK_M > BLOCK_N puts several masked tiles on the diagonal; T spans partial last tiles.
    T = 70 if DEVICE == "cuda" else 53
    q, k, v = _qkv(T, T, 4, 2, 64, seed=7)
    out, lse = _forward(q, k, v, _plan(q, k, v, True, None, None, None), config=tiles)
    _check(out, lse, q, k, v, torch.ones(T, T, dtype=torch.bool).tril())


def test_softmax_scale_and_strided_views():
    # q, k, v as views of one fused qkv projection [T, Hq + 2 Hkv, D]: non-contiguous heads.
    T, hq, hkv, d = 33, 4, 2, 64
    qkv, _, _ = _qkv(T, 0, hq + 2 * hkv, 1, d, seed=3)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    assert not q.is_contiguous()
    out, lse = triton_attention_block(q, k, v, causal=True, softmax_scale=0.3)
    _check(out, lse, q, k, v, torch.ones(T, T, dtype=torch.bool).tril(), scale=0.3)


def test_packed_varseq_causal():
    cu = [0, 5, 5, 23, 40]  # includes an empty sequence
    q, k, v = _qkv(40, 40, 3, 1, 64, seed=11)
    out, lse = triton_attention_block(q, k, v, causal=True, cu_seqlens_q=cu,
                                      cu_seqlens_k=torch.tensor(cu, dtype=torch.int32))
    _check(out, lse, q, k, v, _visible(cu, cu, True))


def test_packed_varseq_full_with_empty_key_sequence():
    # Sequence 1 has 6 queries and no keys: those rows see nothing -> out 0, lse -inf.
    cu_q, cu_k = [0, 9, 15, 31], [0, 20, 20, 44]
    q, k, v = _qkv(31, 44, 4, 2, 80, seed=12)
    out, lse = triton_attention_block(q, k, v, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _check(out, lse, q, k, v, _visible(cu_q, cu_k, False))
    assert (lse[:, 9:15] == float("-inf")).all() and (out[9:15] == 0).all()


def test_empty_blocks():
    q, k, v = _qkv(6, 0, 4, 2, 64)
    out, lse = triton_attention_block(q, k, v, causal=False)
    assert (out == 0).all() and (lse == float("-inf")).all() and lse.shape == (4, 6)
    q, k, v = _qkv(0, 5, 4, 2, 64)
    out, lse = triton_attention_block(q, k, v, causal=False)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


def test_float16_by_the_2x_rule():
    # Error at most 2x that of PyTorch's own unsharded float16 computation (expanded KV heads).
    T, S, hq, hkv, d = 48, 48, 6, 2, 64
    q, k, v = _qkv(T, S, hq, hkv, d, dtype=torch.float16, seed=5)
    out, lse = triton_attention_block(q, k, v, causal=True)
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), torch.ones(T, S, dtype=torch.bool).tril())
    ke, ve = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    torch_out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), ke.transpose(0, 1), ve.transpose(0, 1), is_causal=True).transpose(0, 1)
    torch_err = (torch_out.cpu().double() - ref_out).abs().max().item()
    err = (out.cpu().double() - ref_out).abs().max().item()
    assert out.dtype == torch.float16 and err <= 2 * torch_err, (err, torch_err)
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= 1e-4  # lse stays float32 math


def test_public_dispatch_reaches_the_kernel():
    from ringctx.attention import attention_block

    q, k, v = _qkv(20, 20, 4, 2, 64, seed=9)
    out, lse = attention_block(q, k, v, causal=True, backend="triton")
    _check(out, lse, q, k, v, torch.ones(20, 20, dtype=torch.bool).tril())


@pytest.mark.parametrize("bad", [
    dict(window=3),                             # a window on a full block
    dict(q_offset=2),                           # an offset on a full block
    dict(causal=True, window=-1),               # negative window
    dict(causal=True, softcap=-1.0),            # negative cap
    dict(causal=True, softcap=float("nan")),    # NaN cap
    dict(causal=True, q_offset=2**31),          # beyond a launch argument's 32 bits
    dict(causal=True, window=2**30),            # beyond the masks' 32-bit arithmetic
    dict(hq=3, hkv=2),                          # Hq not a multiple of Hkv
    dict(kv_dtype=torch.float16),               # dtype mismatch
    dict(cu_q=[0, 3, 8], cu_k=[0, 4, 8], causal=True),  # causal packed not square per sequence
    dict(cu_q=[0, 3, 7], cu_k=[0, 4, 8]),       # does not end at T
    dict(cu_q=[0, 3, 8], cu_k=None),            # only one of the two
    dict(cu_q=[0, 5, 3, 8], cu_k=[0, 1, 2, 8]),  # decreasing
    dict(d=256),                                # head dim beyond the tuned tiles
])
def test_validation(bad):
    T, S = bad.get("shape", (8, 8))
    q, k, v = _qkv(T, S, bad.get("hq", 4), bad.get("hkv", 2), bad.get("d", 64))
    if "kv_dtype" in bad:
        k = k.to(bad["kv_dtype"])
    with pytest.raises((ValueError, TypeError)):
        triton_attention_block(q, k, v, causal=bad.get("causal", False),
                               cu_seqlens_q=bad.get("cu_q"), cu_seqlens_k=bad.get("cu_k"),
                               q_offset=bad.get("q_offset", 0), window=bad.get("window", 0),
                               softcap=bad.get("softcap", 0.0))


def test_available_on_this_machine():
    assert triton_available(DEVICE)


# --- compile for the GPU without one ---------------------------------------------------------
# Triton's interpreter patches triton.language in place once it has run, which breaks the real
# compiler in the same process; so the sm_90 builds run in one fresh subprocess for all cases.

AOT_CASES = [
    ("bf16", 128, True, False, 128, 64, 8, 3),   # the benchmark shape (S = 16K, causal, bf16)
    ("bf16", 64, False, True, 128, 64, 4, 3),    # SmolLM2 head dim, packed full blocks
    ("fp16", 80, True, False, 128, 128, 8, 3),   # padded head dim
    ("fp32", 64, True, True, 64, 32, 8, 2),      # IEEE fp32 dots, no tensor cores
    ("bf16", 128, True, False, 128, 64, 8, 3, True, True),  # sliding window and soft-cap (Gemma-like)
    ("bf16", 64, True, True, 128, 64, 4, 3, True, False),   # packed windowed blocks
]


def _compile_sm90(dtype: str, d: int, causal: bool, varlen: bool, bm: int, bn: int, warps: int, stages: int,
                  window: bool = False, softcap: bool = False):
    """Compile the kernel for sm_90 with Triton's real pipeline (TTIR -> PTX -> cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from ringctx.attention import triton_attn as ta

    ta._bind_device_functions(False)  # the kernels' jitted helpers (_tanh), as a GPU launch binds them
    fn = JITFunction(ta._attn_fwd_kernel)
    ints = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
            "stride_oh", "lse_stride_h", "seqlen_q", "seqlen_k", "q_offset", "window", "seq_bucket"]
    consts = dict(GROUP=4, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), CAUSAL=causal, VARLEN=varlen,
                  WINDOW=window, SOFTCAP=softcap, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                  BLOCK_M=bm, BLOCK_N=bn)
    sig = {n: f"*{dtype}" for n in ("Q", "K", "V", "Out")}
    sig.update(Lse="*fp32", CuQ="*i32", CuK="*i32", score_mul="fp32", score_cap="fp32", **{n: "i32" for n in ints})
    sig.update({n: "constexpr" for n in consts})
    assert set(sig) == set(fn.arg_names), "kernel signature changed: update this test"
    aligned = ["Q", "K", "V", "Out", "Lse", "CuQ", "CuK"] + ints[:8]  # what launches specialize on
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


DECODE_AOT_CASES = [
    ("decode", "bf16", 64, 32, False),   # SmolLM2: 8 tokens x a group of 3 -> 32-row tile
    ("decode", "bf16", 128, 64, False),  # Llama-3.1-8B: 16 tokens x a group of 4
    ("decode", "fp32", 128, 16, True),   # float32: IEEE dots
    ("decode", "bf16", 128, 32, False, True),  # soft-capped scores
]


def _compile_decode_sm90(_kind: str, dtype: str, d: int, block_r: int, f32: bool, softcap: bool = False):
    """The decode split and merge kernels for sm_90 (as _compile_sm90)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from ringctx.attention import triton_attn as ta

    ta._bind_device_functions(False)
    fn = JITFunction(ta._decode_split_kernel)
    ints = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "T", "seqlen_k", "slice_keys"]
    consts = dict(GROUP=4, SOFTCAP=softcap, HEAD_DIM=d, BLOCK_D=d, BLOCK_R=block_r, BLOCK_N=64, F32_MATH=f32)
    sig = {n: f"*{dtype}" for n in ("Q", "K", "V")}
    sig.update(PartOut="*fp32", PartLse="*fp32", score_mul="fp32", score_cap="fp32", **{n: "i32" for n in ints})
    sig.update({n: "constexpr" for n in consts})
    assert set(sig) == set(fn.arg_names), "decode kernel signature changed: update this test"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ["Q", "K", "V", "PartOut", "PartLse"]}
    split = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    fn = JITFunction(ta._decode_merge_kernel)
    consts = dict(HEAD_DIM=d, BLOCK_D=d)
    sig = dict(PartOut="*fp32", PartLse="*fp32", Out=f"*{dtype}", Lse="*fp32", stride_ot="i32", stride_oh="i32",
               T="i32", splits="i32", **{n: "constexpr" for n in consts})
    assert set(sig) == set(fn.arg_names), "decode merge kernel signature changed: update this test"
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
    return split


def _aot_main() -> None:
    """Subprocess entry: compile every AOT case, print one JSON line of facts per case."""
    import json

    for case in AOT_CASES + DECODE_AOT_CASES:
        try:
            k = _compile_decode_sm90(*case) if case[0] == "decode" else _compile_sm90(*case)
            facts = dict(ok=bool(k.asm.get("cubin")), wgmma="wgmma" in k.asm["ptx"], shared=k.metadata.shared,
                         mma="mma.sync" in k.asm["ptx"] or "wgmma" in k.asm["ptx"])
        except ImportError as e:
            facts = dict(ok=None, error=f"triton AOT API unavailable: {e}")
        except Exception as e:  # noqa: BLE001 - reported by the test
            facts = dict(ok=False, error=f"{type(e).__name__}: {e}"[-3000:])
        print("AOT " + json.dumps(dict(case=list(case), **facts)), flush=True)


@pytest.fixture(scope="module")
def aot_results():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", "import tests.gpu.test_triton_attn as t; t._aot_main()"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    lines = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("AOT ")]
    if r.returncode or len(lines) != len(AOT_CASES) + len(DECODE_AOT_CASES):
        pytest.fail(f"AOT compile subprocess failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return {tuple(x["case"]): x for x in lines}


@pytest.mark.parametrize("case", AOT_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{'causal' if c[2] else 'full'}"
                         f"{'-varlen' if c[3] else ''}-{c[4]}x{c[5]}w{c[6]}s{c[7]}"
                         f"{'-window' if c[8:9] == (True,) else ''}{'-softcap' if c[9:10] == (True,) else ''}")
def test_compiles_for_sm90(case, aot_results):
    facts = aot_results[case]
    if facts["ok"] is None:  # the test extra pins a Triton with this API: its absence is a failure
        pytest.fail(f"{facts['error']}; update _compile_sm90 for this Triton release")
    assert facts["ok"], facts.get("error")
    if case[0] != "fp32":
        assert facts["wgmma"], "16-bit dots should use Hopper tensor cores (wgmma)"
    assert facts["shared"] <= 227 * 1024, "over the H100/H200 shared-memory limit per block"


# --- decode blocks: B query tokens against a long K/V (split over the keys) ----------------------

from ringctx.attention.triton_attn import triton_decode_attention  # noqa: E402
from ringctx.kernels.selection import MAX_QUERY_ROWS_PER_KV_HEAD  # noqa: E402


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("B", [1, 2, 5, 9])
@pytest.mark.parametrize("S,d", [(1, 64), (37, 128), (301, 64)])
def test_decode_kernel_gqa_batches_lengths(group, B, S, d):
    """Every query row of a KV head in one tile, the keys split in slices merged by LSE: B tokens,
    odd and long lengths (301 keys: 5 slices of whole 16-key tiles in the interpreter)."""
    hkv = 2
    q, k, v = _qkv(B, S, group * hkv, hkv, d, seed=B * 100 + S + group)
    out, lse = triton_decode_attention(q, k, v, splits=5)
    _check(out, lse, q, k, v, torch.ones(B, S, dtype=torch.bool))


@pytest.mark.parametrize("splits", [1, 2, 7, None])
def test_decode_kernel_any_split_and_strided_views(splits):
    """Any number of slices (more than the key tiles: clamped), q a strided view of a fused qkv."""
    T, hq, hkv, d, S = 4, 9, 3, 64, 100
    qkv, _, _ = _qkv(T, 0, hq + 2 * hkv, 1, d, seed=21)
    q = qkv[:, :hq]
    _, k, v = _qkv(1, S, 1, hkv, d, seed=22)
    assert not q.is_contiguous()
    out, lse = triton_decode_attention(q, k, v, softmax_scale=0.3, splits=splits)
    _check(out, lse, q, k, v, torch.ones(T, S, dtype=torch.bool), scale=0.3)


def test_decode_kernel_bf16_rounds_once():
    """bf16 K/V (loaded as float32 in the interpreter, tensor-core dots on a GPU): the output within
    a bf16 rounding of the float64 result on the same values."""
    q, k, v = _qkv(6, 200, 12, 3, 64, dtype=torch.bfloat16, seed=23)
    out, lse = triton_decode_attention(q, k, v, splits=3)
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu())
    assert out.dtype == torch.bfloat16
    tol = 2 ** -8 * ref_out.abs().max().item() + (1e-5 if DEVICE == "cpu" else 2e-2)  # GPU: bf16 P in the PV dot
    assert (out.cpu().double() - ref_out).abs().max().item() <= tol
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= (1e-5 if DEVICE == "cpu" else 1e-2)


def test_decode_kernel_empty_and_refused():
    q, k, v = _qkv(3, 0, 4, 2, 64)
    out, lse = triton_decode_attention(q, k, v)
    assert (out == 0).all() and (lse == float("-inf")).all() and lse.shape == (4, 3)
    q, k, v = _qkv(MAX_QUERY_ROWS_PER_KV_HEAD // 2 + 1, 8, 4, 2, 64)  # 66 rows per KV head
    with pytest.raises(ValueError, match="query rows per KV head"):
        triton_decode_attention(q, k, v)


def test_decode_blocks_dispatch_to_the_decode_kernel(monkeypatch):
    """attention_block(q [B, Hq, D], k, v, causal=False, backend="triton") is the decode kernel;
    causal and wide blocks keep the block kernel."""
    from ringctx.attention import attention_block, triton_attn

    calls = []
    real = triton_attn.triton_decode_attention
    monkeypatch.setattr(triton_attn, "triton_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv(5, 90, 9, 3, 64, seed=24)
    out, lse = attention_block(q, k, v, causal=False, backend="triton")
    assert calls == [1]
    _check(out, lse, q, k, v, torch.ones(5, 90, dtype=torch.bool))
    q, k, v = _qkv(20, 20, 4, 2, 64, seed=25)
    attention_block(q, k, v, causal=True, backend="triton")
    assert calls == [1]


@pytest.mark.parametrize("case", DECODE_AOT_CASES, ids=lambda c: f"{c[1]}-d{c[2]}-rows{c[3]}"
                         f"{'-softcap' if c[5:6] == (True,) else ''}")
def test_decode_kernels_compile_for_sm90(case, aot_results):
    facts = aot_results[case]
    if facts["ok"] is None:
        pytest.fail(f"{facts['error']}; update _compile_decode_sm90 for this Triton release")
    assert facts["ok"], facts.get("error")
    if case[1] != "fp32":  # a tile of 16-32 rows is below wgmma's 64: mma.sync is the tensor-core path there
        assert facts["mma"], "16-bit dots should use the tensor cores (mma.sync or wgmma)"
    assert facts["shared"] <= 227 * 1024


# --- banded blocks (sliding windows) and soft-capped scores ---------------------------------------
# Query row i sees key row j iff j <= i + q_offset and (window == 0 or j > i + q_offset - window);
# the interpreter's tiles are 32 x 16 unless pinned, so windows of 1 and 3 sit inside one key tile,
# 20 spans two, 40 spans three, and 100 exceeds every block here.

BAND_CASES = [  # T, S, q_offset, window, softcap, hq, hkv, d
    (37, 37, 0, 1, 0.0, 4, 1, 32),      # window 1: each row sees its own key only; GQA 4
    (45, 45, 0, 3, 0.0, 2, 2, 32),      # below a tile; odd length; GQA 1
    (70, 70, 0, 20, 0.0, 4, 1, 32),     # above BLOCK_N, below BLOCK_M
    (70, 70, 0, 40, 30.0, 4, 1, 64),    # above a tile, soft-capped (cap well above the scores)
    (30, 25, 0, 100, 0.0, 2, 1, 32),    # window larger than S (no window); T > S, q_offset 0
    (21, 53, 32, 0, 0.0, 4, 1, 32),     # bottom-right aligned (q_offset = S - T), no window
    (21, 53, 32, 9, 1.0, 4, 1, 80),     # the same with a window, a tight cap and a padded head dim
    (33, 40, -7, 10, 5.0, 2, 2, 32),    # negative offset: the first 7 rows see nothing
    (10, 30, 35, 0, 0.0, 4, 1, 32),     # q_offset beyond S: every row sees every key
    (10, 30, 35, 8, 0.0, 4, 1, 32),     # ... with a window that leaves the first rows nothing
    (12, 20, -30, 4, 2.0, 4, 1, 32),    # no row sees any key
    (8, 20, 2**31 - 100, 0, 0.0, 2, 1, 32),   # offsets near int32's limits: every key ...
    (8, 20, 2**31 - 100, 5, 0.0, 2, 1, 32),   # ... no key (the window is far past the keys)
    (8, 20, -(2**31 - 100), 7, 0.0, 2, 1, 32),  # ... no key (before them)
]


@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"T{c[0]}-S{c[1]}-off{c[2]}-w{c[3]}-cap{c[4]:g}-g{c[5] // c[6]}")
def test_band_against_reference(case):
    T, S, off, w, cap, hq, hkv, d = case
    q, k, v = _qkv(T, S, hq, hkv, d, seed=T * 7 + S + off + w)
    q = q * 2  # larger scores, so that a cap of 1..5 bends them well into tanh's curve
    out, lse = triton_attention_block(q, k, v, causal=True, q_offset=off, window=w, softcap=cap)
    _check(out, lse, q, k, v, band_mask(T, S, off, w), softcap=cap)


@pytest.mark.parametrize("tiles", [(16, 16), (64, 32)])
def test_band_tilings(tiles):
    # Band edges against several tilings: a 64-row block spans the window's lower edge (stage 0),
    # whole tiles every row sees (stage 1) and the diagonal (stage 2) at once.
    T, S, off, w = 90, 100, 10, 37
    q, k, v = _qkv(T, S, 4, 2, 32, seed=13)
    plan = _plan(q, k, v, True, None, None, None, off, w, 0.0)
    out, lse = _forward(q, k, v, plan, config=tiles)
    _check(out, lse, q, k, v, band_mask(T, S, off, w))


def test_band_skips_the_key_tiles_no_row_sees():
    # V is NaN outside the band's key tiles: a visited tile would turn a row's output into NaN
    # (0 * NaN), so the kernel must visit only [tile of the first key seen, last key seen].
    T, S, off, w = 16, 200, 150, 10  # rows see keys 141 .. 165: tiles 128 .. 175 of 16
    q, k, v = _qkv(T, S, 2, 1, 32, seed=14)
    v_nan = v.clone()
    v_nan[:128] = float("nan")
    v_nan[176:] = float("nan")
    out, lse = _forward(q, k, v_nan, _plan(q, k, v_nan, True, None, None, None, off, w, 0.0), config=(16, 16))
    _check(out, lse, q, k, v, band_mask(T, S, off, w))  # the reference on finite V (it reads every row)


@pytest.mark.parametrize("off", [0, -4])
def test_band_packed_sequences_with_window_and_cap(off):
    # Each packed sequence is its own square band (rows and keys counted from its start).
    cu = [0, 19, 19, 50]
    q, k, v = _qkv(50, 50, 4, 2, 32, seed=15)
    out, lse = triton_attention_block(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=off,
                                      window=6, softcap=2.0)
    vis = torch.zeros(50, 50, dtype=torch.bool)
    for a, b in zip(cu, cu[1:]):
        vis[a:b, a:b] = band_mask(b - a, b - a, off, 6)
    _check(out, lse, q, k, v, vis, softcap=2.0)


def test_softcap_full_block():
    q, k, v = _qkv(19, 45, 4, 1, 32, seed=16)
    out, lse = triton_attention_block(q * 3, k, v, causal=False, softcap=4.0, softmax_scale=0.5)
    _check(out, lse, q * 3, k, v, None, scale=0.5, softcap=4.0)


def test_decode_kernel_softcap():
    q, k, v = _qkv(3, 77, 8, 2, 64, seed=17)
    out, lse = triton_decode_attention(q * 3, k, v, splits=3, softcap=3.0)
    _check(out, lse, q * 3, k, v, None, softcap=3.0)
