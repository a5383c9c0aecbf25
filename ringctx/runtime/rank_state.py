"""What one process of an engine holds: the settings every rank shares, and this rank's own state.

Rank 0 (the caller's process) and every spawned or torchrun worker hold a `RankState`; the
engine's commands (commands.py) run against it. Nothing here talks to another rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.comm import LOCAL
from .document import Document
from ..planning.engine_config import STRATEGY_CHOICES
from .prefill import PrefillConfig


@dataclass(frozen=True)
class EngineSettings:
    """The settings every rank of one engine runs with (rank 0 sends them to spawned workers once)."""

    model_name: str
    """Preset name, GGUF path or Hugging Face directory (see ringctx.load_model)."""
    dtype: object
    """Weights and activations (None: the model's default)."""
    strategy: str
    """"auto", "pass-kv" or "pass-q" for every prefill chunk."""
    rule: str
    """Decision rule of "auto" (see ringctx.planning)."""
    hardware: object
    """The HardwareProfile that "auto" decides with."""
    chunk_tokens: int | None
    """Tokens per prefill chunk as asked (None: the default for the model and world)."""
    decode_rank: int
    """The first decode CP rank (its TP rank 0 samples and streams)."""
    decode_ranks: int
    """CP ranks that keep the KV cache after a prefill and decode together."""
    kv_dtype: str
    """Storage of the KV cache ("model", a float dtype, "fp8", "int8")."""
    weights: str
    """"model" or "int8" (ringctx.model.int8_weights)."""
    timeout_s: float
    """How long a collective may wait for a rank before the job ends with an error."""
    startup_timeout_s: float
    """How long start-up (processes, imports, model loading, the agreement check) may take."""
    attn_backend: str
    """Backend of the local attention blocks."""
    ranks_per_host: int
    """Ranks on each host (consecutive ranks share a host)."""
    tp_size: int
    """Tensor-parallel ranks per model copy."""
    cp_size: int
    """Context-parallel ranks: world / tp_size."""
    config: dict = field(default_factory=dict)
    """The EngineConfig as it runs ("auto" resolved; `EngineConfig.to_dict`), recorded in saved documents."""
    rope_scaling: str | None = None
    """The RoPE stretch every rank loads the model with ("yarn:4", ...; None: the checkpoint's own)."""
    linear_exchange: str = "auto"
    """How linear-attention layers send their state summaries ("auto", "all-gather", "ring")."""
    ep_size: int = 1
    """Expert-parallel ranks: consecutive CP ranks of one TP index over which every MoE layer's experts
    are spread (ringctx.model.expert_parallel)."""


@dataclass
class RankState:
    """This process's part of an engine: its model, its place in the mesh, its groups and what it holds."""

    settings: EngineSettings
    mode: str
    """"single", "spawn" (rank 0 of spawned workers), "worker" (a spawned rank) or "torchrun"."""
    rank: int
    world_size: int
    mesh: object
    """ringctx.parallel.mesh.Mesh of this rank."""
    model: object
    """The Transformer (this rank's TP shard of it)."""
    chunk_tokens: int
    """Tokens per prefill chunk (resolved)."""
    decode_group: object = LOCAL
    """The decode CP ranks of this rank's TP index (they split the tokens of every document); LOCAL
    in a one-process engine (None would name the default process group, which another engine in
    the same process may have made)."""
    control_group: object = LOCAL
    """Every TP rank of the decode CP ranks (the leader's tokens go to all of them); LOCAL likewise."""
    documents: dict = field(default_factory=dict)
    """Document id -> this rank's Document (rank 0 of a spawned job holds them weakly: see Engine)."""
    prefills: dict = field(default_factory=dict)
    """Prefill id -> the PrefillRun in progress on this rank (commands.PREFILL_*)."""
    saves: dict = field(default_factory=dict)
    """Save id -> the PendingSave whose slice this rank writes in the background (commands.SAVE_*)."""
    answers: dict = field(default_factory=dict)
    """Answer id -> (Document, ShardedDecoder) a following decode rank takes part in (commands.ANSWER_*)."""
    batch: object = None
    """This decode rank's BatchDecoder (runtime/batch.py): the sequences decoded together (commands.BATCH_*)."""
    page_mover: object = None
    """The KVCache.huge_page_steps generator of the document cache being moved into 2 MiB pages
    (commands.MOVE_PAGES), or None."""

    @property
    def is_decode_rank(self) -> bool:
        return self.holds_decode(self.rank)

    def holds_decode(self, rank: int) -> bool:
        """Whether global `rank` is on a decode CP rank (any of its TP ranks)."""
        s = self.settings
        return s.decode_rank <= rank // s.tp_size < s.decode_rank + s.decode_ranks

    @property
    def leader(self) -> int:
        """The global rank that samples and streams answers: TP rank 0 of the first decode CP rank."""
        return self.settings.decode_rank * self.settings.tp_size

    @property
    def decode_index(self) -> int:
        """This rank's place among the decode CP ranks (0 .. decode_ranks - 1)."""
        return self.mesh.cp_rank - self.settings.decode_rank

    def document(self, document_id: int) -> Document:
        document = self.documents.get(document_id)
        if document is None:
            raise ValueError(f"document {document_id} is not held by this engine (dropped, or from another engine)")
        return document

    def prefill_config(self, chunk_tokens=None, strategy=None, decode_room: int = 256, trace: bool = False,
                       ) -> PrefillConfig:
        """A prefill over every CP rank, handed off to the decode ranks."""
        s = self.settings
        config = PrefillConfig(chunk_tokens=chunk_tokens or self.chunk_tokens, strategy=strategy or s.strategy,
                               hardware=s.hardware, rule=s.rule, decode_rank=s.decode_rank,
                               decode_ranks=s.decode_ranks, decode_room=decode_room, kv_dtype=s.kv_dtype,
                               ranks_per_host=s.ranks_per_host // s.tp_size,  # CP ranks per host
                               attn_backend=s.attn_backend, trace=trace, linear_exchange=s.linear_exchange)
        if config.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {config.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
        return config

    def decode_prefill_config(self, kv_dtype: str, decode_room: int) -> PrefillConfig:
        """A prefill over the decode ranks only, on top of a document's slices (a question, an extension)."""
        s = self.settings
        return PrefillConfig(chunk_tokens=self.chunk_tokens, strategy=s.strategy, hardware=s.hardware, rule=s.rule,
                             decode_rank=0, decode_ranks=s.decode_ranks, decode_room=decode_room, kv_dtype=kv_dtype,
                             attn_backend=s.attn_backend, linear_exchange=s.linear_exchange)
