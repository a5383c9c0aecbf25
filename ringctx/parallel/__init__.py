"""Everything that talks between ranks: sharding layouts, ring communication, ring attention, shared
memory between the ranks of a host and the TP all-reduce."""

from .comm import CommStats
from .layout import BlockTask, ShardLayout
from .ring import STRATEGIES, ring_attention

__all__ = ["BlockTask", "CommStats", "STRATEGIES", "ShardLayout", "ring_attention"]
