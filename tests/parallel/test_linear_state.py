"""A linear-attention layer's state across ranks (parallel/linear_state.py) on 2 and 3 gloo ranks:
each rank's two balanced pieces, summarised from zero and composed after one all-gather, give the
outputs of a float64 recurrence over the whole chunk from its start state, and the convolution's
previous inputs of each piece; every rank ends with the same end state and inputs, bit for bit.
Chunks shorter than the pieces (empty pieces) and pieces shorter than the convolution included."""

import pytest
import torch

from ringctx.attention.gated_delta import recurrent
from tests.helpers import rel_err

from .linear_state_cases import WIDTH, exchange_case, whole_sequence

CASES = [(97, 0), (7, 1), (3, 2), (256, 3)]  # W=3: 7 tokens -> pieces of 2 (then 1, then empty); 3 -> 1 each


@pytest.mark.parametrize("world", [2, 3])
def test_composed_starts_give_the_whole_chunks_outputs_and_convolution_inputs(rank_pool, world):
    results = rank_pool(world).run(exchange_case, CASES)
    for i, (T, seed) in enumerate(CASES):
        tensors, conv, state, conv_before = whole_sequence(T, seed)
        ref_out, ref_state = recurrent(*tensors, state)
        history = torch.cat([conv_before, conv])  # row j + WIDTH is token j's input
        for r in range(world):
            pieces, end, end_inputs = results[r][i]
            for a, b, out, conv_inputs in pieces:
                assert torch.equal(conv_inputs, history[a:a + WIDTH]), (T, r, a)
                if b > a:
                    assert rel_err(out, ref_out[a:b]) < 2e-5, (T, world, r, a, b)
            assert torch.equal(end, results[0][i][1]) and torch.equal(end_inputs, results[0][i][2])
            assert rel_err(end, ref_state) < 2e-5 and torch.equal(end_inputs, history[-WIDTH:])
