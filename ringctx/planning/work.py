"""A chunked prefill's work, chunk by chunk, and the ETA that counts it.

Chunk k of a prompt attends to all k chunks before it, so chunks grow dearer as the cache does:
on a 2-core CPU the first three chunks of a 12,288-token prompt took 29, 48 and 72 s. A progress
bar that counts chunks, and an ETA from the mean chunk so far, are then wrong by a factor that
grows with the prompt (a 1M-token run showed "ETA 1:34:41" after 2 of 245 chunks; it would have
taken days). `WorkProgress` counts the cost model's FLOPs instead (`chunk_flops`: the matmuls and
the causal attention of every layer) and corrects them by the chunks already timed. The CLI's
progress bar and the server's ingest ETA both use it.
"""

from __future__ import annotations

from ..model.config import ModelConfig
from .linear_attention import delta_rule_flops_per_token
from .strategy import linear_flops, span_attention_flops


def chunk_flops(new_tokens: int, cached_tokens: int, model: ModelConfig) -> float:
    """FLOPs of one prefill chunk of T new tokens on P cached ones, all layers, all ranks together:
    n_layers * linear_flops(T) + each attention layer's span_attention_flops(T, P, NH*DH, its own
    DH) (full layers: all earlier keys; windows and chunks: the keys they see) + each linear-attention
    layer's T * delta_rule_flops_per_token (as one device computes it: the same for every chunk).
    Chunk k of a prompt attends to all k chunks before it, so its cost grows with k: the work a
    progress bar and an ETA count."""
    attention = sum(span_attention_flops(new_tokens, cached_tokens, model.n_heads * model.head_dim_of(layer),
                                         model.attention(layer).span) for layer in model.attention_layers)
    recurrence = sum(new_tokens * delta_rule_flops_per_token(model.linear(layer), over_ranks=False)
                     for layer in model.linear_layers)
    return float(model.n_layers * linear_flops(new_tokens, model, 1) + attention + recurrence)


def prefill_chunk_flops(lengths: "list[int]", chunk_tokens: int, model: ModelConfig,
                        cached_tokens: int = 0) -> list[float]:
    """`chunk_flops` of every chunk of prefills of `lengths` tokens, one after another on a cache
    of `cached_tokens` (each prefill cut into chunks of `chunk_tokens`, the last one shorter)."""
    work, cached = [], cached_tokens
    for n in lengths:
        for start in range(0, n, chunk_tokens):
            t = min(chunk_tokens, n - start)
            work.append(chunk_flops(t, cached, model))
            cached += t
    return work


class WorkProgress:
    """How far a chunked prefill is and how long the rest takes, counted in work, not chunks.

    Work is `chunk_flops` of each chunk (chunk k attends to all before it: on a 2-core CPU the
    first three chunks of a 12,288-token prompt took 29, 48 and 72 s). The seconds left are the
    FLOPs left at the rate the timed chunks ran, the first one left out once a later one is timed
    (it pays for warm-up: kernels built, pages touched). The CLI's progress bar and the server's
    ingest ETA both count this way.
    """

    def __init__(self, chunk_work: "list[float]"):
        if not chunk_work or any(w <= 0 for w in chunk_work):
            raise ValueError(f"every chunk needs positive work, got {chunk_work!r}")
        self.work = list(chunk_work)
        """FLOPs of each chunk, in order."""
        self.seconds: list[float] = []
        """Measured seconds of the chunks done so far."""

    @property
    def total(self) -> float:
        return sum(self.work)

    @property
    def done(self) -> float:
        """FLOPs of the chunks done."""
        return sum(self.work[:len(self.seconds)])

    def chunk_done(self, seconds: float) -> None:
        """Record the next chunk's measured time."""
        if len(self.seconds) == len(self.work):
            raise ValueError(f"all {len(self.work)} chunks are already done")
        self.seconds.append(max(float(seconds), 0.0))

    def seconds_per_flop(self) -> float | None:
        """The measured rate: seconds per FLOP of the timed chunks (the first left out when others
        are timed), or None before any chunk."""
        first = 1 if len(self.seconds) > 1 else 0
        work = sum(self.work[first:len(self.seconds)])
        return sum(self.seconds[first:]) / work if self.seconds else None

    def eta_s(self, since_last_chunk_s: float = 0.0) -> float | None:
        """Seconds until the last chunk is done, `since_last_chunk_s` after the last timed chunk
        ended (that much of the next chunk has run), or None before any chunk has been timed."""
        rate = self.seconds_per_flop()
        return None if rate is None else max(0.0, rate * (self.total - self.done) - since_last_chunk_s)
