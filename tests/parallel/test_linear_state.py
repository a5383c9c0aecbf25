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


LAYER_CASES = [(97, 0, "float32"), (5, 1, "float32"), (130, 2, "bfloat16")]


@pytest.mark.parametrize("world", [2, 3])
def test_a_gated_deltanet_layer_over_ranks_equals_the_layer_on_one(rank_pool, world):
    """runtime/linear_layers.py: each rank's pieces' outputs and the chunk's end state (convolution
    inputs and recurrent state) equal the layer run over the whole chunk in one process."""
    from .linear_state_cases import layer_case, random_layer

    results = rank_pool(world).run(layer_case, LAYER_CASES)
    for i, (T, seed, dtype) in enumerate(LAYER_CASES):
        layer, state = random_layer(getattr(torch, dtype))
        x = torch.randn(T, 32, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, dtype))
        with torch.no_grad():
            ref, ref_end = layer(x, state)
        tol = 1e-5 if dtype == "float32" else 2e-2
        for r in range(world):
            mine, y, end = results[r][i]
            ref_rows = torch.cat([ref[a:b] for a, b in mine])
            if ref_rows.numel():
                assert rel_err(y, ref_rows) < tol, (T, dtype, world, r)
            # (the in-projection of a piece rounds as a GEMM of other rows may: equal to the float32 rounding)
            assert rel_err(end.conv, ref_end.conv) < tol and rel_err(end.recurrent, ref_end.recurrent) < tol
            assert torch.equal(end.recurrent, results[0][i][2].recurrent)  # every rank composed it alike


@pytest.mark.parametrize("world", [2, 3])
def test_the_ring_relay_gives_the_all_gathers_bits(rank_pool, world):
    """The state relayed out along the ranks and back (parallel/linear_state.py's relay_states, what
    `plan` picks for large states) gives every rank the all-gather's outputs bit for bit, and rank 0
    the chunk's end state (the others keep the state they were given)."""
    from .linear_state_cases import layer_case, random_layer

    gathered = rank_pool(world).run(layer_case, LAYER_CASES)
    relayed = rank_pool(world).run(layer_case, LAYER_CASES, "ring")
    for i, (T, seed, dtype) in enumerate(LAYER_CASES):
        _, before = random_layer(getattr(torch, dtype))
        for r in range(world):
            (mine, y, end), (mine_ring, y_ring, end_ring) = gathered[r][i], relayed[r][i]
            assert mine == mine_ring and torch.equal(y, y_ring), (T, world, r)
            assert torch.equal(end.conv, end_ring.conv)
            assert torch.equal(end_ring.recurrent, end.recurrent if r == 0 else before.recurrent), (T, world, r)
