"""ringctx: exact context-parallel (ring pass-KV / pass-Q) prefill of very long prompts.

The public API, re-exported from the packages that implement it:

    Engine, Document                        chunked CP prefill, KV hand-off, questions (ringctx.engine)
    EngineConfig                            every setting of an Engine, its default and meaning
    load_model, KVCache                     the Llama-family decoder and its decode cache (ringctx.model)
    ContextTooLong                          a sequence past the model's trained context (ringctx.model.context)
    ring_attention, ShardLayout, CommStats  ring pass-KV / pass-Q over torch.distributed (ringctx.parallel)
    choose_strategy, plan_prefill, load_profile   the heuristic, the cost model, hardware profiles
    attention_block, attention_with_cache, merge_partials, reference_attention   single-device math
"""

from .version import __version__

from .attention import attention_block, attention_with_cache, merge_partials, reference_attention
from .model.config import ModelConfig
from .model.context import ContextTooLong
from .model.presets import get_preset
from .engine import Document, Engine, PrefillResult, PrefillStats, RankFailure
from .model import KVCache, load_model
from .parallel import CommStats, ShardLayout, ring_attention
from .planning.engine_config import EngineConfig
from .planning.hardware import HardwareProfile, load_profile
from .planning.prefill_plan import plan_prefill
from .planning.strategy import choose_strategy

__all__ = [
    "CommStats", "ContextTooLong", "Document", "Engine", "EngineConfig", "HardwareProfile", "KVCache", "ModelConfig", "PrefillResult", "PrefillStats",
    "RankFailure", "ShardLayout", "attention_block", "attention_with_cache", "choose_strategy", "get_preset", "load_model",
    "load_profile", "merge_partials", "plan_prefill", "reference_attention", "ring_attention",
]
