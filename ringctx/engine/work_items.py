"""The work a `Scheduler` (scheduler.py) runs on its thread, as data: what to run, never how.

    Question        a question for the batch: its prompt after a document (or a prompt of its own),
                    joined when the step's budget allows, then one token per step
    LoneAnswer      an answer run alone (Engine.generate), one token per turn
    Prefill         a prefill (an ingest when kept as a document), a chunk or a slice per step
    DropDocument    free a document's KV cache on every decode rank, between two steps
    FinishSave      complete a background save once its slices are written, between two steps

A caller (ringctx serve, a script, a test) builds these and submits them; the scheduler turns each
into Engine calls on its own thread. A question whose document must first be brought into memory
(a server's documents leave memory when its KV budget is spent) names a `DocumentSource`, which
the scheduler asks for the document when the question joins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..runtime.document import Document


class DocumentSource(Protocol):
    """Where a question's document comes from when it joins, on the scheduler's thread (with the
    engine to itself): a server's store loads a saved document back into memory, a prompt of its own
    is ingested as a document of its own. ValueError: the question fails alone."""

    def document(self, engine) -> Document:
        """The Engine's Document the question's prompt follows."""


@dataclass
class Question:
    """A question for the batch (Engine.batch): `prompt` (text in the document's frame, or token
    ids) after `document`, or after what `source` gives when it joins, or after nothing (both
    None: a prompt of its own, prefilled whole at the join)."""

    prompt: Any
    prompt_tokens: int
    """Tokens its prefill takes from the step's budget (the prompt's, and a source's it ingests)."""
    sampling: dict = field(default_factory=dict)
    """Batch.join's keywords: max_new_tokens, temperature, top_k, top_p, seed, stop."""
    document: Document | None = None
    source: DocumentSource | None = None
    keep: Any = None
    """What becomes of its rows once it completes (BatchMember.keep): None, "copy", "extend", or a
    function of the BatchMember giving one of them when it leaves."""
    on_leave: Callable[[Any], None] | None = None
    """Called on the scheduler's thread with its BatchMember once it has left (its `kept` set),
    before its Done: a prefix cache keeps what it left behind."""

    @property
    def rows(self) -> int:
        """KV rows it may hold at most: its prompt and every token it may generate."""
        return self.prompt_tokens + int(self.sampling.get("max_new_tokens", 256))


@dataclass
class LoneAnswer:
    """An answer decoded alone: `Engine.generate(document, prompt, **sampling)`, a token per turn."""

    document: Document
    prompt: Any
    sampling: dict = field(default_factory=dict)


@dataclass
class Prefill:
    """`Engine.start_prefill(token_ids, ...)` run a chunk (or a slice of one) per step; with
    `frame` (an ingest's question suffix and metadata, see Engine.start_ingest) the document it keeps
    is framed for questions."""

    token_ids: Any
    as_document: bool = False
    drop_unseen: bool = False
    """With as_document: its windowed and chunked layers keep only what later tokens see (Engine.prefill)."""
    chunk_tokens: int | None = None
    decode_room: int = 256
    frame: tuple[str, dict] | None = None
    on_top: Callable[[Any], Document] | None = None
    """Given: token_ids extend the Document it gives (called with the engine on the scheduler's
    thread; one no question reads) a chunk per step (Engine.start_extend), instead of a prefill
    over every rank: a long prompt after a cached prefix."""
    checkpoint: str | None = None
    """A directory where the prefill keeps its checkpoint and from which it resumes (Engine.prefill's
    `checkpoint`); it stays after the prefill (the caller removes it once the document is saved)."""
    checkpoint_extra: dict | None = None
    """What the checkpoint keeps with the tokens (a document's chat frame), for whoever resumes it."""
    on_resume: Callable[[Any], None] | None = None
    """Called with the PrefillJob on the scheduler's thread when it started from its checkpoint's chunks."""


@dataclass
class DropDocument:
    """Engine.drop_document(document), between two steps."""

    document: Document


@dataclass
class FinishSave:
    """A background save's completion (SaveJob.finish: a short collective of the decode ranks),
    between two steps; a ValueError (a full disk, say) is raised to the caller."""

    job: Any


EngineCall = DropDocument | FinishSave
"""The calls a caller may ask the scheduler to run between two steps (Scheduler.run)."""

