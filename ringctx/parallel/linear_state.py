"""Context parallelism for linear-attention layers: the recurrent state crosses ranks, not a KV ring.

A chunk's new tokens are cut into pieces over the ranks as every layer's are (parallel/layout.py:
2N pieces, rank r holding pieces r and 2N-1-r, so a rank's two pieces are not neighbours). A gated
delta layer (attention/gated_delta.py) needs, for each piece, two things that come before it:

    the recurrent state at its first token    [H, Dk, Dv] float32
    the convolution's K-1 previous inputs     [K-1, C]  (the short causal convolution in front)

Sent piece to piece, either would serialise the ranks. Instead two all-gathers per layer and
chunk, each composed by every rank in sequence order (and to the chunk's end, the next chunk's
start, which every rank so holds alike); or, where planning/linear_attention.py finds it cheaper
(large states, many ranks), the second as a relay of the true state out along the ranks and back
(`relay_states`: only rank 0 ends with the chunk's end state, which only it needs next):

    exchange_conv_inputs   each piece's last K-1 in-projected inputs (they depend on the piece
                           alone): (K-1) C values a piece; then every rank runs the convolution
    exchange_states        each piece's summary from a zero state (transition [H, Dk, Dk] and
                           contribution [H, Dk, Dv], `PieceSummary`): H Dk (Dk + Dv) floats a piece;
                           then every rank scans its pieces again from their true start states

States compose in float32 whatever the model's dtype (a bf16 state drifts over many pieces).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from ..attention.gated_delta import PieceSummary
from .comm import rank_and_world


def balanced_piece_order(world: int) -> list[tuple[int, int]]:
    """(rank, which of its two pieces) of pieces 0..2N-1 in sequence order (layout.py's balanced
    sharding: rank r holds pieces r and 2N-1-r)."""
    return [(p, 0) if p < world else (2 * world - 1 - p, 1) for p in range(2 * world)]


def conv_tail(before: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The last K-1 rows of `before` [K-1, C] followed by `inputs` [n, C]: the convolution's previous
    inputs after a piece (a piece shorter than K-1 keeps some of what came before it)."""
    width = before.shape[0]
    return torch.cat([before, inputs.to(before.dtype)])[-width:] if width else before


