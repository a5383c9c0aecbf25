"""Context parallelism for linear-attention layers: the recurrent state crosses ranks, not a KV ring.

A chunk's new tokens are cut into pieces over the ranks as every layer's are (parallel/layout.py:
2N pieces, rank r holding pieces r and 2N-1-r, so a rank's two pieces are not neighbours). A gated
delta layer (attention/gated_delta.py) needs, for each piece, two things that come before it:

    the recurrent state at its first token    [H, Dk, Dv] float32
    the convolution's K-1 previous inputs     [K-1, C]  (the short causal convolution in front)

Sent piece to piece, either would serialise the ranks. Instead every rank summarises its pieces
from a zero state (a piece's transition [H, Dk, Dk] and contribution [H, Dk, Dv], `PieceSummary`)
and its pieces' last K-1 inputs, one all-gather gives every rank all of them, and each rank
composes in sequence order the start state and the previous inputs of its own pieces (and the
chunk's end state, the next chunk's start: every rank composes it alike, so every rank holds it).

    exchange per layer and chunk: 2N pieces x (H Dk (Dk + Dv) floats + (K-1) C inputs)

States compose in float32 whatever the model's dtype (a bf16 state drifts over many pieces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.gated_delta import PieceSummary
from .comm import rank_and_world


def balanced_piece_order(world: int) -> list[tuple[int, int]]:
    """(rank, which of its two pieces) of pieces 0..2N-1 in sequence order (layout.py's balanced
    sharding: rank r holds pieces r and 2N-1-r)."""
    return [(p, 0) if p < world else (2 * world - 1 - p, 1) for p in range(2 * world)]


@dataclass
class PieceStart:
    """What one of this rank's pieces starts from: the recurrent state before its first token and
    the convolution's previous inputs (its last K-1 inputs before the piece, oldest first)."""

    state: torch.Tensor
    conv_inputs: torch.Tensor


def conv_tail(before: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The last K-1 rows of `before` [K-1, C] followed by `inputs` [n, C]: the convolution's previous
    inputs after a piece (a piece shorter than K-1 keeps some of what came before it)."""
    width = before.shape[0]
    return torch.cat([before, inputs.to(before.dtype)])[-width:] if width else before


def exchange_starts(summaries: list[PieceSummary], tails: list[torch.Tensor], lengths: list[int],
                    state: torch.Tensor, conv_before: torch.Tensor, group=None
                    ) -> tuple[list[PieceStart], torch.Tensor, torch.Tensor]:
    """The start of this rank's two pieces, and the chunk's end (state, convolution inputs).

    summaries: this rank's two pieces' PieceSummary (from a zero state; an empty piece: identity
    transition, zero contribution). tails [K-1, C] each: a piece's last min(K-1, length) inputs,
    zero-padded in front to K-1 rows; lengths: the pieces' token counts. state [H, Dk, Dv] and
    conv_before [K-1, C]: before the chunk's first token (equal on every rank). A collective of
    `group` (one all-gather); every rank returns the same end state and inputs, bit for bit."""
    rank, world = rank_and_world(group)
    H, Dk, Dv = state.shape
    width, C = conv_before.shape
    floats = H * Dk * (Dk + Dv)
    # One flat float32 message per rank: both pieces' transition | contribution | tail | length.
    mine = torch.cat([torch.cat([s.transition.reshape(-1), s.contribution.reshape(-1), tail.float().reshape(-1),
                                 torch.tensor([float(n)])]) for s, tail, n in zip(summaries, tails, lengths)])
    gathered = [torch.empty_like(mine) for _ in range(world)] if world > 1 else [mine]
    if world > 1:
        dist.all_gather(gathered, mine, group=group)
    per_piece = floats + width * C + 1
    starts: list[PieceStart | None] = [None, None]
    current, inputs = state.float(), conv_before
    for owner, which in balanced_piece_order(world):
        piece = gathered[owner][which * per_piece:(which + 1) * per_piece]
        if owner == rank:
            starts[which] = PieceStart(current, inputs)
        transition = piece[:H * Dk * Dk].view(H, Dk, Dk)
        contribution = piece[H * Dk * Dk:floats].view(H, Dk, Dv)
        current = PieceSummary(transition, contribution).apply(current)
        n = int(piece[-1].item())
        tail = piece[floats:floats + width * C].view(width, C)
        inputs = conv_tail(inputs, tail[width - min(n, width):].to(conv_before.dtype))
    return starts, current, inputs


def empty_summary(H: int, Dk: int, Dv: int, device=None) -> PieceSummary:
    """The summary of a piece without tokens: the state passes unchanged."""
    return PieceSummary(torch.eye(Dk, device=device).expand(H, Dk, Dk).contiguous(),
                        torch.zeros(H, Dk, Dv, device=device))


def piece_tail(inputs: torch.Tensor, width: int) -> torch.Tensor:
    """A piece's last min(width, n) inputs [n, C], zero-padded in front to [width, C]."""
    tail = inputs[-width:] if width else inputs[:0]
    return torch.cat([tail.new_zeros(width - tail.shape[0], inputs.shape[1]), tail])
