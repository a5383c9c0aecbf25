"""Everything that talks between ranks: sharding layouts, ring communication, ring attention."""

from .comm import CommStats
from .layout import BlockTask, ShardLayout
from .ring import STRATEGIES, ring_attention

__all__ = ["BlockTask", "CommStats", "STRATEGIES", "ShardLayout", "ring_attention"]
