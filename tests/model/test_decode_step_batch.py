"""The fused batch decode step (ringctx_decode_step_batch via FusedBatchStep) against the PyTorch
batch path it replaces (`Block.forward` layer by layer with the same `attend`) and against each
sequence's lone fused step, for B = 1..9 sequences at different positions, on every CPU kernel
variant this machine runs.

float32: every row's logits within 1e-5 relative of both. bf16: rounded at the same places as the
PyTorch path, so its error against a float32 computation from the same state is at most twice the
PyTorch bf16 path's (the rule of tests/model/test_decode_step.py).
"""

from __future__ import annotations

import pytest
import torch

from ringctx.model.decode_step import FusedBatchStep, FusedStep
from tests.core.test_cpu_kernels import needs_kernels
from tests.helpers import rel_err
from tests.model.test_decode_step import (  # noqa: F401
    SHAPES,
    copy_of,
    prefilled,
    random_model,
    threads,
)

pytestmark = pytest.mark.usefixtures("kernel_variant")  # once per CPU kernel variant here

STEPS = 2  # the second step attends to the rows the first one wrote


def sequences(model, count):
    """`count` caches of different lengths (so different positions), each with room to grow."""
    return [prefilled(model, 17 + 23 * i, room=STEPS + 1, seed=i + 1) for i in range(count)]


def attend_over(caches):
    """The batch decoder's attend for sequences with one cache each: row i's k, v into cache i at its
    length, then q[i] over its rows (written one included). Advances nothing."""

    def attend(layer, q, k, v):
        out = torch.empty(q.shape, dtype=q.dtype)
        for i, cache in enumerate(caches):
            cache.update(layer, cache.length, k[i:i + 1], v[i:i + 1])
            out[i] = cache.attend_rows(layer, q[i:i + 1], cache.length + 1)[0][0].to(q.dtype)
        return out

    return attend


def pytorch_batch(model, caches, tokens):
    """One step of the PyTorch batch path: float32 logits [B, vocab]."""
    with torch.inference_mode():
        x = model.embed(torch.tensor(tokens))
        rope = model.rope(torch.tensor([c.length for c in caches]))
        attend = attend_over(caches)
        for index, block in enumerate(model.layers):
            x = block.forward(x, rope, attend, index)
        logits = model.head(model.norm(x))
    for c in caches:
        c.length += 1
    return logits


def fused_batch(step, caches, tokens):
    """One step of the fused batch path: float32 logits [B, vocab]."""
    with torch.inference_mode():
        x = step(tokens, [c.length for c in caches], attend_over(caches))
        logits = step.model.head(step.model.norm(x))
    for c in caches:
        c.length += 1
    return logits


@needs_kernels
@pytest.mark.parametrize("batch", range(1, 10))
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "gqa3-d48-odd-ffn", "qwen3-qknorm-yarn"])
def test_float32_batch_equals_pytorch_batch_and_lone_steps(shape, batch, threads):  # noqa: F811
    model = random_model(SHAPES[shape], torch.float32)
    step = FusedBatchStep.build(model)
    assert step is not None
    fused_caches = sequences(model, batch)
    plain_caches = [copy_of(c) for c in fused_caches]
    lone = [FusedStep.build(model, copy_of(c)) for c in fused_caches]
    tokens = [(7 * i + 3) % model.config.vocab_size for i in range(batch)]
    for _ in range(STEPS):
        got = fused_batch(step, fused_caches, tokens)
        want = pytorch_batch(model, plain_caches, tokens)
        assert got.shape == want.shape == (batch, model.config.vocab_size)
        for i in range(batch):
            alone = lone[i](tokens[i])[0]
            assert rel_err(got[i], want[i]) < 1e-5, (i, rel_err(got[i], want[i]))
            assert rel_err(got[i], alone) < 1e-5, (i, rel_err(got[i], alone))
        tokens = [int(t) for t in want.argmax(dim=-1)]
    for a, b in zip(fused_caches, plain_caches):  # the K/V rows the kernel's q/k/v gave attend
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x[:a.length], y[:b.length], atol=2e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("shape", ["gqa2-d16", "gqa3-d64-bias-tied", "qwen3-qknorm-yarn"])
def test_bf16_batch_is_as_accurate_as_the_pytorch_batch(shape, threads):  # noqa: F811
    model = random_model(SHAPES[shape], torch.bfloat16)
    exact_model = random_model(SHAPES[shape], torch.bfloat16).float()  # the same bf16 weights, in float32
    step = FusedBatchStep.build(model)
    assert step is not None
    state = sequences(model, 5)
    tokens = [3, 9, 27, 81, 243]
    fused = fused_batch(step, [copy_of(c) for c in state], tokens)
    plain = pytorch_batch(model, [copy_of(c) for c in state], tokens)
    exact = pytorch_batch(exact_model, [copy_of(c, torch.float32) for c in state], tokens)
    for i in range(len(tokens)):
        plain_err, fused_err = rel_err(plain[i], exact[i]), rel_err(fused[i], exact[i])
        assert plain_err > 0  # bf16 rounding happened: the rule below is not vacuous
        assert fused_err <= 2 * plain_err, (i, fused_err, plain_err)


@needs_kernels
def test_an_error_in_attend_is_raised_and_bad_batches_are_refused():
    model = random_model(SHAPES["gqa2-d16"], torch.float32)
    step = FusedBatchStep.build(model)

    def broken(layer, q, k, v):
        raise ConnectionError(f"rank lost at layer {layer}")

    with pytest.raises(ConnectionError, match="layer 0"):
        step([1, 2], [5, 6], broken)
    with pytest.raises(ValueError, match="1 tokens, 2 positions"):
        step([1], [5, 6], broken)
    with pytest.raises(ValueError, match="1..64"):
        step([1] * 65, [5] * 65, broken)
    with pytest.raises(ValueError, match="vocabulary"):
        step([model.config.vocab_size], [5], broken)


def test_falls_back_where_the_kernel_does_not_apply():
    model = random_model(SHAPES["gqa2-d16"], torch.float16)
    assert FusedBatchStep.build(model) is None
