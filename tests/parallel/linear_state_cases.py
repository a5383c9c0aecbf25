"""Case functions of tests/parallel/test_linear_state.py, run on every rank of a RankPool."""

from __future__ import annotations

import torch

H, DK, DV, WIDTH, C = 2, 8, 6, 3, 5


def whole_sequence(T: int, seed: int):
    """The chunk's inputs every rank can rebuild: q, k, v, g, beta (as attention/gated_delta.py
    takes them), the convolution inputs [T, C], the state and convolution inputs before the chunk."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(T, H, DK, generator=gen, dtype=torch.float64), dim=-1)
            for _ in "qk")
    v = torch.randn(T, H, DV, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, H, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64)
    conv = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    state = torch.randn(H, DK, DV, generator=gen, dtype=torch.float64)
    conv_before = torch.randn(WIDTH, C, generator=gen).to(torch.bfloat16)
    return (q * DK ** -0.5, k, v, g, beta), conv, state, conv_before


def piece_bounds(T: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of pieces 0..2N-1 (layout.py's cut: ceil(T / 2N) tokens each, the last ones short or empty)."""
    size = -(-T // (2 * world))
    return [(min(p * size, T), min((p + 1) * size, T)) for p in range(2 * world)]


def exchange_case(rank: int, world: int, cases: list[tuple[int, int]]):
    """For each (T, seed): this rank's two pieces' (bounds, outputs from their composed start, the
    convolution inputs before them), and the end state and inputs this rank composed."""
    from ringctx.attention.gated_delta import ChunkForm, PieceSummary
    from ringctx.parallel.linear_state import empty_summary, exchange_conv_inputs, exchange_states, piece_tail

    out = []
    for T, seed in cases:
        tensors, conv, state, conv_before = whole_sequence(T, seed)
        bounds = piece_bounds(T, world)
        mine = [bounds[rank], bounds[2 * world - 1 - rank]]
        conv_starts, end_inputs = exchange_conv_inputs([piece_tail(conv[a:b], WIDTH) for a, b in mine],
                                                       [b - a for a, b in mine], conv_before)
        forms = [ChunkForm.build(*(x[a:b] for x in tensors)) if b > a else None for a, b in mine]
        summaries = [PieceSummary.of(f) if f is not None else empty_summary(H, DK, DV) for f in forms]
        starts, end = exchange_states(summaries, state)
        pieces = [(a, b, f.scan(s)[0] if f is not None else None, inputs)
                  for (a, b), f, s, inputs in zip(mine, forms, starts, conv_starts)]
        out.append((pieces, end, end_inputs))
    return out


def random_layer(dtype=torch.float32):
    """A Gated DeltaNet layer (dim 32, 2 key heads serving 4 value heads) with seeded random weights,
    and a random state before the chunk: the same on every rank and in the test process."""
    from ringctx.model.gated_deltanet import GatedDeltaNet, LinearShape, LinearState

    torch.manual_seed(5)
    layer = GatedDeltaNet(32, LinearShape(key_heads=2, value_heads=4, key_dim=8, value_dim=6, conv_width=4), 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    s = layer.shape
    state = LinearState(torch.randn(s.conv_width - 1, s.channels).to(dtype),
                        torch.randn(s.value_heads, s.key_dim, s.value_dim))
    return layer.to(dtype), state


def layer_case(rank: int, world: int, cases: list[tuple[int, int, str]], exchange: str = "all-gather"):
    """For each (T, seed, dtype): this rank's outputs of its two balanced pieces (with their bounds)
    from runtime/linear_layers.py, and the chunk's end state (`exchange`: how the state travels)."""
    from ringctx.runtime.linear_layers import linear_layer_over_ranks

    out = []
    for T, seed, dtype in cases:
        layer, state = random_layer(getattr(torch, dtype))
        x = torch.randn(T, 32, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, dtype))
        bounds = piece_bounds(T, world)
        mine = [bounds[rank], bounds[2 * world - 1 - rank]]
        with torch.no_grad():
            y, end = linear_layer_over_ranks(layer, torch.cat([x[a:b] for a, b in mine]),
                                             tuple(b - a for a, b in mine), state, exchange=exchange)
        out.append((mine, y, end))
    return out
