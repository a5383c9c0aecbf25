"""What one layer's queries see: the attention span (full, sliding window, aligned chunk) and the
per-layer softmax settings (scale, soft-cap, sink logits), as data every attention path reads.

A span is a rule on global positions. Query at position p sees key at position s iff s <= p and

    full            always
    window W        p - s < W                  (Mistral, Gemma 3's local layers, gpt-oss)
    chunk C         p // C == s // C           (Llama 4's chunked layers)
    dual chunk L    always, but the query is rotated three ways by p // L - s // L (Dual Chunk
                    Attention, Qwen2.5-1M: see dual_chunk.py); its blocks say which rotation

Every kernel takes one kind of mask, a *band* on a block whose queries and keys each have
contiguous positions (`attention_block`'s q_offset and window): row i (position q0 + i) sees
key row j (position k0 + j) iff j <= i + q_offset and (window == 0 or j > i + q_offset - window),
with q_offset = q0 - k0. Chunks need no kernel support: cutting the queries at chunk boundaries
and the keys to the chunk's start turns a chunked layer into plain causal blocks (`band_blocks`).

Rows of a block need not be contiguous in position (a ring message holds several pieces; a
decode rank's cache holds rows in arrival order), so both sides are described as *runs*: a run
(row, position, length) is `length` rows from `row` on whose positions are position, position+1, ...
`band_blocks` pairs the query runs with the key runs and returns only the blocks some query
sees, each clipped to the keys its rows can see: a windowed layer costs T*W, not T*S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

import torch

from .kernels import attention_block
from .merge import PartialAccumulator


@dataclass(frozen=True)
class Span:
    """Which earlier keys a query sees (always causal): everything, a sliding window, or its chunk."""

    window: int = 0
    """Sliding window W: a query at p sees keys p-W+1..p. 0: no window."""
    chunk: int = 0
    """Aligned chunk C: a query at p sees keys of its own chunk, from C * (p // C). 0: no chunks."""
    dual_chunk: int = 0
    """Dual Chunk Attention's chunk length L (chunk_size - local_size): every earlier key is seen,
    through one of three query rotations chosen by p // L - s // L (see dual_chunk.py); the query
    tensor then holds the three versions side by side (`query_versions`). 0: one query."""

    def __post_init__(self) -> None:
        if self.window < 0 or self.chunk < 0 or self.dual_chunk < 0:
            raise ValueError(f"a sliding window and a chunk size are positive token counts (0: none); "
                             f"got window={self.window}, chunk={self.chunk}, dual_chunk={self.dual_chunk}")
        if self.dual_chunk and (self.window or self.chunk):
            raise ValueError("a dual chunk layer sees every earlier key: it has no window or chunk")

    @property
    def is_full(self) -> bool:
        """True when every earlier key is seen with one query (plain causal attention)."""
        return self.window == 0 and self.chunk == 0 and self.dual_chunk == 0

    @property
    def sees_everything(self) -> bool:
        """True when a query sees every earlier key (full or dual chunk): nothing can be skipped."""
        return self.window == 0 and self.chunk == 0

    @property
    def query_versions(self) -> int:
        """How many rotated versions of each query head an attention call gets: 3 for dual chunk
        (intra, succ, inter, stacked as heads [0, Hq), [Hq, 2Hq), [2Hq, 3Hq)), else 1."""
        return 3 if self.dual_chunk else 1

    def first_visible(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        first = 0
        if self.window:
            first = max(first, position - self.window + 1)
        if self.chunk:
            first = max(first, position - position % self.chunk)
        return first

    def visible(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """[T, S] bool: query t sees key s (the rule of the module docstring, as tensors)."""
        qp, kp = q_positions.view(-1, 1), k_positions.view(1, -1)
        seen = kp <= qp
        if self.window:
            seen &= qp - kp < self.window
        if self.chunk:
            seen &= torch.div(qp, self.chunk, rounding_mode="floor") == torch.div(kp, self.chunk, rounding_mode="floor")
        return seen

    def kept_tokens(self, length: int) -> int:
        """Keys a sequence of `length` tokens still needs for its next token: all of them, the last
        W, or those of the current chunk (what a cache must keep for decoding)."""
        return length - self.first_visible(length)


FULL = Span()
"""Plain causal attention."""


class Run(NamedTuple):
    """`length` rows from `row` on, at positions position .. position + length - 1."""

    row: int
    position: int
    length: int


class Band(NamedTuple):
    """One attention call of a span: query rows q_start..q_end-1 against key rows k_start..k_end-1.

    causal False: every query sees every key. True: row i sees key j iff j <= i + q_offset and
    (window == 0 or j > i + q_offset - window) (`attention_block`'s band). query: which rotated
    version of the queries the block uses (dual chunk: 0 intra, 1 succ, 2 inter; else 0)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    q_offset: int = 0
    window: int = 0
    query: int = 0


def runs_of(positions: torch.Tensor, row: int = 0) -> list[Run]:
    """The runs of rows whose positions go up by one (positions [n] long; rows numbered from `row`)."""
    n = positions.numel()
    if n == 0:
        return []
    # Vectorised: a decode step asks this of a cache's rows every layer, and a long document's
    # rows come in a few runs, so only the run starts reach Python.
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).view(-1) + 1
    starts = [0, *breaks.tolist()]
    firsts = positions[torch.tensor(starts, device=positions.device)].tolist()
    ends = [*starts[1:], n]
    return [Run(row + a, p, b - a) for a, p, b in zip(starts, firsts, ends)]


def band_blocks(span: Span, q_runs: Iterable[Run], k_runs: Iterable[Run]) -> list[Band]:
    """The blocks that queries of `q_runs` need against keys of `k_runs` under `span`: every key a
    query sees lies in exactly one block, blocks no query sees are left out, and a block whose every
    row sees every key is marked full (the kernels' fastest case).

    Example (window 3, queries at positions 10..13 against keys at 0..13):
        >>> band_blocks(Span(window=3), [Run(0, 10, 4)], [Run(0, 0, 14)])
        [Band(q_start=0, q_end=4, k_start=8, k_end=14, causal=True, q_offset=2, window=3)]
    """
    k_runs = list(k_runs)
    if span.dual_chunk:
        return _dual_chunk_blocks(span.dual_chunk, q_runs, k_runs)
    blocks: list[Band] = []
    for q in q_runs:
        for q_sub in _chunk_pieces(span, q):  # each piece's queries share one chunk
            first_row_sees = span.first_visible(q_sub.position)
            last = q_sub.position + q_sub.length - 1
            for k in k_runs:
                lo = max(k.position, first_row_sees)
                hi = min(k.position + k.length, last + 1)  # key positions lo..hi-1
                if lo >= hi:
                    continue
                q_offset = q_sub.position - lo
                k_start = k.row + lo - k.position
                # Every row sees every key when the last key is at or before the first query and
                # the first key is within the first... last query's window.
                full = hi - 1 <= q_sub.position and (not span.window or last - lo < span.window)
                window = span.window if span.window and last - lo >= span.window else 0
                blocks.append(Band(q_sub.row, q_sub.row + q_sub.length, k_start, k_start + hi - lo,
                                   not full, 0 if full else q_offset, 0 if full else window))
    return blocks


def _dual_chunk_blocks(L: int, q_runs: Iterable[Run], k_runs: list[Run]) -> list[Band]:
    """band_blocks of a dual chunk span of chunk length L: each query run, cut at multiples of L,
    sees the keys of its own chunk causally with the intra rotation (an aligned-chunk span's
    blocks), those of the previous chunk with the succ rotation and everything before that with
    the inter rotation (full blocks: those keys all precede the queries)."""
    blocks = []
    for q in q_runs:
        for piece in _chunk_pieces(Span(chunk=L), q):
            blocks.extend(band_blocks(Span(chunk=L), [piece], k_runs))  # intra: query version 0
            start = piece.position - piece.position % L  # the piece's chunk starts here
            for version, lo, hi in ((1, start - L, start), (2, 0, start - L)):  # succ, inter
                for k in k_runs:
                    a, b = max(k.position, lo), min(k.position + k.length, hi)
                    if a < b:
                        k_start = k.row + a - k.position
                        blocks.append(Band(piece.row, piece.row + piece.length, k_start, k_start + b - a, False,
                                           query=version))
    return blocks


def _chunk_pieces(span: Span, run: Run) -> list[Run]:
    """`run` cut at the span's chunk boundaries (itself when the span has no chunks)."""
    if not span.chunk:
        return [run]
    pieces, row, pos, left = [], run.row, run.position, run.length
    while left:
        n = min(left, span.chunk - pos % span.chunk)
        pieces.append(Run(row, pos, n))
        row, pos, left = row + n, pos + n, left - n
    return pieces


@dataclass(frozen=True)
class LayerSoftmax:
    """A layer's softmax settings beyond the span: every attention path of that layer uses them."""

    scale: float
    """Multiplies q.k (1/sqrt(head_dim) unless the model says otherwise, e.g. Gemma's
    query_pre_attn_scalar^-0.5)."""
    softcap: float = 0.0
    """> 0: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2 style)."""
    span: Span = FULL
    """Which keys a query sees."""
    sinks: torch.Tensor | None = None
    """[Hq] float32 learned sink logits (gpt-oss), or None: each adds exp(sink) to its head's
    softmax denominator and nothing to the numerator; applied once, to the merged result."""

    def finish(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The layer's output from a complete attention (out [T, Hq, D], lse [Hq, T]): out itself, or
        with the sinks: out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)."""
        if self.sinks is None:
            return out
        weight = torch.sigmoid(lse.float() - self.sinks.float().view(-1, 1).to(lse.device))  # [Hq, T]
        return (out.float() * weight.t().unsqueeze(-1)).to(out.dtype)


class KeyRows(NamedTuple):
    """Keys and values [S, Hkv, D] with the runs of their positions (several sources, e.g. a cache's
    rows and a chunk's new rows, can be given to one `span_attention`)."""

    k: torch.Tensor
    v: torch.Tensor
    runs: list[Run]


def query_heads(q: torch.Tensor, softmax: LayerSoftmax | None) -> int:
    """Hq of a layer's queries q [T, versions * Hq, D] (dual chunk layers stack three versions)."""
    return q.shape[1] // (1 if softmax is None else softmax.span.query_versions)


def is_plain(softmax: LayerSoftmax | None) -> bool:
    """True when a layer's attention is plain causal softmax attention (any scale): the fused and
    specialised paths, written for that, apply."""
    return softmax is None or (softmax.span.is_full and not softmax.softcap and softmax.sinks is None)


def span_attention(q: torch.Tensor, q_runs: list[Run], sources: list[KeyRows], softmax: LayerSoftmax, *,
                   backend: str = "auto", one_sequence: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [T, Hq, D] (positions `q_runs`) over every source's keys, as the
    layer's span, scale and soft-cap say: (out [T, Hq, D] in q's dtype, lse [Hq, T] float32), a
    partial result (sinks are not applied: `LayerSoftmax.finish` does, once, after every merge).

    All queries and keys must belong to one sequence (positions are compared as such). A query
    that sees no key gets out 0 and lse -inf. A dual chunk layer's q is [T, 3 * Hq, D], its three
    rotations side by side (`Span.query_versions`); the result has Hq heads.
    """
    T, heads, D = q.shape
    Hq = heads // softmax.span.query_versions
    acc = PartialAccumulator(T, Hq, D, device=q.device)
    for source in sources:
        for b in band_blocks(softmax.span, q_runs, source.runs):
            queries = q[b.q_start:b.q_end, b.query * Hq:(b.query + 1) * Hq]
            out, lse = attention_block(queries, source.k[b.k_start:b.k_end], source.v[b.k_start:b.k_end],
                                       causal=b.causal, q_offset=b.q_offset, window=b.window,
                                       softcap=softmax.softcap, softmax_scale=softmax.scale, backend=backend,
                                       one_sequence=one_sequence)
            acc.add(out, lse, b.q_start, owned=True)
    return acc.result(q.dtype)
