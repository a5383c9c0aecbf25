"""What the Engine's long calls hand back on rank 0: `PrefillJob` (a prefill a chunk at a time),
`Answer` (an answer a token at a time) and `LeaderDecoder`, through which an answer's steps become
commands every decode rank runs (engine/commands.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model.generate import Generation
from . import commands
from .commands import ids_to_bytes
from .document import Document
from .prefill import ChunkStats, PrefillResult

if TYPE_CHECKING:
    from .api import Engine


class PrefillJob:
    """A prefill in progress on rank 0's side (see `Engine.start_prefill`): `step()` runs the next
    chunk on every rank, `finish()` hands the KV cache off and returns the PrefillResult
    (`.document` too, for an ingest); `cancel()` gives it up."""

    def __init__(self, engine: Engine, prefill_id: int, run):
        self.engine, self.id, self.run = engine, prefill_id, run
        self.frame: tuple[str, dict] | None = None  # an ingest's (question suffix, metadata)

    @property
    def done(self) -> bool:
        """Whether every chunk has run."""
        return self.run.done

    @property
    def chunks_done(self) -> int:
        return self.run.next_chunk

    @property
    def total_chunks(self) -> int:
        return self.run.total_chunks

    def step(self) -> ChunkStats:
        """The next chunk, on every rank."""
        return self.engine._run("prefill", commands.PREFILL_CHUNK, self.id)

    def finish(self) -> PrefillResult:
        """The hand-off to the decode ranks, and the result (`result.document` when it was kept)."""
        result = self.engine._run("prefill", commands.PREFILL_FINISH, self.id)
        if result.document is not None:
            if self.frame is not None:
                result.document.question_suffix, result.document.metadata = self.frame
            self.engine._keep(result.document)
        return result

    def cancel(self) -> None:
        """Give up the prefill on every rank (no collective runs; the engine stays usable)."""
        self.engine._run("prefill", commands.PREFILL_CANCEL, self.id)


class LeaderDecoder:
    """The leader's decoder of an answer over a split cache (the interface Generation drives).

    Spawn mode: each call is one command every decode rank runs (commands.ANSWER_*), so that the
    engine can run other commands between two tokens; an answer that ends (read to its end, given
    up, or ended by a newer question) is left by the followers with the next command the engine
    sends, never from here (this may run in a finalizer, where a send could reorder the workers'
    commands). Under torchrun the followers are in `follow` (their own generate): nothing is sent
    and an end releases them at once.
    """

    def __init__(self, engine: Engine, document: Document):
        self.engine, self.document = engine, document
        self.id = engine._new_id()
        self.inner = None  # the ShardedDecoder, once the question's prefill has started
        self._closed = False

    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        self._check_not_closed()
        engine = self.engine
        engine._check_open()
        engine._send(commands.ANSWER_START, (self.id, self.document.id, ids_to_bytes(token_ids)))
        self.inner = commands.answer_decoder(engine.state, self.document)
        return self.inner.prefill(token_ids)

    def step(self, token: int) -> torch.Tensor:
        self._check_not_closed()
        self.engine._check_open()
        self.engine._send(commands.ANSWER_STEP, (self.id,))
        return self.inner.step(token)

    def full(self) -> bool:
        return False

    def close(self) -> None:
        """The answer is over here (idempotent); see the class docstring for when the followers leave it."""
        if self._closed:
            return
        self._closed = True
        if self.inner is None:
            return  # never started: no rank holds anything of it
        if self.engine._followers is not None:
            self.engine._ending.append(self)
        else:
            self.end_here()

    def end_here(self) -> None:
        """The leader's part of the end: release the followers' step, keep the (grown) slice."""
        self.inner.close()
        self.document.cache = self.inner.cache

    def _check_not_closed(self) -> None:
        if self._closed:  # the other ranks have left this answer: a newer question ended it
            raise ValueError("this answer was ended by a newer question on the same engine; read an answer to "
                             "its end before asking the next")


class Answer:
    """The leader's answer to one question: iterate for its text pieces, or call `advance()` for one
    token at a time (what a scheduler does); `.result` (a GenerationResult) once it is complete.
    A lost rank surfaces from either as a RankFailure, as from every Engine method."""

    def __init__(self, engine: Engine, generation: Generation):
        self.engine, self.generation = engine, generation
        self._pieces = engine._guarded(iter(generation), "decode")

    def __iter__(self):
        return self._pieces

    def __next__(self):
        return next(self._pieces)

    def advance(self) -> str | None:
        """One token (the question's prefill first): the text it made final, or None once complete."""
        try:
            return self.generation.advance()
        except BaseException as exc:
            self.engine._raise_failure(exc, "decode")

    def close(self) -> None:
        """Give the answer up (its rows are freed with the next command)."""
        self.generation.close()

    @property
    def done(self) -> bool:
        return self.generation.done

    @property
    def result(self):
        return self.generation.result
