"""Merging partial attention results (paper Eq. 4).

Attention over a key set split into parts S_1..S_n can be computed part by part and combined
exactly: with each part's output O_s and log-sum-exp LSE_s (natural log),

    LSE = log sum_s exp(LSE_s)
    O   = sum_s exp(LSE_s - LSE) * O_s

All math is float32 and max-shifted (`torch.logaddexp`), so nothing overflows. A row that saw no
key in any part has LSE = -inf and O = 0 (never NaN). Some kernels report +inf (or NaN) LSE for
empty rows; `sanitize_lse` maps those to -inf at the boundary.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..kernels import cpu


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """Float32 LSE with +inf and NaN (empty-row markers of some kernels) replaced by -inf."""
    lse = lse.float()
    return torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)


class PartialAccumulator:
    """Streaming merge of partial (out, lse) pairs into float32 running state.

    Holds out [T, H, D] and lse [H, T] in float32; `add` merges a partial for all rows or for a
    contiguous row range, in place. Use it when partials arrive one by one (ring pass-KV) so
    that only one partial is alive at a time.

    Example:
        >>> acc = PartialAccumulator(4, 2, 8)
        >>> acc.add(torch.randn(4, 2, 8), torch.randn(2, 4))
        >>> out, lse = acc.result(torch.bfloat16)
    """

    def __init__(self, rows: int, heads: int, head_dim: int, device: torch.device | str = "cpu"):
        self.rows, self.heads, self.head_dim, self.device = rows, heads, head_dim, device
        self._out: torch.Tensor | None = None  # allocated on first use, or adopted (see `add`)
        self._lse: torch.Tensor | None = None

    @property
    def out(self) -> torch.Tensor:
        """The running float32 output [T, H, D] (zeros where nothing was added yet)."""
        if self._out is None:
            self._out = torch.zeros(self.rows, self.heads, self.head_dim, dtype=torch.float32, device=self.device)
        return self._out

    @property
    def lse(self) -> torch.Tensor:
        """The running float32 LSE [H, T] (-inf where nothing was added yet)."""
        if self._lse is None:
            self._lse = torch.full((self.heads, self.rows), float("-inf"), dtype=torch.float32, device=self.device)
        return self._lse

    @classmethod
    def over(cls, out: torch.Tensor, lse: torch.Tensor) -> "PartialAccumulator":
        """Accumulate into existing float32 buffers: out [T, H, D] of zeros, lse [H, T] of -inf."""
        if out.dtype != torch.float32 or lse.dtype != torch.float32:
            raise ValueError("PartialAccumulator.over needs float32 buffers")
        acc = cls(out.shape[0], out.shape[1], out.shape[2], device=out.device)
        acc._out, acc._lse = out, lse
        return acc

    def add(self, out: torch.Tensor, lse: torch.Tensor, row_start: int = 0, *, owned: bool = False) -> None:
        """Merge a partial covering rows [row_start, row_start + out.shape[0]).

        owned=True says the caller made `out` for this call and will not use it again (a fresh
        kernel output): a float32 first partial covering every row then becomes the running
        state itself, with no zeros allocated and no copy (one rank, one block: nothing to merge).
        """
        n = out.shape[0]
        if n == 0:
            return
        adopt = owned and self._out is None and row_start == 0 and n == self.rows and out.dtype == torch.float32
        if not adopt and out.device.type == "cpu" and cpu.merge_rows(
                self.out[row_start:row_start + n], self.lse[:, row_start:row_start + n], out, lse):
            return  # the same merge in one C pass (its ops cost more than the arithmetic at few rows)
        lse = sanitize_lse(lse)
        finite = torch.isfinite(lse)
        all_finite = bool(finite.all())
        if adopt and all_finite:
            self._out, self._lse = out, lse
            return
        acc_out = self.out[row_start:row_start + n]
        acc_lse = self.lse[:, row_start:row_start + n]
        if all_finite and bool(torch.isneginf(acc_lse).all()):
            # First partial for these rows (the common case): a copy, no rescaling.
            acc_out.copy_(out)
            acc_lse.copy_(lse)
            return
        new_lse = torch.logaddexp(acc_lse, lse)
        # Rows still without any key have new_lse = -inf; give both sides weight 0 there.
        alive = torch.isfinite(new_lse)
        shift = torch.where(alive, new_lse, torch.zeros_like(new_lse))
        w_old = torch.where(alive, torch.exp(acc_lse - shift), torch.zeros_like(shift))
        w_new = torch.where(alive, torch.exp(lse - shift), torch.zeros_like(shift))
        if not all_finite:
            # A kernel may return garbage (even NaN) in rows it marks empty: never let it through.
            out = torch.where(finite.t().unsqueeze(-1), out.float(), 0.0)
        acc_out.mul_(w_old.t().unsqueeze(-1)).addcmul_(out, w_new.t().unsqueeze(-1))
        acc_lse.copy_(new_lse)

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, H, D] in `dtype`, lse [H, T] float32)."""
        return self.out.to(dtype), self.lse


def merge_partials(
    partials: Sequence[tuple[torch.Tensor, torch.Tensor]],
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials over disjoint key sets of the same query rows.

    Args:
        partials: n >= 1 pairs (out [T, H, D], lse [H, T]); LSE natural log, any float dtype.
        out_dtype: dtype of the merged out; defaults to the first partial's out dtype.

    Returns:
        (out [T, H, D] in out_dtype, lse [H, T] float32).

    Example (two halves of the keys give the same answer as all keys at once):
        >>> from ringctx.attention import attention_block
        >>> q = torch.randn(5, 4, 16); k = v = torch.randn(9, 2, 16)
        >>> whole = attention_block(q, k, v)
        >>> parts = [attention_block(q, k[:4], v[:4]), attention_block(q, k[4:], v[4:])]
        >>> merged = merge_partials(parts)
        >>> torch.allclose(merged[0], whole[0], atol=1e-5)
        True
    """
    if not partials:
        raise ValueError("merge_partials needs at least one (out, lse) pair")
    from .cuda_ext import try_merge_partials_cuda

    merged = try_merge_partials_cuda(partials, out_dtype)  # one-pass CUDA kernel; None off-GPU
    if merged is not None:
        return merged
    first_out, first_lse = partials[0]
    T, H, D = first_out.shape
    for i, (out, lse) in enumerate(partials):
        if out.shape != (T, H, D) or lse.shape != (H, T):
            raise ValueError(
                f"merge_partials: partial {i} has out {tuple(out.shape)} and lse {tuple(lse.shape)}, "
                f"expected out {(T, H, D)} and lse {(H, T)}"
            )
    acc = PartialAccumulator(T, H, D, device=first_out.device)
    for out, lse in partials:
        acc.add(out, lse)
    return acc.result(out_dtype or first_out.dtype)
