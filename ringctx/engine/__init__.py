"""The product: chunked context-parallel prefill, KV hand-off, and the Engine API."""

from ..planning.prefill_plan import default_chunk_tokens
from .api import Engine
from .handles import Answer, PrefillJob
from .startup import auto_nproc, serving_layout, serving_nproc
from ..runtime.document import Document
from ..runtime.failures import RankFailure
from ..runtime.prefill import ChunkStats, PrefillConfig, PrefillResult, PrefillStats, cp_prefill

__all__ = ["Answer", "ChunkStats", "Document", "Engine", "PrefillConfig", "PrefillJob", "PrefillResult", "PrefillStats",
           "RankFailure", "auto_nproc", "cp_prefill", "default_chunk_tokens", "serving_layout",
           "serving_nproc"]
