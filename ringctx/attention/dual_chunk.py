"""Dual Chunk Attention (DCA): the rotary positions and length factor of a layer that attends
past its RoPE's trained range by folding positions into chunks (Qwen2.5-7B/14B-Instruct-1M).

The numerics are vLLM's (DualChunkRotaryEmbedding and the dual-chunk flash-attention backend),
dense variant only (vLLM's sparse vertical-and-slash attention is not computed). With
L = chunk_size - local_size ("chunk_len") and c(p) = p // L a position's chunk:

    key at position s          rotated at  s mod L
    query at p, key at s with
        c(s) == c(p)  (intra)  query rotated at  p mod L                    causal (s <= p)
        c(s) == c(p) - 1 (succ)                  min(p mod L + L, chunk_size)   every key
        c(s) <= c(p) - 2 (inter)                 min(2L - 1, chunk_size)        every key

so a (query, key) pair's relative rotation is p - s inside one chunk (plain RoPE: below L tokens
DCA is plain attention, exactly), at most chunk_size to the previous chunk, and a constant further
back. The three partial attentions are merged by log-sum-exp (`spans.band_blocks` cuts a query
run's keys into the three kinds; the query arrives in three rotated versions).

Length factor: with original_max_position > 0, vLLM multiplies each key, when it is written, and
each query by s(n) = max(1, 0.1 ln(n / original_max_position) + 1), n the sequence's length at
that time (the whole prompt's length for prompt tokens, prefilled at once or in chunks; position
+ 1 for a decoded token). ringctx folds s into the cos/sin of the key and of the three query
rotations, so the scores are scale * s(n_query) * s(n_key) * q.k as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class DualChunk:
    """A layer's Dual Chunk Attention parameters (the config's `dual_chunk_attention_config`)."""

    chunk_size: int
    """Positions a query may be rotated at (the RoPE's trained range), e.g. 262,144."""
    local_size: int
    """How far the successive-chunk rotation stays below chunk_size, e.g. 8,192."""
    original_max_position: int = 0
    """> 0: past this many tokens keys and queries are scaled by `length_factor`. 0: never."""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.local_size <= 0 or self.local_size >= self.chunk_size:
            raise ValueError(f"dual chunk attention needs 0 < local_size < chunk_size, got chunk_size="
                             f"{self.chunk_size}, local_size={self.local_size}; fix dual_chunk_attention_config")
        if self.original_max_position < 0:
            raise ValueError(f"dual chunk attention: original_max_position_embeddings must be >= 0 (0: no "
                             f"length scaling), got {self.original_max_position}")

    @property
    def chunk_len(self) -> int:
        """L = chunk_size - local_size: the length of the chunks positions are folded into."""
        return self.chunk_size - self.local_size

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] long -> the positions keys are rotated at, [T] long (p mod L)."""
        return torch.remainder(positions, self.chunk_len)

    def query_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] long -> [3, T] long: the intra, succ and inter rotation positions."""
        L = self.chunk_len
        intra = torch.remainder(positions, L)
        succ = (intra + L).clamp(max=self.chunk_size)
        inter = torch.full_like(intra, min(2 * L - 1, self.chunk_size))
        return torch.stack([intra, succ, inter])

    def length_factor(self, lengths: "int | torch.Tensor") -> "float | torch.Tensor":
        """s(n) = max(1, 0.1 ln(n / original_max_position) + 1) for a sequence length n (an int, or
        a float64 tensor of lengths); 1 without an original_max_position."""
        if not self.original_max_position:
            return 1.0 if not isinstance(lengths, torch.Tensor) else torch.ones_like(lengths, dtype=torch.float64)
        if isinstance(lengths, torch.Tensor):
            n = lengths.to(torch.float64).clamp(min=1)
            return (0.1 * torch.log(n / self.original_max_position) + 1.0).clamp(min=1.0)
        return max(1.0, 0.1 * math.log(max(int(lengths), 1) / self.original_max_position) + 1.0)

    def describe(self) -> str:
        """'dual chunk 262144/8192' for tables."""
        return f"dual chunk {self.chunk_size}/{self.local_size}"

