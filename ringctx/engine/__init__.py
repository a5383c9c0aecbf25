"""Rank 0's API: the `Engine` (api.py), the handles its long calls return (handles.py), its worker
processes (workers.py), rank start-up (startup.py) and the step `Scheduler` (scheduler.py).

What every rank runs under it (commands, prefill, hand-off, decode, documents, failures) is
ringctx.runtime; the names re-exported here from there are the ones callers of the Engine meet."""

from ..planning.prefill_plan import default_chunk_tokens
from ..runtime.document import Document
from ..runtime.failures import RankFailure
from ..runtime.prefill import ChunkStats, PrefillConfig, PrefillResult, PrefillStats, cp_prefill
from .api import Engine
from .handles import Answer, PrefillJob
from .startup import auto_nproc, serving_layout, serving_nproc

__all__ = ["Answer", "ChunkStats", "Document", "Engine", "PrefillConfig", "PrefillJob", "PrefillResult", "PrefillStats",
           "RankFailure", "auto_nproc", "cp_prefill", "default_chunk_tokens", "serving_layout",
           "serving_nproc"]
