"""What the Engine's long calls hand back on rank 0: `PrefillJob` (a prefill a chunk at a time),
`SaveJob` (a document saved in the background), `Answer` (an answer a token at a time) and
`LeaderDecoder`, through which an answer's steps become commands every decode rank runs
(runtime/commands.py); `Batch` (sequences decoded together, one step for all: runtime/batch.py)
with its `BatchMember`s, and `ManyAnswers` (Engine.ask_many).

The handles reach the engine through `EnginePort` alone, the few public methods of Engine declared
below: they run commands and never touch the engine's private state, and this module imports
nothing of engine/api.py (which imports it).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from ..model.generate import Generation
from ..runtime import commands
from ..runtime.commands import Command, ids_to_bytes
from ..runtime.document import Document
from ..runtime.prefill import ChunkStats, PrefillResult
from ..runtime.rank_state import RankState


class EnginePort(Protocol):
    """What a handle needs of the Engine that made it (Engine implements it, in its section "the
    port its handles use"). Every call runs on the thread that drives the engine."""

    state: RankState
    """This rank's state (model, mesh, documents)."""

    @property
    def model(self): ...

    @property
    def decode_ranks(self) -> int: ...

    @property
    def is_open(self) -> bool:
        """Whether the engine can still run commands."""

    def check_open(self) -> None:
        """Raise the RankFailure that closed the engine, if one did."""

    def run_command(self, during: str, command: Command, *fields, **local):
        """Send `command` to the ranks concerned and run this rank's part; failures as every Engine method's."""

    def send_command(self, command: Command, fields: tuple) -> None:
        """Only send `command` to the ranks concerned (this rank runs its part itself)."""

    def raise_failure(self, exc: BaseException, during: str):
        """Raise what `exc`, which interrupted `during`, means (a ValueError as it is, else a RankFailure)."""

    def new_id(self) -> int:
        """The next prefill, answer or sequence number (every rank counts alike)."""

    def keep_document(self, document: Document) -> Document:
        """Hold a new document on this rank (the followers drop theirs once the caller lets go of it)."""

    def end_open_answer(self, document: Document | None = None) -> None:
        """End the newest lone answer (of `document`), which holds rows a new sequence takes."""

    def answer_over(self, decoder: LeaderDecoder) -> None:
        """A lone answer is over here: the followers leave it with the next command (or now, alone)."""

    def question_ids(self, document: Document | None, prompt) -> torch.Tensor:
        """A question's token ids as they follow `document`."""

    def check_context(self, new_tokens: int, *, cached_tokens: int = 0, max_new_tokens: int = 0) -> None:
        """Refuse (ContextTooLong) a sequence past the model's trained context, or warn once (allow_long_context)."""

    def batch(self) -> Batch:
        """The engine's one Batch."""


class PrefillJob:
    """A prefill in progress on rank 0's side (see `Engine.start_prefill`): `step()` runs the next
    chunk on every rank (`step(layers=n)` a slice of it), `finish()` hands the KV cache off and
    returns the PrefillResult (`.document` too, for an ingest); `cancel()` gives it up."""

    slices = True
    """`step(layers=n)` runs n layers of a chunk (a Scheduler sizes a slice by it)."""

    def __init__(self, engine: EnginePort, prefill_id: int, run):
        self.engine, self.id, self.run = engine, prefill_id, run
        self.frame: tuple[str, dict] | None = None  # an ingest's (question suffix, metadata)

    @property
    def done(self) -> bool:
        """Whether every chunk has run."""
        return self.run.done

    @property
    def resume(self):
        """How a checkpointed prefill started (runtime/checkpoint.py `ResumePlan`: "fresh", "exact"
        or "reslice", with the chunks and tokens already done; `describe()` says it in a line),
        None without a checkpoint."""
        return getattr(self.run, "resume_plan", None)

    @property
    def chunks_done(self) -> int:
        return self.run.next_chunk

    @property
    def total_chunks(self) -> int:
        return self.run.total_chunks

    @property
    def next_chunk_tokens(self) -> int:
        """New tokens of the chunk the next `step` works on (0 once every chunk has run)."""
        if self.run.done:
            return 0
        start, end = self.run.chunks[self.run.next_chunk]
        return end - start

    @property
    def layer_in_chunk(self) -> int:
        """Layers of the current chunk that `step(layers=...)` has run (0 between two chunks)."""
        return self.run.layer_in_chunk

    def step(self, layers: int | None = None) -> ChunkStats | None:
        """The next chunk, on every rank; with `layers`, only its next `layers` layers (None until
        the chunk's last layer has run; the same bits as the chunk run whole)."""
        if layers is not None and layers < 1:
            raise ValueError(f"a prefill slice runs at least one layer, got layers={layers}")
        return self.engine.run_command("prefill", commands.PREFILL_CHUNK, self.id, layers or 0)

    def finish(self) -> PrefillResult:
        """The hand-off to the decode ranks, and the result (`result.document` when it was kept)."""
        result = self.engine.run_command("prefill", commands.PREFILL_FINISH, self.id)
        if result.document is not None:
            if self.frame is not None:
                result.document.question_suffix, result.document.metadata = self.frame
            self.engine.keep_document(result.document)
        return result

    def cancel(self) -> None:
        """Give up the prefill on every rank (no collective runs; the engine stays usable)."""
        self.engine.run_command("prefill", commands.PREFILL_CANCEL, self.id)


class ExtendJob:
    """`Engine.extend` a chunk at a time (see `Engine.start_extend`), with PrefillJob's interface for
    a Scheduler: `step()` extends the document by the next chunk over the decode ranks (whole: a
    slice's `layers` are not split), `finish()` returns an object whose `.document` is it."""

    slices = False
    """Every `step` runs a whole chunk (an extension is not split by layer)."""

    def __init__(self, engine: EnginePort, document: Document, token_ids: torch.Tensor, chunk_tokens: int,
                 decode_room: int):
        self.engine, self.document, self.decode_room = engine, document, decode_room
        self.chunks = list(token_ids.split(chunk_tokens))
        self.frame = None
        self.layer_in_chunk = 0  # a chunk runs whole

    @property
    def done(self) -> bool:
        return not self.chunks

    @property
    def next_chunk_tokens(self) -> int:
        return int(self.chunks[0].numel()) if self.chunks else 0

    def step(self, layers: int | None = None) -> ChunkStats:
        """The next chunk on top of the document (its last ChunkStats)."""
        chunk = self.chunks.pop(0)
        room = self.decode_room + sum(int(c.numel()) for c in self.chunks)  # what is still to come fits
        stats = self.engine.run_command("extend", commands.EXTEND, self.document.id, ids_to_bytes(chunk), room,
                                        document=self.document)
        return stats.chunks[-1]

    def finish(self):
        return _Extended(self.document)

    def cancel(self) -> None:
        self.chunks = []


class _Extended:
    """What ExtendJob.finish gives a Scheduler's on_done (as a PrefillResult's `.document`)."""

    def __init__(self, document: Document):
        self.document = document


class SaveJob:
    """A document being saved in the background (see `Engine.start_save`): `written` says whether
    this rank's slice is on disk (every decode rank writes about as much, at once), `finish()`
    completes the document on every decode rank (a short collective once the slices are written)."""

    def __init__(self, engine: EnginePort, save_id: int, pending):
        self.engine, self.id, self.pending = engine, save_id, pending

    @property
    def written(self) -> bool:
        return self.pending.written

    def wait_written(self, timeout: float | None = None) -> bool:
        """Block until this rank's slice is on disk (or timeout); whether it is."""
        return self.pending.wait_written(timeout)

    def finish(self) -> None:
        self.engine.run_command("save", commands.SAVE_FINISH, self.id)


class LeaderDecoder:
    """The leader's decoder of an answer over a split cache (the interface Generation drives).

    Spawn mode: each call is one command every decode rank runs (commands.ANSWER_*), so that the
    engine can run other commands between two tokens; an answer that ends (read to its end, given
    up, or ended by a newer question) is left by the followers with the next command the engine
    sends, never from here (this may run in a finalizer, where a send could reorder the workers'
    commands). Under torchrun the followers are in `follow` (their own generate): nothing is sent
    and an end releases them at once.
    """

    def __init__(self, engine: EnginePort, document: Document, max_new_tokens: int):
        self.engine, self.document = engine, document
        self.room = commands.answer_room(max_new_tokens, engine.decode_ranks)
        self.id = engine.new_id()
        self.inner = None  # the ShardedDecoder, once the question's prefill has started
        self._closed = False

    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        self._check_not_closed()
        engine = self.engine
        engine.check_open()
        engine.send_command(commands.ANSWER_START, (self.id, self.document.id, ids_to_bytes(token_ids), self.room))
        self.inner = commands.answer_decoder(engine.state, self.document, self.room)
        return self.inner.prefill(token_ids)

    def step(self, token: int) -> torch.Tensor:
        self._check_not_closed()
        self.engine.check_open()
        self.engine.send_command(commands.ANSWER_STEP, (self.id,))
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
        self.engine.answer_over(self)

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

    def __init__(self, engine: EnginePort, generation: Generation):
        self.engine, self.generation = engine, generation
        self._pieces = self._guarded(iter(generation))

    def _guarded(self, pieces):
        """The generation's pieces, a failure raised as from every Engine method."""
        try:
            yield from pieces
        except BaseException as exc:
            self.engine.raise_failure(exc, "decode")

    def __iter__(self):
        return self._pieces

    def __next__(self):
        return next(self._pieces)

    def advance(self) -> str | None:
        """One token (the question's prefill first): the text it made final, or None once complete."""
        try:
            return self.generation.advance()
        except BaseException as exc:
            self.engine.raise_failure(exc, "decode")

    def close(self) -> None:
        """Give the answer up (its rows are freed with the next command)."""
        self.generation.close()

    @property
    def done(self) -> bool:
        return self.generation.done

    @property
    def result(self):
        return self.generation.result


# ------------------------------------------------------------------------------------------ batches
class BatchMember:
    """One sequence of a `Batch` on rank 0: its Generation (sampling, stop strings, max tokens)."""

    def __init__(self, batch: "Batch", sequence_id: int, document: Document | None, generation: Generation,
                 reserved_rows: int):
        self.batch, self.id, self.document, self.generation = batch, sequence_id, document, generation
        self.reserved_rows = reserved_rows
        """Rows it may hold at most (question + max_new_tokens): what a scheduler budgets."""
        self.first_piece: str | None = None
        """The text its first token (sampled at join) made final."""
        self.left = False
        self.keep = None
        """What becomes of its rows once it completes: None, freed; "copy", kept as a new document
        (its document's rows, its question's and its answer's); "extend", added to its document (a
        document no other member reads; else as "copy"); "own", its own rows alone as a new
        document (Engine.join_documents puts it after its document when needed); or a function of
        the member giving one of these when it completes. A cancelled member's rows are freed."""
        self.kept: Document | None = None
        """The document its rows became (after it left, with `keep`), or None."""

    @property
    def done(self) -> bool:
        return self.generation.done

    @property
    def result(self):
        """The GenerationResult once complete (None before, or when it was cancelled)."""
        return self.generation.result


class _MemberDecoder:
    """The decoder of a member's Generation, which never drives it: the question's prefill is the
    member's JOIN, run by Batch.join, and its steps come from Batch.step, which feeds every member's
    token at once (the Generation only samples and detokenizes: `accept_first`, `accept`)."""

    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a batch member's question is prefilled by its join, in Batch.join")

    def step(self, token: int) -> torch.Tensor:
        raise RuntimeError("a batch member's steps run in Batch.step, for every member at once")

    def full(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Batch:
    """Rank 0's handle of the sequences an engine decodes together (see the module docstring).

        batch = engine.batch()
        a = batch.join(document, "Who signed it?", max_new_tokens=64)   # prefill + first token
        b = batch.join(document, "When?", temperature=0.7, seed=1)
        while batch.members:
            for member, piece in batch.step():                         # one step for all
                ...   # piece: text that became final; None: the member is complete and has left

    `engine` is the Engine (its `run_command` sends each command to the decode ranks and runs this
    rank's part). One Batch per engine: every decode rank holds one BatchDecoder.
    """

    def __init__(self, engine: EnginePort):
        self.engine = engine
        self.members: list[BatchMember] = []
        self.steps = 0
        self.last_step_s = 0.0

    def join(self, document: Document | None, prompt, *, max_new_tokens: int = 256, keep: str | None = None,
             **sampling) -> BatchMember:
        """Add a sequence: its question's prefill and first token now (`first_piece`); it then
        advances with every `step`. prompt: question text (in the document's chat frame) or token ids;
        keep: what becomes of its rows when it completes (BatchMember.keep)."""
        if keep not in KEEP_MODES and not callable(keep):
            raise ValueError(f"keep must be one of {KEEP_MODES} or a function of the member, got {keep!r}")
        engine = self.engine
        ids = engine.question_ids(document, prompt)
        if ids.numel() == 0:
            raise ValueError("the question is empty: ask something")
        engine.check_context(ids.numel(), cached_tokens=document.length if document else 0, max_new_tokens=max_new_tokens)
        sequence_id = engine.new_id()
        generation = Generation(engine.model, ids, max_new_tokens=max_new_tokens, decoder=_MemberDecoder(),
                                **sampling)
        member = BatchMember(self, sequence_id, document, generation, int(ids.numel()) + max_new_tokens)
        member.keep = keep
        started = time.perf_counter()
        logits = self._join(sequence_id, document, generation.prompt_ids)  # a ValueError leaves nothing behind
        member.first_piece = generation.accept_first(logits, started)
        self.members.append(member)
        return member

    def step(self) -> list[tuple[BatchMember, str | None]]:
        """One decode step for every member: [(member, text that became final)], and
        (member, None) for each member that completed (it has left the batch, rows freed)."""
        events: list[tuple[BatchMember, str | None]] = []
        feeding: list[tuple[BatchMember, int]] = []
        for member in list(self.members):
            token = member.generation.next_input()
            if token is not None:
                feeding.append((member, token))
                continue
            while (piece := member.generation.advance()) is not None:  # its held-back text, then the end
                events.append((member, piece))
            self.leave(member)
            events.append((member, None))
        if feeding:
            t0 = time.perf_counter()
            logits = self.engine.run_command("decode", commands.BATCH_STEP, _ints([m.id for m, _ in feeding]),
                                             _ints([t for _, t in feeding]))
            self.last_step_s = seconds = time.perf_counter() - t0
            self.steps += 1
            for i, (member, _) in enumerate(feeding):
                events.append((member, member.generation.accept(logits[i], seconds)))
        return events

    def leave(self, member: BatchMember) -> None:
        """Take a member out now (complete or cancelled): every decode rank frees its rows."""
        if member.left:
            return
        member.left = True
        if member in self.members:
            self.members.remove(member)
        member.generation.close()
        mode = member.keep(member) if callable(member.keep) and member.result is not None else member.keep
        if mode is not None and member.result is not None:
            try:
                member.kept = self._keep(member, mode)
            except ValueError:  # its rows could not be kept (checked alike on every rank): they are freed
                member.kept = None
        self.engine.run_command("decode", commands.BATCH_LEAVE, member.id)

    def _keep(self, member: BatchMember, mode: str) -> Document:
        """BATCH_KEEP on every decode rank: the member's rows as a document (see BatchMember.keep)."""
        engine = self.engine
        generated = member.result.token_ids
        fed = torch.cat([member.generation.prompt_ids.cpu(),
                         torch.tensor(generated[:max(0, len(generated) - 1)], dtype=torch.long)])
        shared = member.document is None or any(m.document is member.document for m in self.members)
        if mode not in KEEP_MODES:
            raise ValueError(f"keep must be one of {KEEP_MODES}, got {mode!r}")
        new_id = engine.new_id() if mode != "extend" or shared else -1
        document = engine.run_command("decode", commands.BATCH_KEEP, member.id, _ints(fed.tolist()), new_id,
                                      KEPT_ROOM_ROWS, mode == "own")
        return document if new_id < 0 else engine.keep_document(document)

    @property
    def rows_reserved(self) -> int:
        """Rows the members may hold at most together (their questions plus max_new_tokens)."""
        return sum(m.reserved_rows for m in self.members)

    def _join(self, sequence_id: int, document: Document | None, token_ids: torch.Tensor) -> torch.Tensor:
        """The JOIN on every decode rank: the question's prefill on top of the document's rows; the
        float32 logits [vocab] of its last token (on the leader)."""
        engine = self.engine
        if document is not None:
            engine.end_open_answer(document)  # a lone answer's rows sit where the question's go for a moment
        return engine.run_command("decode", commands.BATCH_JOIN, sequence_id, -1 if document is None else document.id,
                                  _ints(token_ids.tolist()), document=document)


KEEP_MODES = (None, "copy", "extend", "own")
"""What a batch member's rows may become when it completes (BatchMember.keep)."""

KEPT_ROOM_ROWS = 256
"""Rows a kept sequence's document keeps free on each decode rank for the next question's prefill."""


def _ints(values) -> bytes:
    return torch.tensor(list(values), dtype=torch.long).numpy().tobytes()


class ManyAnswers:
    """Engine.ask_many's answers: iterate for (question index, text piece); `results` after."""

    def __init__(self, engine: EnginePort, document, questions: list, max_batch: int, kwargs: dict):
        self.engine, self.document, self.questions, self.max_batch, self.kwargs = (
            engine, document, questions, max_batch, kwargs)
        self.results: list = [None] * len(questions)

    def __iter__(self):
        batch = self.engine.batch()
        index: dict[int, int] = {}  # member id -> question index
        waiting = list(range(len(self.questions)))
        mine: list[BatchMember] = []
        try:
            while waiting or mine:
                while waiting and len(mine) < self.max_batch:  # joins between two steps
                    i = waiting.pop(0)
                    member = batch.join(self.document, self.questions[i], **self.kwargs)
                    index[member.id] = i
                    mine.append(member)
                    if member.first_piece:
                        yield i, member.first_piece
                for member, piece in batch.step():
                    if member.id not in index:
                        continue  # another caller's member of the same batch
                    if piece is None:
                        self.results[index[member.id]] = member.result
                        mine.remove(member)
                    elif piece:
                        yield index[member.id], piece
        finally:  # stopped early: the rest leave the batch, freeing their rows (unless a lost rank closed it)
            if self.engine.is_open:
                for member in mine:
                    batch.leave(member)
