"""The band blocks of ringctx.attention.gpu_blocks against the float64 reference.

`torch_band_block` is written device-agnostic, so its math is checked here on CPU tensors
(and on CUDA where there is one). flash-attn is not needed: its window and alignment arithmetic is
the pure `flash_attn_window_size`, checked against the mask it stands for; the flash-attn call
itself runs only where flash-attn and a GPU are (and in scripts/gpu_check.py).
"""

from __future__ import annotations

import pytest
import torch

from ringctx.attention.gpu_blocks import flash_attn_band_block, flash_attn_window_size, torch_band_block
from ringctx.attention.reference import band_mask, reference_attention

TOL = 1e-5  # float32 against float64 (docs/ARCHITECTURE.md)


def _qkv(T, S, hq, hkv, d, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(device, dtype) for n, h in ((T, hq), (S, hkv), (S, hkv))]


def _check(out, lse, q, k, v, visible, scale, softcap=0.0, tol=TOL):
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), visible, scale, softcap=softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    out, lse = out.cpu().double(), lse.cpu().double()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows differ"
    assert (lse[torch.isinf(lse)] == float("-inf")).all()
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= tol
    assert (out - ref_out).abs().max().item() <= tol


BAND_CASES = [  # T, S, q_offset, window, softcap, hq, hkv
    (9, 9, 0, 0, 0.0, 4, 4),      # the square causal block
    (9, 9, 0, 1, 0.0, 4, 1),      # window 1: own key only
    (17, 23, 6, 3, 0.0, 2, 2),    # bottom-right aligned, small window
    (17, 23, 0, 5, 2.0, 8, 2),    # top-left aligned (a ring block), capped
    (20, 12, -4, 0, 0.0, 4, 1),   # negative offset, T > S: first rows see nothing
    (11, 30, 45, 0, 1.0, 4, 1),   # q_offset > S: every key
    (11, 30, 45, 12, 0.0, 4, 1),  # ... with a window: early rows see nothing
    (13, 13, 0, 50, 0.0, 2, 1),   # window above S
    (7, 10, -20, 3, 0.0, 2, 1),   # nothing at all
]


@pytest.mark.parametrize("max_score_bytes", [256 << 20, 600])  # one tile; tiles of a few rows
@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"T{c[0]}-S{c[1]}-off{c[2]}-w{c[3]}-cap{c[4]:g}-g{c[5] // c[6]}")
def test_torch_band_block(case, max_score_bytes):
    T, S, off, w, cap, hq, hkv = case
    q, k, v = _qkv(T, S, hq, hkv, 16, seed=T + S + w)
    q = q * 2
    out, lse = torch_band_block(q, k, v, scale=0.3, q_offset=off, window=w, softcap=cap,
                                     max_score_bytes=max_score_bytes)
    _check(out, lse, q, k, v, band_mask(T, S, off, w), 0.3, cap)


def test_torch_band_block_bf16_by_the_2x_rule():
    # bf16 inputs: the output rounds once to bf16 (scores and softmax float32 from exact products).
    T, S, off, w = 24, 40, 16, 7
    q, k, v = _qkv(T, S, 6, 2, 32, dtype=torch.bfloat16, seed=3)
    out, lse = torch_band_block(q, k, v, scale=0.2, q_offset=off, window=w, softcap=3.0)
    ref_out, ref_lse = reference_attention(q, k, v, band_mask(T, S, off, w), 0.2, softcap=3.0)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref_out).abs().max().item() <= 2 ** -8 * ref_out.abs().max().item() + 1e-6
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5


def test_torch_band_block_empty_shapes():
    q, k, v = _qkv(5, 0, 4, 2, 16)
    out, lse = torch_band_block(q, k, v, scale=0.25, q_offset=0, window=3)
    assert (out == 0).all() and (lse == float("-inf")).all() and lse.shape == (4, 5)
    q, k, v = _qkv(0, 5, 4, 2, 16)
    out, lse = torch_band_block(q, k, v, scale=0.25, q_offset=0, window=3)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


@pytest.mark.parametrize("bad", [dict(window=-1), dict(softcap=-1.0), dict(softcap=float("inf")), dict(hq=3)])
def test_validation(bad):
    q, k, v = _qkv(4, 4, bad.get("hq", 4), 2, 16)
    for fn in (torch_band_block, flash_attn_band_block):
        with pytest.raises(ValueError):
            fn(q, k, v, scale=0.25, q_offset=0, window=bad.get("window", 0), softcap=bad.get("softcap", 0.0))


def _flash_mask(T, S, window_size):
    """The mask flash-attn documents for causal=True, window_size=(left, right): query i sees key j
    iff i + S - T - left <= j <= i + S - T + right (left = -1: unbounded), right forced to 0."""
    left, right = window_size
    rel = torch.arange(T).unsqueeze(1) + S - T - torch.arange(S).unsqueeze(0)  # (i + S - T) - j
    vis = rel >= -right
    if left >= 0:
        vis &= rel <= left
    return vis


@pytest.mark.parametrize("T,S", [(1, 1), (5, 5), (4, 11), (11, 4), (7, 1)])
@pytest.mark.parametrize("window", [0, 1, 2, 3, 6, 20])
def test_flash_attn_window_size_matches_the_band(T, S, window):
    ws = flash_attn_window_size(T, S, S - T, window)
    assert ws is not None and ws[1] == 0
    assert torch.equal(_flash_mask(T, S, ws), band_mask(T, S, S - T, window))
    for off in (S - T - 1, S - T + 1, 0 if S != T else 3):  # any other alignment: not flash-attn's
        assert flash_attn_window_size(T, S, off, window) is None


def test_flash_attn_band_block_declines_what_it_cannot_do():
    # Checked before flash-attn is imported, so this runs without it.
    q, k, v = _qkv(4, 9, 4, 2, 16)
    assert flash_attn_band_block(q, k, v, scale=0.25, q_offset=0, window=3) is None  # misaligned
    assert flash_attn_band_block(q, k, v, scale=0.25, q_offset=5, window=3) is None  # CPU float32
    out, lse = flash_attn_band_block(q[:0], k, v, scale=0.25, q_offset=9, window=3)  # no rows
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a build for another torch
        return False
    return True


@pytest.mark.skipif(not (torch.cuda.is_available() and _flash_attn_installed()), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("T,S,window,cap", [(64, 64, 16, 0.0), (40, 100, 7, 5.0), (100, 40, 0, 0.0)])
def test_flash_attn_band_block_on_gpu(T, S, window, cap):
    # bf16 by the rule of twice PyTorch's own bf16 error (the band fallback in bf16 here).
    q, k, v = _qkv(T, S, 8, 2, 64, dtype=torch.bfloat16, seed=4, device="cuda")
    out, lse = flash_attn_band_block(q, k, v, scale=0.125, q_offset=S - T, window=window, softcap=cap)
    vis = band_mask(T, S, S - T, window)
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), vis, 0.125, softcap=cap)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-2
    assert (out.cpu().double() - ref_out).abs().max().item() <= 2 ** -7 * ref_out.abs().max().item() + 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_band_block_on_gpu():
    T, S, off, w = 70, 90, 20, 33
    q, k, v = _qkv(T, S, 8, 2, 64, seed=5, device="cuda")
    out, lse = torch_band_block(q, k, v, scale=0.125, q_offset=off, window=w, softcap=10.0)
    _check(out, lse, q, k, v, band_mask(T, S, off, w), 0.125, 10.0, tol=1e-4)  # TF32 if enabled
