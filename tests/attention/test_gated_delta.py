"""The gated delta rule (attention/gated_delta.py) against a float64 token-by-token recurrence and
transformers' own torch implementations: the chunked form at odd lengths and block sizes, from a
start state; a sequence cut into pieces, each summarised from zero and composed in order (what
context parallelism exchanges), equal to the whole; the transition's linearity."""

import pytest
import torch

from ringctx.attention.gated_delta import ChunkForm, PieceSummary, chunked, compose, recurrent
from tests.helpers import rel_err


def random_inputs(T: int, H: int = 3, Dk: int = 16, Dv: int = 12, seed: int = 0, dtype=torch.float64):
    """q, k L2-normalised (q also scaled by Dk^-0.5, as the layer hands them over), v, g <= 0 (some
    near 0: slow decay, the hard case for long sequences), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, Dk, generator=gen, dtype=dtype), dim=-1) for _ in "qk")
    v = torch.randn(T, H, Dv, generator=gen, dtype=dtype)
    g = -torch.rand(T, H, generator=gen, dtype=dtype) * torch.tensor([0.01, 0.3, 2.0], dtype=dtype)[:H]
    beta = torch.rand(T, H, generator=gen, dtype=dtype)
    return q * Dk ** -0.5, k, v, g, beta


@pytest.mark.parametrize("T,block", [(1, 64), (5, 4), (64, 64), (131, 64), (200, 16)])
def test_the_chunked_form_equals_the_recurrence(T, block):
    q, k, v, g, beta = random_inputs(T)
    start = torch.randn(3, 16, 12, dtype=torch.float64)
    for state in (None, start):
        ref_out, ref_state = recurrent(q, k, v, g, beta, state)
        out, end = chunked(q, k, v, g, beta, state, block=block)
        assert out.dtype == end.dtype == torch.float32
        assert rel_err(out, ref_out) < 2e-5 and rel_err(end, ref_state) < 2e-5, (T, block, state is None)


def test_equals_transformers_chunked_and_recurrent_rules():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta = (x.float() for x in random_inputs(150, seed=1))
    start = torch.randn(3, 16, 12)
    # transformers takes [batch, T, H, D], normalises and scales q itself: hand it the raw directions
    q_raw = q * 16 ** 0.5
    ref, ref_state = hf.torch_chunk_gated_delta_rule(q_raw[None], k[None], v[None], g[None], beta[None],
                                                     initial_state=start[None], output_final_state=True)
    out, end = chunked(q, k, v, g, beta, start)
    assert rel_err(out, ref[0]) < 1e-5 and rel_err(end, ref_state[0]) < 1e-5
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(q_raw[None, :9], k[None, :9], v[None, :9], g[None, :9],
                                                         beta[None, :9], initial_state=start[None],
                                                         output_final_state=True)
    out, end = recurrent(q[:9], k[:9], v[:9], g[:9], beta[:9], start)
    assert rel_err(out, ref[0]) < 1e-5 and rel_err(end, ref_state[0]) < 1e-5


@pytest.mark.parametrize("cuts", [[0, 70, 140, 300], [0, 1, 2, 65, 300], [0, 150, 151, 300]])
def test_pieces_summarised_from_zero_and_composed_equal_the_whole(cuts):
    """Each piece alone from a zero state -> (transition, contribution); composing them in order gives
    every piece its true start state; its scan from that state gives the whole sequence's outputs.
    Pieces of one token and pieces shorter than a block included."""
    q, k, v, g, beta = random_inputs(300, seed=2)
    start = torch.randn(3, 16, 12, dtype=torch.float64)
    ref_out, ref_state = recurrent(q, k, v, g, beta, start)
    forms = [ChunkForm.build(*(x[a:b] for x in (q, k, v, g, beta))) for a, b in zip(cuts, cuts[1:])]
    states = compose([PieceSummary.of(form) for form in forms], start)
    outs = [form.scan(s)[0] for form, s in zip(forms, states)]
    assert rel_err(torch.cat(outs), ref_out) < 2e-5 and rel_err(states[-1], ref_state) < 2e-5


def test_outputs_are_the_zero_start_outputs_plus_a_term_linear_in_the_start_state():
    q, k, v, g, beta = random_inputs(90, seed=3)
    form = ChunkForm.build(q, k, v, g, beta)
    s1, s2 = torch.randn(2, 3, 16, 12, dtype=torch.float64)
    zero, _ = form.scan(None)
    lin1, end1 = form.scan(s1, values=False)
    lin2, _ = form.scan(s1 + 2 * s2, values=False)
    lin3, _ = form.scan(s2, values=False)
    assert rel_err(lin2, lin1 + 2 * lin3) < 1e-5
    full, end = form.scan(s1)
    assert rel_err(full, zero + lin1) < 1e-5
    summary = PieceSummary.of(form)
    assert rel_err(end, summary.apply(s1)) < 1e-5 and rel_err(end1, summary.transition @ s1.float()) < 1e-5
