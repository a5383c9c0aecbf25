"""Single-device attention math: blocks with LSE, merging, and the float64 reference.

Nothing here talks between ranks (no torch.distributed); ringctx.parallel builds on it.
"""

from .kernels import BACKENDS, attention_block, attention_with_cache, reads_kv_in_place, resolve_backend
from .merge import PartialAccumulator, merge_partials, sanitize_lse
from .reference import band_mask, causal_mask, reference_attention
from .spans import FULL, Band, LayerSoftmax, Run, Span, band_blocks, runs_of

__all__ = [
    "FULL",
    "Band",
    "LayerSoftmax",
    "Run",
    "Span",
    "band_blocks",
    "runs_of",
    "BACKENDS",
    "PartialAccumulator",
    "attention_block",
    "attention_with_cache",
    "band_mask",
    "causal_mask",
    "merge_partials",
    "reads_kv_in_place",
    "reference_attention",
    "resolve_backend",
    "sanitize_lse",
]
