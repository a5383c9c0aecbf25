"""ringctx: exact context-parallel (ring pass-KV / pass-Q) prefill of very long prompts.

The public API, re-exported from the packages that implement it.
"""

from .attention import attention_block, attention_with_cache, merge_partials, reference_attention
from .config import ModelConfig, get_preset
from .parallel import CommStats, ShardLayout, ring_attention

__version__ = "0.1.0"

__all__ = [
    "CommStats",
    "ModelConfig",
    "ShardLayout",
    "attention_block",
    "attention_with_cache",
    "get_preset",
    "merge_partials",
    "reference_attention",
    "ring_attention",
]
