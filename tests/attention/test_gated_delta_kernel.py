"""The CPU kernel of the gated delta rule (csrc/cpu_gated_delta.c, kernels/cpu.py's gated_delta_) and
its two entries in attention/gated_delta.py (`recurrent` for float32 CPU inputs, `recurrent_step`
for B sequences), against the float64 token-by-token `recurrent`, once per kernel variant this CPU
runs (tests/conftest.py's kernel_variant: avx512, avx2 and the portable build where the CPU has
them), and the PyTorch fallback alike.

Tolerance: every output and state within 1e-5 of the float64 reference's largest magnitude (a few
float32 roundings; measured ~2e-7 at T 130, Dk = Dv = 128)."""

import pytest
import torch

from ringctx.attention.gated_delta import ChunkForm, PieceSummary, chunked, recurrent, recurrent_step
from ringctx.kernels import build, cpu
from tests.helpers import rel_err
from tests.kernels.test_cpu_kernels import BUILDABLE, needs_kernels

pytestmark = pytest.mark.usefixtures("kernel_variant")

TOLERANCE = 1e-5


def random_inputs(B: int, T: int, H: int, Dk: int, Dv: int, seed: int = 0):
    """float64 q, k [B, T, H, Dk] L2-normalised (q scaled by Dk^-0.5, as the layer hands them over), v
    [B, T, H, Dv], g in [-5, 0], beta in [0, 1], a random start state [B, H, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, Dk, generator=gen, dtype=torch.float64), dim=-1)
            for _ in "qk")
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    g = -5 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    state = torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64)
    return q * Dk ** -0.5, k, v, g, beta, state


def reference(q, k, v, g, beta, state):
    """Per sequence b, the float64 recurrence: o [B, T, H, Dv] and the end states [B, H, Dk, Dv]."""
    runs = [recurrent(q[b], k[b], v[b], g[b], beta[b], state[b]) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in runs]), torch.stack([s for _, s in runs])


SIZES = [  # B, T, H, Dk, Dv: odd and vector-sized heads, one token to past two blocks of 64
    (1, 1, 1, 5, 5), (3, 1, 2, 24, 128), (2, 7, 3, 128, 24), (1, 7, 1, 5, 128), (2, 7, 2, 128, 5),
    (1, 130, 3, 128, 128), (3, 130, 1, 24, 24), (1, 130, 2, 5, 24), (2, 1, 3, 128, 128), (1, 7, 2, 33, 70), (2, 1, 1, 7, 300),
]


@needs_kernels
@pytest.mark.parametrize("B,T,H,Dk,Dv", SIZES)
def test_the_kernel_matches_the_float64_recurrence(B, T, H, Dk, Dv):
    q, k, v, g, beta, start = random_inputs(B, T, H, Dk, Dv, seed=B * 1000 + T + Dk + Dv)
    ref_out, ref_state = reference(q, k, v, g, beta, start)
    state = start.float().contiguous()
    out = cpu.gated_delta_(*(x.float() for x in (q, k, v, g, beta)), state)
    assert out is not None, build.kernel_error()
    assert out.shape == (B, T, H, Dv) and out.dtype == torch.float32
    for t in range(T):  # every token's output, not only the largest error over all of them
        assert rel_err(out[:, t], ref_out[:, t]) < TOLERANCE, t
    assert rel_err(state, ref_state) < TOLERANCE


@pytest.mark.parametrize("B,H,Dk,Dv", [(1, 1, 5, 5), (3, 2, 24, 128), (2, 3, 128, 128)])
def test_recurrent_step_matches_the_float64_recurrence_at_every_step(B, H, Dk, Dv):
    """Seven decode steps of B sequences, states in place: each step's outputs and states against the
    float64 recurrence up to that token (the kernel where built, else PyTorch)."""
    T = 7
    q, k, v, g, beta, start = random_inputs(B, T, H, Dk, Dv, seed=B + Dk)
    ref_out, _ = reference(q, k, v, g, beta, start)
    states = start.float().contiguous()
    for t in range(T):
        out = recurrent_step(*(x[:, t].float() for x in (q, k, v, g, beta)), states)
        assert out.shape == (B, H, Dv) and out.dtype == torch.float32
        assert rel_err(out, ref_out[:, t]) < TOLERANCE, t
        _, ref_state = reference(*(x[:, :t + 1] for x in (q, k, v, g, beta)), start)
        assert rel_err(states, ref_state) < TOLERANCE, t


def test_the_pytorch_step_matches_the_kernel_step(monkeypatch):
    """recurrent_step without the kernels (RINGCTX_CPU_KERNELS=0: PyTorch over [B, H, ...]) and with
    them: the same step within float32 roundings; in float64 it is the reference's own arithmetic."""
    q, k, v, g, beta, start = random_inputs(3, 1, 2, 24, 40, seed=5)
    step = [x[:, 0] for x in (q, k, v, g, beta)]
    with_kernels = start.float().contiguous()
    out = recurrent_step(*(x.float() for x in step), with_kernels)
    monkeypatch.setenv("RINGCTX_CPU_KERNELS", "0")
    assert cpu.gated_delta_(*(x.float()[:, None] for x in step), start.float().contiguous()) is None
    torch_states = start.float().contiguous()
    torch_out = recurrent_step(*(x.float() for x in step), torch_states)
    assert rel_err(torch_out, out) < TOLERANCE and rel_err(torch_states, with_kernels) < TOLERANCE
    exact = start.clone()
    ref_out, ref_state = reference(q, k, v, g, beta, start)
    assert torch.equal(recurrent_step(*step, exact), ref_out[:, 0]) and torch.equal(exact, ref_state)


