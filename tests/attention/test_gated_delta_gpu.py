"""A piece of the gated delta rule through flash-linear-attention's chunked kernel
(attention/gated_delta_gpu.py) against ringctx's float64 recurrence: outputs from a start state,
the transition M against the product of the A_t, pieces summarised by fla and composed equal to the
whole sequence (mixed with ringctx's own `ChunkForm` pieces), grouped key heads, and fla's plain
call from an initial state.

Without a GPU fla's Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below
before fla is first imported: triton.jit decides at decoration) in float32 on CPU tensors; bf16 is
broken there, so the bf16 test runs on a GPU only. fla-core 0.6's kernels need two shims there
(`interpreter_shims`: autotuning and a loop index), scoped to this module's fla tests on CPU.

On a GPU (scripts/gpu_check.sh) the same tests run on CUDA, float32 matmuls in IEEE (no TF32) so
the float32 tolerances hold, each kernel with its first config (`untuned`: autotuning every test
shape would take minutes). The tests that need fla skip when it is not installed (the README's
test command installs it: the [test] extra)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from ringctx.attention.gated_delta import ChunkForm, PieceSummary, compose, recurrent  # noqa: E402
from ringctx.attention.gated_delta_gpu import (FlaPiece, build_piece, chunked_from, fla_available,  # noqa: E402
                                              interpreter_shims, piece_backend, untuned)
from tests.attention.test_gated_delta import random_inputs  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 against float64: as tests/attention/test_gated_delta.py in the interpreter; on a GPU fla's
# in-block triangular solve multiplies in TF32 whatever the inputs' dtype (fla/ops/gated_delta_rule/
# chunk_fwd.py: SOLVE_TRIL_DOT_PRECISION on Ampere and newer), a 2^-11 rounding.
TOL = 2e-5 if DEVICE == "cpu" else 5e-3
SAME = 1e-5 if DEVICE == "cpu" else 1e-4  # fla against fla: the same kernels on other widths or head maps


@pytest.fixture(scope="module")
def fla():
    """fla, importable and runnable here (the interpreter shims of the module docstring on CPU)."""
    if not fla_available():
        pytest.skip("flash-linear-attention (fla-core) is not installed: pip install 'ringctx[fla]'")
    if DEVICE == "cuda":
        with untuned():
            yield
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no GPU and TRITON_INTERPRET is not 1: fla's kernels cannot run")
    with interpreter_shims():
        yield


def inputs(T: int, H: int = 3, Dk: int = 16, Dv: int = 16, seed: int = 0):
    """random_inputs in float64 (the reference's) and the same in float32 on DEVICE."""
    ref = random_inputs(T, H, Dk, Dv, seed=seed)
    return ref, tuple(x.float().to(DEVICE) for x in ref)


@pytest.mark.parametrize("T", [1, 64, 131])
def test_outputs_from_a_start_state_equal_the_recurrence(fla, T):
    ref, dev = inputs(T)
    start = torch.randn(3, 16, 16, dtype=torch.float64)
    piece = FlaPiece.build(*dev)
    for state in (None, start):
        ref_out, ref_end = recurrent(*ref, state)
        out, end = piece.scan(None if state is None else state.float().to(DEVICE))
        assert out.dtype == end.dtype == torch.float32 and out.shape == (T, 3, 16)
        assert rel_err(out.cpu(), ref_out) < TOL and rel_err(end.cpu(), ref_end) < TOL, (T, state is None)


def test_the_transition_is_the_product_of_the_steps(fla):
    """M from the kernel's identity columns equals A_T ... A_1, A_t = exp(g_t) (I - beta_t k_t k_t^T),
    in float64; C equals the recurrence's end state from zero; and the outputs' start-state part
    is linear in it (values=False), as ChunkForm's."""
    (q, k, v, g, beta), dev = inputs(70, seed=1)
    eye = torch.eye(16, dtype=torch.float64)
    product = eye.expand(3, 16, 16)
    for t in range(70):
        step = g[t].exp()[:, None, None] * (eye - beta[t][:, None, None] * k[t][:, :, None] * k[t][:, None, :])
        product = step @ product
    piece = FlaPiece.build(*dev)
    summary = PieceSummary.of(piece)
    assert summary.transition.dtype == summary.contribution.dtype == torch.float32
    assert rel_err(summary.transition.cpu(), product) < TOL
    assert rel_err(summary.contribution.cpu(), recurrent(q, k, v, g, beta)[1]) < TOL
    start = torch.randn(3, 16, 7, device=DEVICE)  # a width other than Dv: the linear part alone
    fla_lin, fla_end = piece.scan(start, values=False)
    lin, end = ChunkForm.build(*dev).scan(start, values=False)
    assert rel_err(fla_lin, lin) < TOL and rel_err(fla_end, end) < TOL


@pytest.mark.parametrize("cuts", [[0, 1, 65, 150, 200], [0, 100, 101, 200]])
def test_pieces_summarised_and_composed_equal_the_whole(fla, cuts):
    """Each piece from zero gives (M, C); composing them in order gives each its start state; its
    outputs from there are the whole sequence's. Every other piece is ringctx's ChunkForm: the two
    backends' pieces compose with each other."""
    ref, dev = inputs(200, seed=2)
    start = torch.randn(3, 16, 16, dtype=torch.float64)
    ref_out, ref_end = recurrent(*ref, start)
    pieces = [(FlaPiece if i % 2 == 0 else ChunkForm).build(*(x[a:b] for x in dev))
              for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    states = compose([PieceSummary.of(piece) for piece in pieces], start.float().to(DEVICE))
    outs = [piece.scan(state)[0] for piece, state in zip(pieces, states)]
    assert rel_err(torch.cat(outs).cpu(), ref_out) < TOL and rel_err(states[-1].cpu(), ref_end) < TOL


def test_grouped_key_heads_equal_repeated_ones(fla):
    """q, k with Hk = 1 head shared by H = 3 value heads: fla's grouped kernel equals the repeat."""
    _, (q, k, v, g, beta) = inputs(80, seed=3)
    start = torch.randn(3, 16, 16, device=DEVICE)
    grouped = FlaPiece.build(q[:, :1], k[:, :1], v, g, beta).scan(start)
    repeated = FlaPiece.build(q[:, :1].expand(-1, 3, -1), k[:, :1].expand(-1, 3, -1), v, g, beta).scan(start)
    for a, b in zip(grouped, repeated):
        assert rel_err(a, b) < SAME


def test_equals_flas_own_call_from_an_initial_state(fla):
    """The widened call's outputs from a start state equal fla's plain call given that state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _, (q, k, v, g, beta) = inputs(100, seed=4)
    start = torch.randn(3, 16, 16, device=DEVICE)
    o, end = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                    initial_state=start[None].clone(), output_final_state=True)
    out, piece_end = FlaPiece.build(q, k, v, g, beta).scan(start)
    assert rel_err(out, o[0]) < SAME and rel_err(piece_end, end[0]) < SAME


def test_one_ranks_chunk_from_a_state_equals_the_recurrence(fla):
    """chunked_from: fla's plain call from the state (no summary needed), and ringctx's chunked
    form on the "torch" backend, both equal to the float64 recurrence."""
    ref, dev = inputs(150, seed=6)
    start = torch.randn(3, 16, 16, dtype=torch.float64)
    ref_out, ref_end = recurrent(*ref, start)
    kept = start.float().to(DEVICE)
    for backend in ("fla", "torch"):
        out, end = chunked_from(*dev, kept, backend=backend)
        assert torch.equal(kept.cpu(), start.float()), "the caller's state was written"
        assert out.dtype == end.dtype == torch.float32
        assert rel_err(out.cpu(), ref_out) < TOL and rel_err(end.cpu(), ref_end) < TOL, backend
    out, end = chunked_from(*dev, backend="fla")
    assert rel_err(out.cpu(), recurrent(*ref)[0]) < TOL


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 needs a GPU: Triton's interpreter computes bf16 wrongly")
def test_bf16_inputs_keep_float32_states(fla):
    """bf16 q, k, v at the real head size: the states and their composition stay float32; the error
    is bf16 rounding of the inputs (2e-3 alone, through ringctx's float32 ChunkForm) and of fla's
    in-block matmuls, not a drift over pieces."""
    ref, _ = inputs(2048, H=3, Dk=128, Dv=128, seed=5)
    q, k, v, g, beta = (x.to(DEVICE) for x in ref)
    start = torch.randn(3, 128, 128, dtype=torch.float64)
    ref_out, ref_end = recurrent(*ref, start)
    cuts = [0, 700, 1400, 2048]
    pieces = [FlaPiece.build(q[a:b].bfloat16(), k[a:b].bfloat16(), v[a:b].bfloat16(), g[a:b], beta[a:b])
              for a, b in zip(cuts, cuts[1:])]
    states = compose([PieceSummary.of(p) for p in pieces], start.float().to(DEVICE))
    assert all(s.dtype == torch.float32 for s in states)
    out = torch.cat([p.scan(s)[0] for p, s in zip(pieces, states)])
    assert rel_err(out.cpu(), ref_out) < 3e-2 and rel_err(states[-1].cpu(), ref_end) < 3e-2


def test_the_backend_is_fla_on_cuda_when_it_imports(monkeypatch):
    """piece_backend's choice and its errors, with fla present or not (no kernel runs here)."""
    import ringctx.attention.gated_delta_gpu as gpu

    monkeypatch.setattr(gpu, "fla_available", lambda: True)
    assert piece_backend(torch.device("cuda")) == "fla" and piece_backend(torch.device("cpu")) == "torch"
    assert piece_backend(torch.device("cpu"), "fla") == "fla"  # the interpreter's tests
    monkeypatch.setattr(gpu, "fla_available", lambda: False)
    assert piece_backend(torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="flash-linear-attention is not installed"):
        piece_backend(torch.device("cuda"), "fla")
    with pytest.raises(ValueError, match="unknown linear-attention backend 'triton'"):
        piece_backend(torch.device("cpu"), "triton")
    q, k, v, g, beta = (x.float() for x in random_inputs(10))
    from ringctx.attention.gated_delta import TokenPiece
    from ringctx.kernels import cpu

    # on a CPU: ringctx's kernel token by token where it is built, else the chunked form
    assert isinstance(build_piece(q, k, v, g, beta), TokenPiece if cpu.available() else ChunkForm)
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert isinstance(build_piece(q, k, v, g, beta), ChunkForm)


def test_bad_shapes_name_the_shapes(fla):
    _, (q, k, v, g, beta) = inputs(10)
    with pytest.raises(ValueError, match=r"with Hk dividing H"):
        FlaPiece.build(q[:, :2], k[:, :2], v, g, beta)
