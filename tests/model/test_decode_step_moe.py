"""The fused decode step (csrc/cpu_decode.c's layer_experts) on mixtures of experts, against the
layer path (`MixtureOfExperts.forward` in `Block.forward`), for tiny configs: every layer sparse
(Mixtral's routing), dense and sparse layers mixed with Qwen3-MoE's routing (weights not
renormalised, rounded to the model dtype; per-head q/k norms), and experts wider than the model.

float32: logits within 2e-5 relative of the layer path at every step (the products' sums run in
another order); bf16: the same greedy tokens. A batch of rows: each row within 1e-5 of the
PyTorch batch path and equal bit for bit to its lone step. A step reads only the experts its rows
chose (the others may hold NaN). Experts the kernel does not compute take the layer path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringctx.model.config import Experts
from ringctx.model.decode_step import DecodeStep, FusedBatchStep, FusedStep
from ringctx.model.moe import route
from tests.helpers import rel_err
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.model.test_decode_step import TINY, copy_of, prefilled, random_model, step_both, threads  # noqa: F401
from tests.model.test_decode_step_batch import fused_batch, own_only, pytorch_batch

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

MIXTRAL = Experts(6, 2, 24)
QWEN3 = Experts(5, 3, 32, renormalize=False, weights_in_model_dtype=True)
WIDE = Experts(4, 2, 96)  # F wider than dim (64), the heads (64) and the dense ffn_dim (48 below)

CONFIGS = {
    "mixtral-every-layer": dataclasses.replace(TINY, n_layers=3, layer_experts=(MIXTRAL,) * 3),
    "qwen3-mixed": dataclasses.replace(TINY, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True,
                                       layer_experts=(None, QWEN3, None, QWEN3)),
    # experts wider than every other input (the kernel's split buffers), top 2 of 4
    "wide": dataclasses.replace(TINY, ffn_dim=48, layer_experts=(WIDE, WIDE)),
}


def moe_model(name, dtype, seed=0):
    model = random_model(CONFIGS[name], dtype, seed)
    assert FusedBatchStep.build(model) is not None  # the kernel takes these experts
    return model


@needs_kernels
@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_steps_equal_the_layer_path(name, threads):  # noqa: F811
    model = moe_model(name, torch.float32)
    reference = prefilled(model, 300)
    fused_cache = copy_of(reference)
    step_both(model, reference, fused_cache, 2e-5)


@needs_kernels
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_greedy_tokens_equal_the_layer_path(name, threads):  # noqa: F811
    model = moe_model(name, torch.bfloat16, seed=1)
    reference = prefilled(model, 120)
    plain, fused = DecodeStep(model, reference, fused=False), DecodeStep(model, copy_of(reference))
    assert fused.is_fused
    want, got, token = [], [], 3
    with torch.inference_mode():
        for _ in range(8):
            a = plain(token)
            want.append(int(a.argmax()))
            token = want[-1]
        token = 3
        for _ in range(8):
            got.append(int(fused(token).argmax()))
            token = got[-1]
    assert got == want


@needs_kernels
@pytest.mark.parametrize("batch", [1, 3, 9])
@pytest.mark.parametrize("name", ["mixtral-every-layer", "qwen3-mixed"])
def test_batch_rows_equal_the_pytorch_batch_and_lone_steps(name, batch, threads):  # noqa: F811
    """Several rows read the union of their experts once; each row's sums are its lone step's."""
    model = moe_model(name, torch.float32)
    step = FusedBatchStep.build(model)
    fused = own_only(model, batch)
    plain = fused.copy()
    lone = [FusedStep.build(model, copy_of(c)) for c in fused.own]
    tokens = [(7 * i + 3) % model.config.vocab_size for i in range(batch)]
    for _ in range(2):
        got = fused_batch(step, fused, tokens)
        want = pytorch_batch(model, plain, tokens)
        for i in range(batch):
            assert rel_err(got[i], want[i]) < 1e-5, (i, rel_err(got[i], want[i]))
            assert torch.equal(got[i], lone[i](tokens[i])[0]), i
        tokens = [int(t) for t in want.argmax(dim=-1)]


def chosen_experts(model, step):
    """{layer: the experts some row chose} during step() on the layer path (each MixtureOfExperts'
    forward wrapped to record its routing: Block calls forward itself, so hooks would not run)."""
    chosen = {}
    moes = {i: block.feed_forward for i, block in enumerate(model.layers) if hasattr(block.feed_forward, "router")}
    for i, moe in moes.items():
        def recording(x, i=i, moe=moe, forward=moe.forward):
            _, experts = route(moe.linear(x, moe.router.weight), moe.experts)
            chosen.setdefault(i, set()).update(experts.reshape(-1).tolist())
            return forward(x)
        moe.forward = recording
    try:
        step()
    finally:
        for moe in moes.values():
            del moe.forward
    assert set(chosen) == set(moes)
    return chosen


@needs_kernels
@pytest.mark.parametrize("batch", [1, 4])
def test_a_step_reads_only_the_experts_its_rows_chose(batch):
    """Experts no row chose hold NaN: the fused step's logits do not change (never read)."""
    model = moe_model("mixtral-every-layer", torch.float32)
    setup = own_only(model, batch)
    tokens = [(5 * i + 2) % model.config.vocab_size for i in range(batch)]
    chosen = chosen_experts(model, lambda: pytorch_batch(model, setup.copy(), tokens))
    assert any(len(c) < MIXTRAL.n_experts for c in chosen.values())  # some expert unread, or nothing is tested
    step = FusedBatchStep.build(model)
    want = fused_batch(step, setup.copy(), tokens)
    with torch.no_grad():
        for i, experts in chosen.items():
            unread = [e for e in range(MIXTRAL.n_experts) if e not in experts]
            model.layers[i].feed_forward.w13[unread] = float("nan")
            model.layers[i].feed_forward.w2[unread] = float("nan")
    got = fused_batch(step, setup.copy(), tokens)
    assert torch.equal(got, want)


def test_experts_the_kernel_does_not_compute_take_the_layer_path():
    """Two layers of different experts (the kernel's shape holds one), and more experts per row
    than its routing arrays: no fused step, the layer path decodes."""
    for experts in ((MIXTRAL, QWEN3), (Experts(40, 17, 8),) * 2):
        model = random_model(dataclasses.replace(TINY, layer_experts=experts), torch.float32)
        assert FusedBatchStep.build(model) is None
        assert not DecodeStep(model, prefilled(model, 4)).is_fused
