"""A mixture of experts' grouped GEMMs (moe.py's `_grouped`, torch._grouped_mm) against its loop of
a GEMM pair per expert, and kernels/selection.py's rule between them (`grouped_experts`), both
ways: bf16 CPU calls with enough pairs per expert go grouped; decode-sized calls, float32 and
other devices keep the loop.

The grouped path sums each row's experts in the loop's order: float32 within 1e-6 relative of
the loop (a product's sums may run in another order), bf16 within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

from ringctx.kernels import selection
from ringctx.model.config import Experts, ModelConfig
from ringctx.model.moe import MixtureOfExperts
from ringctx.model.transformer import linear
from tests.helpers import rel_err

CONFIG = ModelConfig(name="moe-grouped", vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96,
                     layer_experts=(Experts(8, 2, 48),))


def mixture(experts: Experts, dtype, seed=0):
    moe = MixtureOfExperts(CONFIG, experts, linear)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe.to(dtype)


def both_paths(moe, x, monkeypatch):
    """(loop, grouped) outputs of moe on x, each path forced through the rule."""
    out = []
    for grouped in (False, True):
        monkeypatch.setattr(selection, "grouped_experts", lambda *args, grouped=grouped: grouped)
        with torch.inference_mode():
            out.append(moe.forward(x))
    return out


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("experts", [Experts(8, 2, 48), Experts(8, 3, 32, renormalize=False,
                                                                    weights_in_model_dtype=True)],
                         ids=["mixtral", "qwen3"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_grouped_equals_the_loop(experts, rows, monkeypatch):
    x32 = torch.randn(rows, CONFIG.dim, generator=torch.Generator().manual_seed(rows)) * 2
    loop, grouped = both_paths(mixture(experts, torch.float32), x32, monkeypatch)
    assert rel_err(grouped, loop) < 1e-6
    loop, grouped = both_paths(mixture(experts, torch.bfloat16), x32.bfloat16(), monkeypatch)
    assert grouped.dtype == loop.dtype == torch.bfloat16
    assert rel_err(grouped.float(), loop.float()) < 2e-2  # a product rounded one bf16 step away, at most a few


def test_the_rule_both_ways():
    E = 32
    prefill = selection.GROUPED_EXPERTS_MIN_ROWS * E  # pairs: 8K tokens x top 4 is 32K
    assert selection.grouped_experts("cpu", torch.bfloat16, prefill, E) == hasattr(torch, "_grouped_mm")
    assert not selection.grouped_experts("cpu", torch.bfloat16, prefill - 1, E)  # too few rows per expert
    assert not selection.grouped_experts("cpu", torch.bfloat16, 4, E)            # a decode step's row
    assert not selection.grouped_experts("cpu", torch.float32, 32768, E)         # float32: the loop
    assert not selection.grouped_experts("cuda", torch.bfloat16, 32768, E)       # GPUs: not measured yet


def test_a_bf16_prefill_takes_the_grouped_path(monkeypatch):
    """Where the rule says so, forward runs `_grouped` (and the loop where it does not)."""
    moe = mixture(Experts(8, 2, 48), torch.bfloat16)
    calls = []
    grouped = moe._grouped
    monkeypatch.setattr(moe, "_grouped", lambda *args: calls.append(1) or grouped(*args))
    x = torch.randn(selection.GROUPED_EXPERTS_MIN_ROWS * 8, CONFIG.dim).bfloat16()  # 2x the pairs it needs
    with torch.inference_mode():
        moe.forward(x)
        moe.forward(x[:3])
    assert len(calls) == int(hasattr(torch, "_grouped_mm"))