def _all_gather_flat(mine: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    """Every rank's float32 message (equal sizes), in rank order."""
    if world == 1:
        return [mine]
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return gathered


def exchange_conv_inputs(tails: list[torch.Tensor], lengths: list[int], conv_before: torch.Tensor, group=None,
                         stats=None, layer: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The convolution's previous inputs of this rank's two pieces [K-1, C] each, and after the
    chunk's last token (the next chunk's, equal on every rank).

    tails [K-1, C]: a piece's last min(K-1, length) inputs, zero-padded in front (`piece_tail`);
    lengths: the pieces' token counts; conv_before [K-1, C]: before the chunk (equal on every rank).
    A collective of `group` (one all-gather of (K-1) C + 1 values a piece). The inputs are the
    in-projection's rows, which depend on the piece alone: this exchange comes first, the state's
    after the convolution (`exchange_states`). stats: a CommStats that records this rank's bytes
    sent ("linear-conv", for `layer`), or None."""
    rank, world = rank_and_world(group)
    width, C = conv_before.shape
    mine = torch.cat([torch.cat([t.float().reshape(-1), torch.tensor([float(n)], device=t.device)])
                      for t, n in zip(tails, lengths)])  # on the tails' device: NCCL moves GPU tensors only
    gathered = _all_gather_flat(mine, group, world)
    _record(stats, "linear-conv", layer, mine, world)
    per_piece = width * C + 1
    starts: list[torch.Tensor | None] = [None, None]
    inputs = conv_before
    for owner, which in balanced_piece_order(world):
        piece = gathered[owner][which * per_piece:(which + 1) * per_piece]
        if owner == rank:
            starts[which] = inputs
        n = int(piece[-1].item())
        tail = piece[:width * C].view(width, C)
        inputs = conv_tail(inputs, tail[width - min(n, width):].to(conv_before.dtype))
    return starts, inputs


def exchange_states(summaries: list[PieceSummary], state: torch.Tensor, group=None, stats=None, layer: int = 0
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The recurrent state before each of this rank's two pieces [H, Dk, Dv] (float32), and after
    the chunk's last token (the next chunk's, the same bits on every rank).

    summaries: this rank's two pieces' PieceSummary from a zero state (`empty_summary` for a piece
    without tokens); state: before the chunk (equal on every rank). A collective of `group` (one
    all-gather of H Dk (Dk + Dv) floats a piece; stats: as `exchange_conv_inputs`', "linear-state")."""
    rank, world = rank_and_world(group)
    H, Dk, Dv = state.shape
    mine = torch.cat([torch.cat([s.transition.reshape(-1), s.contribution.reshape(-1)]) for s in summaries])
    gathered = _all_gather_flat(mine, group, world)
    _record(stats, "linear-state", layer, mine, world)
    per_piece = H * Dk * (Dk + Dv)
    starts: list[torch.Tensor | None] = [None, None]
    current = state.float()
    for owner, which in balanced_piece_order(world):
        piece = gathered[owner][which * per_piece:(which + 1) * per_piece]
        if owner == rank:
            starts[which] = current
        summary = PieceSummary(piece[:H * Dk * Dk].view(H, Dk, Dk), piece[H * Dk * Dk:].view(H, Dk, Dv))
        current = summary.apply(current)
    return starts, current


def relay_states(summaries: list[PieceSummary], state: torch.Tensor, group=None, stats=None, layer: int = 0
                 ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`exchange_states` as a relay of the true state instead of an all-gather of summaries: the
    sequence runs out along the ranks' first pieces (0, 1, ..., N-1) and back along their second
    ones (N-1, ..., 0), each rank applying its piece's summary to the state it receives and sending
    the result on: 2(N-1) hops of one state [H, Dk, Dv] float32, one after another (planning/
    linear_attention.py says when that beats the all-gather). Returns (the start states of this
    rank's two pieces, the chunk's end state on rank 0 of `group`, whose first piece starts the next
    chunk, None elsewhere). `state` (before the chunk) is read on rank 0 only. Each state is the
    same `PieceSummary.apply` of the same tensors as the all-gather's composition: the same bits."""
    rank, world = rank_and_world(group)
    first, second = summaries
    if world == 1:
        middle = first.apply(state)
        return [state.float(), middle], second.apply(middle)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    H, Dk, Dv = state.shape
    if rank == 0:
        start_a = state.float()
    else:
        start_a = torch.empty(H, Dk, Dv, device=state.device)
        dist.recv(start_a, src=peer(rank - 1), group=group)
    end_a = first.apply(start_a)
    if rank < world - 1:
        dist.send(end_a, dst=peer(rank + 1), group=group)
        start_b = torch.empty_like(end_a)
        dist.recv(start_b, src=peer(rank + 1), group=group)
        _record_message(stats, layer, end_a)
    else:
        start_b = end_a
    end_b = second.apply(start_b)
    if rank > 0:
        dist.send(end_b, dst=peer(rank - 1), group=group)
        _record_message(stats, layer, end_b)
    return [start_a, start_b], end_b if rank == 0 else None


LINEAR_KINDS = ("linear-conv", "linear-state")
"""CommStats kinds of the two exchanges."""
ALL_GATHER, RING = "all-gather", "ring"
"""How the state summaries travel (`exchange_states`, `relay_states`; planning/linear_attention.py
prices both and picks with the same names)."""


def _record(stats, kind: str, layer: int, mine: torch.Tensor, world: int) -> None:
    """An all-gather sends this rank's message to each of the other W-1 ranks (a ring: W-1 hops)."""
    if stats is not None and world > 1:
        stats.record(kind, layer, (world - 1) * mine.numel() * mine.element_size())


def _record_message(stats, layer: int, state: torch.Tensor) -> None:
    """One relay hop: this rank sent one state."""
    if stats is not None:
        stats.record("linear-state", layer, state.numel() * state.element_size())


def empty_summary(H: int, Dk: int, Dv: int, device=None) -> PieceSummary:
    """The summary of a piece without tokens: the state passes unchanged."""
    return PieceSummary(torch.eye(Dk, device=device).expand(H, Dk, Dk).contiguous(),
                        torch.zeros(H, Dk, Dv, device=device))


def piece_tail(inputs: torch.Tensor, width: int) -> torch.Tensor:
    """A piece's last min(width, n) inputs [n, C], zero-padded in front to [width, C]."""
    tail = inputs[-width:] if width else inputs[:0]
    return torch.cat([tail.new_zeros(width - tail.shape[0], inputs.shape[1]), tail])
