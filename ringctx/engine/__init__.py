"""The product: chunked context-parallel prefill, KV hand-off, and the Engine API."""

from .api import Document, Engine, auto_nproc, default_chunk_tokens
from .failures import RankFailure
from .prefill import ChunkStats, PrefillConfig, PrefillResult, PrefillStats, cp_prefill

__all__ = ["ChunkStats", "Document", "Engine", "PrefillConfig", "PrefillResult", "PrefillStats", "RankFailure", "cp_prefill",
           "auto_nproc", "default_chunk_tokens"]
