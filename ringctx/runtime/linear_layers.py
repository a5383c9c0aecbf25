"""A Gated DeltaNet layer over the context-parallel ranks: each rank computes its two balanced
pieces of a chunk at once, the state crossing ranks in two small exchanges (parallel/linear_state.py).

    on every rank, for its pieces a (chunk r) and b (chunk 2N-1-r):
    1. mixed = the in-projection of each piece                       (the pieces' own tokens)
    2. exchange_conv_inputs: every piece's last K-1 inputs            -> the K-1 before each piece
    3. the convolution, the norms, the gates; each piece prepared (`build_piece`: fla's chunked
       kernel on CUDA, ringctx's token kernel on CPUs, else the chunked form)
    4. each piece's summary (transition, contribution); exchange_states (an all-gather) or
       relay_states (the state out along the ranks and back)      -> the state before each piece
    5. each piece's outputs from its state, the gated norm, the out-projection

With the all-gather the chunk's end state (the next chunk's start; a document's, for decode) comes
out of both exchanges on every rank alike; with the relay on rank 0 alone (the prefill shares it
before the hand-off). Compared with running the layer on one rank, a rank's rule costs about two
passes over its pieces instead of one (on CPUs and with fla one pass of twice the state's width
gives outputs from zero, the transition and the outputs' dependence on the start state; the
chunked form scans three times); the projections, most of a layer at real widths, are the same.
One rank runs its chunk in order with no summary (`GatedDeltaNet.forward`).
"""

from __future__ import annotations

import torch

from ..attention.gated_delta import PieceSummary
from ..attention.gated_delta_gpu import build_piece
from ..model.gated_deltanet import GatedDeltaNet, LinearState
from ..parallel.comm import rank_and_world
from ..parallel.linear_state import (ALL_GATHER, RING, empty_summary, exchange_conv_inputs, exchange_states,
                                     piece_tail, relay_states)


def linear_layer_over_ranks(layer: GatedDeltaNet, x: torch.Tensor, lengths: tuple[int, int], state: LinearState,
                            group=None, stats=None, layer_index: int = 0, exchange: str = ALL_GATHER
                            ) -> tuple[torch.Tensor, LinearState]:
    """This rank's outputs and the chunk's end state.

    x [lengths[0] + lengths[1], dim]: this rank's two pieces' rows, chunk r then chunk 2N-1-r (the
    layout's local order); state: before the chunk, equal on every rank. A collective of `group`
    (the CP ranks): every rank calls it for every linear layer of every chunk, with 0-length
    pieces where it has no tokens. Returns (y [rows, dim] in x's dtype, the state after the chunk).
    stats: a CommStats recording the exchanges' bytes (as layer `layer_index`), or None.
    exchange: how the state travels, ALL_GATHER (every rank ends with the chunk's end state) or
    RING (`relay_states`: only rank 0 of `group` does, and only its `state.recurrent` is read;
    the other ranks' returned recurrent state is theirs unchanged, not the chunk's end)."""
    s = layer.shape
    if rank_and_world(group)[1] == 1:  # pieces 0 and 1 of one rank are the chunk in order: no summaries
        return layer.forward(x, state)
    pieces = list(x.split(list(lengths)))
    mixed = [layer.project(p) for p in pieces]
    befores, conv_end = exchange_conv_inputs([piece_tail(m, s.conv_width - 1) for m in mixed], list(lengths),
                                             state.conv, group, stats, layer_index)
    forms, summaries = [], []
    for p, m, before in zip(pieces, mixed, befores):
        if p.shape[0] == 0:
            forms.append(None)
            summaries.append(empty_summary(s.value_heads, s.key_dim, s.value_dim, x.device))
            continue
        q, k, v = layer.convolve(m, before)
        g, beta = layer.gates(p)
        form = build_piece(q, k, v, g, beta)
        forms.append(form)
        summaries.append(PieceSummary.of(form))
    if exchange == RING:
        starts, end = relay_states(summaries, state.recurrent, group, stats, layer_index)
        end = state.recurrent if end is None else end
    else:
        starts, end = exchange_states(summaries, state.recurrent, group, stats, layer_index)
    outs = [layer.finish(form.scan(start)[0], p) if form is not None else p.new_zeros(0, p.shape[1])
            for form, start, p in zip(forms, starts, pieces)]
    return torch.cat(outs), LinearState(conv_end, end)