@needs_kernels
def test_float32_recurrent_runs_the_kernel_and_agrees_with_the_chunked_form():
    """`recurrent` on float32 CPU inputs is the kernel (the same bits as calling it), over a piece of
    two blocks and more, equal to the chunked form from the same start state."""
    q, k, v, g, beta, start = random_inputs(1, 150, 3, 24, 32, seed=9)
    q, k, v, g, beta, start = (x[0].float() for x in (q, k, v, g, beta, start))
    out, end = recurrent(q, k, v, g, beta, start)
    state = start[None].clone()
    assert torch.equal(out, cpu.gated_delta_(q[None], k[None], v[None], g[None], beta[None], state)[0])
    assert torch.equal(end, state[0])
    strided = start.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, not contiguous
    assert all(torch.equal(a, b) for a, b in zip(recurrent(q, k, v, g, beta, strided), (out, end)))
    chunk_out, chunk_end = chunked(q, k, v, g, beta, start)
    assert rel_err(out, chunk_out) < 2e-5 and rel_err(end, chunk_end) < 2e-5


def test_the_recurrence_gives_a_pieces_summary():
    """What context parallelism exchanges (PieceSummary: S_end = transition S_0 + contribution) from
    the token recurrence alone, without the chunked form: the contribution is the end state from
    zero, the transition the end state from I [H, Dk, Dk] with v = 0 (the piece's writes dropped,
    as ChunkForm.scan's values=False). On the CPU these are kernel calls (scripts/bench_gated_delta.py
    times them against building the chunked form)."""
    q, k, v, g, beta, _ = (x[0].float() for x in random_inputs(1, 100, 2, 24, 16, seed=4))
    g, beta = g * 0.002, beta * 0.2  # mild decay and writes: a transition far from 0 after 100 tokens
    summary = PieceSummary.of(ChunkForm.build(q, k, v, g, beta))
    _, contribution = recurrent(q, k, v, g, beta)
    eye = torch.eye(24).expand(2, 24, 24)
    _, transition = recurrent(q, k, torch.zeros(100, 2, 24), g, beta, eye)
    assert summary.transition.abs().max() > 0.1
    assert rel_err(contribution, summary.contribution) < 2e-5 and rel_err(transition, summary.transition) < 2e-5
    ref_c = recurrent(*(x.double() for x in (q, k, v, g, beta)))[1]
    ref_t = recurrent(*(x.double() for x in (q, k, torch.zeros(100, 2, 24), g, beta, eye)))[1]
    assert rel_err(contribution, ref_c) < TOLERANCE and rel_err(transition, ref_t) < TOLERANCE


@needs_kernels
def test_a_sequence_gets_the_same_bits_alone_as_in_a_batch():
    q, k, v, g, beta, start = (x.float() for x in random_inputs(3, 5, 2, 24, 70, seed=3))
    together = start.clone()
    out = cpu.gated_delta_(q, k, v, g, beta, together)
    for b in range(3):
        alone = start[b:b + 1].clone()
        assert torch.equal(cpu.gated_delta_(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], alone),
                           out[b:b + 1])
        assert torch.equal(alone, together[b:b + 1])


@needs_kernels
@pytest.mark.parametrize("Dk,Dv", [(5, 5), (33, 70), (128, 128), (24, 300)])
def test_a_piece_and_its_tokens_as_decode_steps_give_the_same_bits(Dk, Dv):
    """A column's operations do not depend on T (nor on the decode step's prefetch): T steps of B
    sequences equal one call over the T tokens, bit for bit."""
    q, k, v, g, beta, start = (x.float() for x in random_inputs(2, 5, 2, Dk, Dv, seed=Dk + Dv))
    piece = start.clone()
    out = cpu.gated_delta_(q, k, v, g, beta, piece)
    steps = start.clone()
    for t in range(5):
        assert torch.equal(recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], steps), out[:, t]), t
    assert torch.equal(steps, piece)


def test_the_kernel_declines_what_it_does_not_cover():
    """None, the state untouched, for: float64, a non-contiguous state, mismatched shapes, a gradient
    wanted; the entries in attention/gated_delta.py then run PyTorch."""
    q, k, v, g, beta, start = (x.float() for x in random_inputs(2, 3, 2, 8, 8))
    state = start.clone()
    assert cpu.gated_delta_(*(x.double() for x in (q, k, v, g, beta)), state.double()) is None
    assert cpu.gated_delta_(q, k, v, g, beta, state.transpose(2, 3)) is None
    assert cpu.gated_delta_(q, k, v[:, :, :, :4], g, beta, state) is None
    assert cpu.gated_delta_(q, k, v, g[:, :2], beta, state) is None
    with torch.enable_grad():
        assert cpu.gated_delta_(q.clone().requires_grad_(), k, v, g, beta, state) is None
    assert torch.equal(state, start)
    if BUILDABLE:
        assert cpu.gated_delta_(q, k, v, g, beta, state) is not None and not torch.equal(state, start)
