"""What a hybrid's linear-attention (Gated DeltaNet) layers cost: their FLOPs per token, the bytes
of their states, their two exchanges over the CP ranks and how the state summaries travel.

A linear layer keeps no KV rows: no ring, no KV bytes, no pass-KV / pass-Q choice. Per chunk of
T tokens on one device (attention/gated_delta.py's `ChunkForm`, blocks of B = 64 tokens, H = Hv
value heads, q and k repeated to them; 2 FLOPs a multiply-add, matmuls only):

    build, per block and head   k_beta k^T 2 B^2 Dk, the two unit-triangular solves B^2 Dv + B^2 Dk
                                (B^2 a right-hand column, a dense bound),
                                q k^T 2 B^2 Dk                      -> B (5 Dk + Dv) a token
    scan with outputs           w S 2 B Dk Dv, q_decayed S 2 B Dk Dv, intra v_new 2 B^2 Dv,
                                k_to_end^T v_new 2 B Dk Dv          -> 6 Dk Dv + 2 B Dv a token
    one device                  H (B (5 Dk + 3 Dv) + 6 Dk Dv) a token, + the convolution 2 K C

Over N > 1 ranks (runtime/linear_layers.py) each piece is also summarised: a scan from zero
without outputs (4 Dk Dv a token) and one from I for the transition (4 Dk Dk), so a token costs
H (B (5 Dk + 3 Dv) + 10 Dk Dv + 4 Dk^2) + 2 K C. The projections (q|k|v, z, b, a in, out) are
matmuls of the layer's weights, counted with the other matmuls (`strategy.linear_params_per_layer`).

Per chunk and layer the ranks exchange (parallel/linear_state.py), in float32:

    conv tails   (K-1) C + 1 values a piece, all-gathered: 2 pieces from each of the W ranks
    summaries    H Dk (Dk + Dv) values a piece (transition and contribution)

The summaries can travel two ways (`summary_exchange`): an all-gather of all 2W of them (what
parallel/linear_state.py runs), after which every rank composes them in sequence order; or a
ring relay of the true state itself: rank r holds pieces r and 2W-1-r, so the sequence runs out
along the ranks' first pieces and back along their second ones, 2(W-1) hops of one state
[H, Dk, Dv] each after one `PieceSummary.apply` (every rank knows the chunk's start state, so a
state suffices; the relay ends on rank 0, whose first piece starts the next chunk, and the
decode ranks take the last chunk's end state once, at the hand-off). Its path
carries 2(W-1) states where a rank of the all-gather receives 2(W-1) summaries, Dv / (Dk + Dv) of
the bytes, but pays 2(W-1) latencies one after another: it wins where bandwidth dominates (large
states), the all-gather where latency does. With one message per peer both grow as W-1 and the
choice follows the state's size; a calibrated all-gather of one call's latency wins more often
as W grows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..attention.gated_delta import BLOCK
from ..model.config import LinearShape, ModelConfig
from ..parallel.linear_state import ALL_GATHER, RING  # how the summaries travel: the runtime's names

STATE_BYTES = 4
"""Bytes of one recurrent-state, summary or conv-tail value on the wire and in the scan: float32
(parallel/linear_state.py; a bf16 state drifts over many pieces)."""

def delta_rule_flops_per_token(shape: LinearShape, over_ranks: bool, block: int = BLOCK) -> int:
    """FLOPs of one token through the gated delta rule and the convolution (not the projections):
    Hv (B (5 Dk + 3 Dv) + 6 Dk Dv) + 2 K C on one device; over ranks (`over_ranks`) each piece's
    summary adds Hv (4 Dk Dv + 4 Dk^2) (see the module docstring)."""
    Dk, Dv, B = shape.key_dim, shape.value_dim, block
    per_head = B * (5 * Dk + 3 * Dv) + 6 * Dk * Dv
    if over_ranks:
        per_head += 4 * Dk * Dv + 4 * Dk * Dk
    return shape.value_heads * per_head + 2 * shape.conv_width * shape.channels


def projection_params(shape: LinearShape, dim: int) -> int:
    """Weights of a linear layer's matmuls (what a token multiplies through): in-projections
    q|k|v [C, dim], z [Hv Dv, dim], b and a [Hv, dim], out-projection [dim, Hv Dv]."""
    v = shape.value_heads * shape.value_dim
    return dim * (shape.channels + v + 2 * shape.value_heads) + v * dim


def tp_shape(shape: LinearShape, tp_size: int) -> LinearShape:
    """One TP rank's share of a linear layer: its key heads and their value heads
    (model/tensor_parallel.py splits the layer by key head); a ValueError when TP does not divide them."""
    if shape.key_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the {shape.key_heads} key heads of a linear-attention "
                         f"layer ({shape.describe()}); use a divisor of {shape.key_heads}")
    return dataclasses.replace(shape, key_heads=shape.key_heads // tp_size,
                               value_heads=shape.value_heads // tp_size)


def linear_layer_shapes(model: ModelConfig, tp_size: int = 1) -> dict[LinearShape, int]:
    """The model's linear layers by shape (one TP rank's share): {shape: layers}."""
    counts: dict[LinearShape, int] = {}
    for layer in model.linear_layers:
        shape = tp_shape(model.linear(layer), tp_size)
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def state_bytes_per_rank(model: ModelConfig, tp_size: int, dtype_bytes: int) -> int:
    """One sequence's states over all linear layers on one GPU: its TP share of each layer's heads
    (recurrent states float32, conv inputs in the model's dtype of `dtype_bytes`). Every CP rank
    holds them whole (both exchanges leave the chunk's end state on every rank alike)."""
    return sum(n * shape.state_bytes(dtype_bytes) for shape, n in linear_layer_shapes(model, tp_size).items())


def decode_state_bytes(model: ModelConfig, dtype_bytes: int) -> int:
    """Bytes a decode step moves for one sequence's linear layers: each state read and written
    once, 2 x `ModelConfig.linear_state_bytes`."""
    return 2 * model.linear_state_bytes(dtype_bytes)


def conv_tail_bytes(shape: LinearShape) -> int:
    """One piece's conv-tail message: ((K-1) C + 1) float32 values (the piece's last K-1 inputs and
    its length)."""
    return ((shape.conv_width - 1) * shape.channels + 1) * STATE_BYTES


def summary_bytes(shape: LinearShape) -> int:
    """One piece's summary: Hv Dk (Dk + Dv) float32 values (transition [Hv, Dk, Dk], contribution
    [Hv, Dk, Dv])."""
    return shape.value_heads * shape.key_dim * (shape.key_dim + shape.value_dim) * STATE_BYTES


def apply_flops(shape: LinearShape) -> int:
    """FLOPs of one `PieceSummary.apply`: transition [Hv, Dk, Dk] times a state [Hv, Dk, Dv]."""
    return 2 * shape.value_heads * shape.key_dim * shape.key_dim * shape.value_dim


def working_bytes(shape: LinearShape, rows: int, dtype_bytes: int) -> int:
    """One linear layer's working set for `rows` tokens on one GPU (one TP rank's `shape`): the
    in-projections' outputs (q|k|v, z, b, a) in the model's dtype, t (C + Hv Dv + 2 Hv) e, and in
    float32 the rule's q, k, v repeated to Hv heads, the chunked form (u, w, q_decayed, k_to_end,
    the block's intra products) and the outputs: t Hv (5 Dk + 3 Dv + B) 4."""
    s = shape
    projections = rows * (s.channels + s.value_heads * s.value_dim + 2 * s.value_heads) * dtype_bytes
    rule = rows * s.value_heads * (5 * s.key_dim + 3 * s.value_dim + BLOCK) * STATE_BYTES
    return projections + rule


def exchange_buffer_bytes(shape: LinearShape, cp_size: int) -> int:
    """What a rank holds of one layer's exchanges at once: every rank's two pieces' conv tails and
    summaries gathered, 2W (conv tail + summary) bytes (0 with one rank)."""
    return 0 if cp_size == 1 else 2 * cp_size * (conv_tail_bytes(shape) + summary_bytes(shape))


@dataclass(frozen=True)
class SummaryExchange:
    """One linear layer's exchanges for one chunk on W ranks, and how its summaries travel.

    all_gather_s = collective latency + 2(W-1) summary_bytes / BW + 2W applies (every rank
    composes all pieces); ring_s = 2(W-1) (latency + state_bytes / BW + one apply) + one apply
    (the relay). The collective's latency: the profile's all2all latency when calibrated (one
    call), else (W-1) latencies (one message per peer), as pass-Q's All2All is priced."""

    cp_size: int
    """W: ranks of the ring."""
    conv_bytes: int
    """One piece's conv-tail message (`conv_tail_bytes`)."""
    summary_bytes: int
    """One piece's summary (`summary_bytes`)."""
    state_bytes: int
    """One recurrent state, Hv Dk Dv float32 (`LinearShape.recurrent_bytes`): the relay's message a hop."""
    conv_s: float
    """The conv tails' all-gather (always an all-gather: a few rows a piece)."""
    all_gather_s: float
    """The summaries all-gathered and composed on every rank."""
    ring_s: float
    """The true state relayed over 2(W-1) hops."""
    strategy: str
    """ALL_GATHER or RING: the cheaper of the two (the all-gather on a tie: it is what runs today)."""
    reason: str
    """The arithmetic behind the choice, one line."""

    @property
    def seconds(self) -> float:
        """Both exchanges of the layer for the chunk, with the chosen way: conv_s + the chosen one."""
        return self.conv_s + (self.all_gather_s if self.strategy == ALL_GATHER else self.ring_s)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "seconds": self.seconds}


def summary_exchange(shape: LinearShape, cp_size: int, ring, apply_flops_per_s: float) -> SummaryExchange:
    """Both exchanges of one linear layer (`shape`, one TP rank's share) for one chunk on `cp_size`
    ranks, priced with `ring` (`HardwareProfile.ring(W)`: latency, bandwidth, all2all numbers) and
    the FLOP/s of a summary's apply (float32 matmuls); the summaries' way is the cheaper one."""
    W = cp_size
    conv, summary, state = conv_tail_bytes(shape), summary_bytes(shape), shape.recurrent_bytes
    apply_s = apply_flops(shape) / apply_flops_per_s
    if W == 1:
        return SummaryExchange(1, conv, summary, state, 0.0, 0.0, 0.0, ALL_GATHER, "one rank: nothing to exchange")
    if ring.all2all_latency_s is None:  # one message per peer
        latency, bandwidth, calls = (W - 1) * ring.latency_s, ring.bandwidth_bytes_per_s, f"{W - 1} x latency"
    else:  # one collective call
        latency, bandwidth, calls = ring.all2all_latency_s, ring.all2all_bandwidth_bytes_per_s, "one call's latency"
    conv_s = latency + 2 * (W - 1) * conv / bandwidth
    gather_s = latency + 2 * (W - 1) * summary / bandwidth + 2 * W * apply_s
    hops = 2 * (W - 1)
    ring_s = hops * (ring.latency_s + state / ring.bandwidth_bytes_per_s + apply_s) + apply_s
    strategy = ALL_GATHER if gather_s <= ring_s else RING
    reason = (f"{strategy}: all-gather {gather_s * 1e3:.3g} ms ({calls} + 2(W-1)={2 * (W - 1)} summaries of "
              f"{summary:,} B + 2W={2 * W} applies) vs ring {ring_s * 1e3:.3g} ms ({hops} hops of a "
              f"{state:,} B state, each latency {ring.latency_s * 1e6:.3g} us + one apply) at W={W}")
    return SummaryExchange(W, conv, summary, state, conv_s, gather_s, ring_s, strategy, reason)
