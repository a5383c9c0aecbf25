"""selection.padded_gemm_rows: the row counts a half-precision PyTorch GEMM on the CPU runs at, so
that oneDNN's per-row-count kernels repeat (a mixture of experts meets a new row count for nearly
every expert of every chunk); and transformer.linear's padded product equals the exact one."""

import torch

from ringctx.kernels import selection
from ringctx.model.transformer import linear


def test_padded_rows_are_at_most_an_eighth_more_and_eight_sizes_an_octave():
    sizes = [selection.padded_gemm_rows(r) for r in range(1, 1 << 16)]
    assert all(r <= p <= r + r // 8 for r, p in zip(range(1, 1 << 16), sizes))
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))  # monotone
    assert [selection.padded_gemm_rows(r) for r in range(1, 17)] == list(range(1, 17))
    for octave in range(4, 16):  # rows in [2^o, 2^(o+1)): 2^o + j 2^(o-3) for j = 0..8, the last 2^(o+1)
        assert len({selection.padded_gemm_rows(r) for r in range(1 << octave, 1 << (octave + 1))}) == 9
    assert selection.padded_gemm_rows(4097) == 4608 and selection.padded_gemm_rows(4096) == 4096


def test_linear_on_padded_rows_equals_the_product_of_the_rows_themselves():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    for rows in (17, 65, 100, 1025):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        y = linear(x, w, b)
        assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
        exact = (x.double() @ w.double().t() + b.double())
        assert ((y.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-2).all(), rows
