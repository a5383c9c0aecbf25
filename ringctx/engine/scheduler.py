"""A step-level scheduler over an Engine: one thread runs the engine's work a step at a time.

    submit_question(Question) / submit_prefill(Prefill) / submit_answer(LoneAnswer)
                                from any thread: returns a ticket at once (the work items are
                                engine/work_items.py's dataclasses)
    run(DropDocument | FinishSave) / call(fn)
                                from any thread: waits for it to run between two steps
    the scheduler's thread, each turn (a step):
        calls (save, load, drop)   run between two steps, in the order they came
        questions (the batch)      cancelled ones leave at once (their rows freed); waiting ones
                                   join while the batch has room (max_batch), the rows they may
                                   take fit (max_rows), their prompt fits the step's token budget
                                   and, while others decode, their prefills fit `join_share`
                                   decode steps (at least one joins); then ONE decode step for
                                   every running question
                                   (Engine.batch: each document's rows read once for all its
                                   questions); finished ones leave
        a prefill (an ingest)      a slice of it in every step: whole layers of its current chunk,
                                   while questions decode as many as fit `ingest_share` times the
                                   batch's decode step, when none decodes as many as fit
                                   `idle_slice_s` (IDLE_SLICE_S); at least one layer either way
        a lone answer              (submit_answer: Engine.generate's Answer) one token per turn,
                                   one at a time, when no question is in the batch; an ingest gets
                                   a slice beside it as beside the batch

The step's token budget (`max_step_tokens`, like vLLM's max_num_batched_tokens) counts one token
for each running question plus every prompt token of the questions joining (and of an ingest's
chunk when no question decodes). A running answer waits between two tokens for exactly one step,
so the budget bounds the questions' prefill work placed between two of its tokens: a burst of new
questions joins over several steps. Default (`default_step_tokens`): one prefill chunk of the
engine plus one token per sequence of a full batch. A prompt longer than the whole budget joins
alone, in a step that prefills nothing else (it is never stuck).

Tokens do not measure a join's time, though: a question's prefill over a long document reads the
whole document in every layer (a 20-token question over 8K tokens took ~90 ms on 2 CPU cores, four
decode steps), so while questions decode the joins of one step are also bounded by time: they
take about `join_share` times the batch's last decode step, by the slowest recent join, at least
one. A burst of questions then joins one or two per step, and the answers in flight wait one join
between two tokens instead of all of them. With no question decoding, every waiting question that
fits the budget joins at once (nothing is paused by them).

An ingest beside running answers is bounded by time instead: each step runs the next layers of
its current chunk (PrefillJob.step(layers=n), the same bits as the chunk run whole), n sized from
the time its recent slices took per layer so that the slice takes about `ingest_share` times the
batch's decode step (the median of the last RECENT_DECODE_STEPS; at least one layer). With the
default 1.0 an answer's inter-token time stays near twice its time without the ingest, and the
ingest gets about half the machine; the longest pause is one layer of one chunk, which the chunk
size sets.

With nothing decoding an ingest still never runs a long step: each step runs the layers of its
chunk that take about `idle_slice_s` (IDLE_SLICE_S, by the same per-layer time; at least one
layer), so a question that arrives mid-chunk joins after the current slice, not after the rest of
the chunk, and then the slices beside it are sized by `ingest_share`. Back to back the slices cost
what the chunk run whole costs (see IDLE_SLICE_S), and a chunk run in slices gives the bits of the
chunk run whole, so the chunk size (`ringctx serve` ingests in the engine's default chunk, the
fastest) and the moments questions arrive never change a document's bits.

`max_rows` bounds the KV rows the running questions may hold together (each counts its prompt
plus its max_new_tokens): when they run out, questions wait in the queue rather than run out of
memory (a question alone always runs).

The Engine is not thread-safe: only the scheduler's thread touches it once the scheduler runs.
Tickets are how other threads see the work: an AnswerTicket is an iterator of events (text
pieces, then the result), a PrefillTicket reports each chunk and the result.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..runtime.failures import RankFailure
from .work_items import DropDocument, EngineCall, FinishSave, LoneAnswer, Prefill, Question

IDLE_SLICE_S = 0.05
"""Seconds of an ingest's slice while no question decodes (at least one layer of its chunk): about
the longest a question that arrives then waits before it joins. A step between two slices costs
one command to every rank, and the slices back to back cost what the chunk run whole costs (8,000
tokens in 4,096-token chunks of SmolLM2, a layer per slice: 55.2 and 55.7 s against 54.5 and 56.7 s
whole; docs/BENCHMARKS.md, "Documents in the engine's chunk"). One layer is the floor: a layer of a
4,096-token chunk over an 8K prefix took 48-88 ms on a 2-core Xeon with AMX and ~0.4 s on a 2-core
AMD EPYC without it, so on CPUs such a slice is one layer."""


class SchedulerStopped(RuntimeError):
    """The scheduler has stopped (closed, or a rank was lost: `reason` says which)."""


@dataclass
class Text:
    """Answer text that became final."""

    text: str


@dataclass
class Done:
    """The end of an answer: the engine's GenerationResult (None when it was cancelled)."""

    result: Any


class AnswerTicket:
    """An answer in the scheduler: iterate it (from any thread) for Text events then one Done, or
    `async for` over it on an event loop; `cancel()` ends it at the next step. Errors (bad input, a
    lost rank) are raised from the iterator."""

    def __init__(self, work: LoneAnswer | Question):
        self.work = work
        self.answer = None  # the Engine's Answer once it has started (a lone answer)
        self.cancelled = False
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._events: queue.Queue = queue.Queue()
        self._wake: Callable[[], None] | None = None  # an async consumer's: an event was put

    def cancel(self) -> None:
        self.cancelled = True

    def __iter__(self):
        while True:
            event = self._events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Done):
                return

    async def __aiter__(self):
        """The same events on an event loop, each awaited without a thread of its own: the
        scheduler wakes the loop when it puts one. (Read from a worker thread instead, every
        streamed answer held one of the server's worker threads while it waited for its next token;
        past the pool's 40, every other request's backend call waited for a stream to end.)"""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(arrived.set)
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                await arrived.wait()
                arrived.clear()  # then look again: an event put after this line sets it anew
                continue
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Done):
                return

    def _put(self, event) -> None:
        self._events.put(event)
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except RuntimeError:  # the consumer's loop has closed: nobody is waiting
                self._wake = None


class QuestionTicket(AnswerTicket):
    """A question in the scheduler (a `Question`): it joins the batch when the step's budget allows."""

    def __init__(self, question: Question):
        super().__init__(question)
        self.prompt_tokens, self.rows = question.prompt_tokens, question.rows
        self.member = None  # the engine's BatchMember once it has joined
        self.prefill: PrefillTicket | None = None  # what runs before it queues (submit_question_after)

    def cancel(self) -> None:
        self.cancelled = True
        if self.prefill is not None:
            self.prefill.cancel()


class PrefillTicket:
    """A prefill in the scheduler. `on_chunk(job, chunk_stats)` runs on the scheduler's thread after
    each chunk and `on_done(result)` after the hand-off (it may use the engine: it is on that thread);
    `wait()` returns the PrefillResult (or raises its error); `cancel()` gives it up."""

    def __init__(self, work: Prefill, on_chunk=None, on_done=None, on_error=None):
        self.work = work
        self.on_chunk, self.on_done, self.on_error = on_chunk, on_done, on_error
        self.job = None  # the Engine's PrefillJob once it has started
        self.cancelled = False
        self.layer_s: float | None = None  # seconds per layer of its recent steps (slices are sized by it)
        self._done = threading.Event()
        self._result = self._error = None

    def cancel(self) -> None:
        self.cancelled = True

    def wait(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError("the prefill has not finished")
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()
        if error is not None and self.on_error is not None:
            self.on_error(error)


class _Call:
    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None


class Scheduler:
    """Runs an Engine's prefills, answers and other calls on one thread, a step at a time.

    Args:
        engine: the Engine (rank 0's), or a function that builds it (and nothing else), which the
            scheduler then calls on its own thread. Only this scheduler's thread uses the engine
            from now on. Prefer the function: OpenMP keeps a team of threads per thread that runs a
            parallel region, and with two teams on a machine's cores GNU OpenMP stops spinning
            between regions, which cost a decode step 35% at 8K tokens on 2 cores (built on the
            calling thread: 64-65 ms against 47-48 ms, docs/BENCHMARKS.md).
        on_failure: called once (on the scheduler's thread) with the RankFailure that ended it.
        max_batch: questions decoded together at most (the others wait).
        max_step_tokens: tokens one step may run: one per running question plus the prompts it
            prefills (see the module docstring; None: `default_step_tokens`).
        max_rows: KV rows the running questions may hold together (None: no bound).
        ingest_share: while questions decode, the time of each step's prefill slice as a multiple of
            the batch's decode step (see the module docstring).
        join_share: while questions decode, the time of the questions joining in one step as a
            multiple of the batch's decode step (at least one joins; see the module docstring).
        idle_slice_s: while no question decodes, the seconds of each step's prefill slice (at
            least one layer; see IDLE_SLICE_S).
    """

    def __init__(self, engine, *, on_failure: Callable[[BaseException], None] = None,
                 max_batch: int = 16, max_step_tokens: int | None = None, max_rows: int | None = None,
                 ingest_share: float = 1.0, join_share: float = 1.0, idle_slice_s: float = IDLE_SLICE_S):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_step_tokens is not None and max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if not ingest_share > 0:
            raise ValueError(f"ingest_share must be > 0, got {ingest_share}")
        if not join_share > 0:
            raise ValueError(f"join_share must be > 0, got {join_share}")
        if not idle_slice_s > 0:
            raise ValueError(f"idle_slice_s must be > 0, got {idle_slice_s}")
        self.ingest_share, self.join_share, self.idle_slice_s = ingest_share, join_share, idle_slice_s
        self.join_s: float | None = None  # seconds of the slowest recent join (what the time bound counts)
        self.last_step_joins = 0  # questions that joined in the last step
        self.joins_held = 0  # steps where a question that fit the token budget waited for the time bound
        self.last_slice_layers = 0  # layers of an ingest's chunk that the last step ran beside the batch
        self.prefill_steps = 0  # steps that ran layers of a prefill (a slice or a whole chunk)
        self.prefill_chunks = 0  # chunks of prefills that ran to their last layer
        # the decode steps an ingest's slices are sized by: the median of the last few, so that one
        # slow step (a page fault, another process) does not size a long slice after it
        self._recent_decode_s: collections.deque = collections.deque(maxlen=RECENT_DECODE_STEPS)
        # idle work: the decode ranks' document caches written in small pages, moved into 2 MiB
        # pages a page per idle turn (faster decode steps; see Engine.move_document_pages)
        self._tidy = False  # there may be such a cache (set after each turn)
        self.on_failure = on_failure
        self.max_batch, self.max_rows = max_batch, max_rows
        self.questions: collections.deque[QuestionTicket] = collections.deque()
        self.batched: list[QuestionTicket] = []  # joined, decoding together
        self.last_step_tokens = 0  # tokens the last step ran (decode, prompts, a whole chunk): what the budget bounds
        self.steps = 0  # decode steps of the batch, the tokens they decoded (their mean batch: the ratio)
        self.decoded_tokens = 0
        self.decode_seconds = 0.0  # and the seconds they took (the mean step, beside the inter-token time)
        self.answers: collections.deque[AnswerTicket] = collections.deque()
        self._waiting_prefill = 0  # questions whose prompt is prefilled before they queue
        self.prefills: collections.deque[PrefillTicket] = collections.deque()
        self.calls: collections.deque[_Call] = collections.deque()
        self.running: AnswerTicket | None = None
        self.stopped: str | None = None
        self._wake = threading.Condition()
        self._built, self._go = threading.Event(), threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine,), name="ringctx-scheduler", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.max_step_tokens = max_step_tokens or default_step_tokens(self.engine, max_batch)
        self._go.set()

    # ------------------------------------------------------------------ from any thread
    def submit_answer(self, answer: LoneAnswer) -> AnswerTicket:
        """Queue an answer decoded alone (Engine.generate), a token per turn."""
        return self._submit(self.answers, AnswerTicket(answer))

    def submit_question(self, question: Question) -> QuestionTicket:
        """Queue a question for the batch."""
        return self._submit(self.questions, QuestionTicket(question))

    def submit_prefill(self, prefill: Prefill, on_chunk=None, on_done=None, on_error=None) -> PrefillTicket:
        """Queue a prefill. `on_chunk(job, chunk_stats)`, `on_done(result)` and `on_error(error)` are
        called on the scheduler's thread (see PrefillTicket)."""
        return self._submit(self.prefills, PrefillTicket(prefill, on_chunk, on_done, on_error))

    def submit_question_after(self, prefill: Prefill, question: Question,
                              ready: Callable[[Any], Any], on_chunk=None) -> QuestionTicket:
        """Queue a question whose document is prefilled first (a long prompt of its own): `prefill`
        runs a slice per step beside the answers in flight, as an ingest does; when it is done,
        `ready(result)` (on the scheduler's thread) gives the Document the question then asks, and
        it joins the queue. Its ticket's cancel() cancels the prefill too; the prefill's error ends it."""
        ticket = QuestionTicket(question)

        def done(result):
            question.document, question.source = ready(result), None
            with self._wake:
                self._waiting_prefill -= 1
                if self.stopped is None:
                    self.questions.append(ticket)
                    return
            ticket._put(SchedulerStopped(self.stopped))

        def failed(error):
            with self._wake:
                self._waiting_prefill -= 1
            ticket._put(error)

        with self._wake:
            self._waiting_prefill += 1
        try:
            ticket.prefill = self._submit(self.prefills, PrefillTicket(prefill, on_chunk, done, failed))
        except SchedulerStopped:
            with self._wake:
                self._waiting_prefill -= 1
            raise
        return ticket

    def run(self, work: EngineCall, timeout: float | None = None):
        """Run a DropDocument or FinishSave between two steps; wait for it and return what it returns (or raise)."""
        if not isinstance(work, (DropDocument, FinishSave)):
            raise TypeError(f"the scheduler runs a DropDocument or a FinishSave between two steps, not {work!r}")
        if threading.current_thread() is self._thread:  # a notification (on_done) asking: it is that thread
            return self._engine_call(work)
        return self.call(lambda: self._engine_call(work), timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = None):
        """Run fn() on the scheduler's thread between two steps and return what it returns (or raise):
        for tests and scripts that look at the engine between two steps (ringctx serve submits
        work items only)."""
        call = self._submit(self.calls, _Call(fn))
        if not call.done.wait(timeout):
            raise TimeoutError("the engine did not get to this call in time")
        if call.error is not None:
            raise call.error
        return call.result

    @property
    def queued_answers(self) -> int:
        """Answers and questions waiting for their turn (those whose prompt is prefilled first included)."""
        return len(self.answers) + len(self.questions) + self._waiting_prefill

    @property
    def rows_reserved(self) -> int:
        """KV rows the running questions may hold together (their prompts and max_new_tokens)."""
        return sum(t.rows for t in self.batched)

    def stop(self, reason: str = "the server is stopping") -> None:
        """Stop after the current step; everything still queued ends with SchedulerStopped."""
        with self._wake:
            if self.stopped is None:
                self.stopped = reason
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def idle(self) -> bool:
        return (self.running is None and not self.answers and not self.prefills and not self.calls
                and not self.questions and not self.batched)

    def _submit(self, where: collections.deque, item):
        with self._wake:
            if self.stopped is not None:
                raise SchedulerStopped(self.stopped)
            where.append(item)
            self._wake.notify()
        return item

    # ------------------------------------------------------------------ the scheduler's thread
    def _run(self, engine) -> None:
        """Build the engine here when given a function (see the class's Args), then run the loop."""
        try:
            self.engine = engine() if callable(engine) else engine
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._go.wait()
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self.stopped is None and self.idle() and not self._tidy:
                    self._wake.wait()
                if self.stopped is not None:
                    break
                busy = not self.idle()
            try:
                if busy:
                    self._turn()
                    self._tidy = True
                else:
                    self._tidy = self._idle_turn()
            except Exception as exc:  # a lost rank (RankFailure), or a fault that closed the engine
                if not isinstance(exc, RankFailure):
                    exc = RankFailure(f"the engine stopped: {type(exc).__name__}: {exc}")
                with self._wake:
                    self.stopped = str(exc)
                if self.on_failure is not None:
                    self.on_failure(exc)
                self._fail_all(exc)
                return
        self._fail_all(SchedulerStopped(self.stopped))

    def _idle_turn(self) -> bool:
        """With nothing else to run: one page of the document caches moved into a 2 MiB page on every
        decode rank (Engine.move_document_pages); False when no cache waited for it."""
        return self.engine.move_document_pages() > 0

    def _turn(self) -> None:
        """One step: a call; the batch's step; a token of the running answer (and a slice of the first
        prefill); or an idle slice of the first prefill."""
        if self.calls:
            call = self.calls.popleft()
            try:
                call.result = call.fn()
            except ValueError as exc:  # bad input: this call only
                call.error = exc
            except Exception as exc:
                call.error = exc
                call.done.set()
                raise
            call.done.set()
            return
        if self.running is None and (self.questions or self.batched):
            self._batch_turn()
            return
        prefill = self.prefills[0] if self.prefills else None
        self.last_slice_layers = 0
        if self.running is not None or self.answers:
            t0 = time.perf_counter()
            self._answer_step()
            if prefill is not None:  # beside a lone answer too: a slice about as long as its token
                layers = self._slice_layers(prefill, time.perf_counter() - t0)
                self.last_slice_layers = self._prefill_step(prefill, layers)
        elif prefill is not None:
            self._prefill_step(prefill, self._layers_within(prefill, self.idle_slice_s))

    def _answer_step(self) -> None:
        ticket = self.running
        if ticket is None:
            ticket = self.running = self.answers.popleft()
            ticket.started = time.monotonic()
            if ticket.cancelled:
                self._end_answer(ticket, None)
                return
            try:
                work = ticket.work
                ticket.answer = self.engine.generate(work.document, work.prompt, **work.sampling)
            except ValueError as exc:  # bad input: this answer only
                self.running = None
                ticket._put(exc)
                return
        if ticket.cancelled:
            ticket.answer.close()
            self._end_answer(ticket, None)
            return
        try:
            piece = ticket.answer.advance()
        except ValueError as exc:
            self.running = None
            ticket._put(exc)
            return
        if piece is None:
            self._end_answer(ticket, ticket.answer.result)
        elif piece:
            ticket._put(Text(piece))

    # ------------------------------------------------------------------ the batch
    def _batch_turn(self) -> None:
        """One step of the batch: leaves, joins within the budget, an ingest's slice (an idle one when
        no question decodes), one decode step."""
        batch = self.engine.batch()
        for ticket in [t for t in self.batched if t.cancelled]:  # a client gone: its rows are freed now
            self._leave(batch, ticket, None)
        budget = self.max_step_tokens - len(self.batched)
        spent = len(self.batched)
        joined = 0
        # Answers in flight wait for this step's joins: bound them by time too (module docstring).
        join_budget_s = self.join_share * batch.last_step_s if self.batched and batch.last_step_s > 0 else None
        join_spent_s = 0.0
        while self.questions and len(self.batched) < self.max_batch:
            ticket = self.questions[0]
            if ticket.cancelled:
                self.questions.popleft()
                ticket._put(Done(None))
                continue
            # A prompt longer than any step's budget joins as the step's only prefill; a question
            # the rows cannot hold waits until others leave (one alone always runs).
            too_long = joined == 0 and ticket.prompt_tokens > self.max_step_tokens - len(self.batched)
            no_rows = self.batched and self.max_rows is not None and self.rows_reserved + ticket.rows > self.max_rows
            if no_rows or (ticket.prompt_tokens > budget and not too_long):
                break  # the next step (FIFO: a later, smaller question does not overtake it)
            if joined and join_budget_s is not None and join_spent_s + (self.join_s or 0.0) > join_budget_s:
                self.joins_held += 1
                break  # the answers in flight have waited long enough: it joins in the next step
            self.questions.popleft()
            self.batched.append(ticket)  # a lost rank during the join reaches it too (_fail_all)
            ticket.started = time.monotonic()
            t0 = time.perf_counter()
            try:
                question = ticket.work
                document = question.source.document(self.engine) if question.source is not None else question.document
                ticket.member = batch.join(document, question.prompt, keep=question.keep, **question.sampling)
            except ValueError as exc:  # bad input: this question only
                self.batched.remove(ticket)
                ticket._put(exc)
                continue
            took = time.perf_counter() - t0
            join_spent_s += took
            # (a join over a short document must not let several over a long one into the next step)
            self.join_s = slowest_recent(self.join_s, took)
            budget -= ticket.prompt_tokens
            spent += ticket.prompt_tokens
            joined += 1
            if ticket.member.first_piece:
                ticket._put(Text(ticket.member.first_piece))
        self.last_step_joins = joined
        prefill = self.prefills[0] if self.prefills else None
        self.last_slice_layers = 0
        if prefill is not None and not self.batched:  # (every question failed or was cancelled)
            spent += self._chunk_tokens(prefill)
            self._prefill_step(prefill, self._layers_within(prefill, self.idle_slice_s))
        elif prefill is not None:
            self.last_slice_layers = self._prefill_step(prefill, self._slice_layers(prefill, batch.last_step_s))
        if batch.members:
            by_member = {id(t.member): t for t in self.batched}
            self.decoded_tokens += sum(m.generation.next_input() is not None for m in batch.members)
            ran = batch.steps
            for member, piece in batch.step():
                ticket = by_member.get(id(member))
                if ticket is None:
                    continue
                if piece is None:
                    self._leave(batch, ticket, member.result)
                elif piece:
                    ticket._put(Text(piece))
            if batch.steps > ran:  # the engine ran (a step whose members all ended runs nothing)
                self.steps += 1
                self.decode_seconds += batch.last_step_s
        self.last_step_tokens = spent

    def _leave(self, batch, ticket: QuestionTicket, result) -> None:
        if ticket in self.batched:
            self.batched.remove(ticket)
        batch.leave(ticket.member)
        if ticket.work.on_leave is not None:  # before Done: a next turn then finds what it kept
            ticket.work.on_leave(ticket.member)
        ticket._put(Done(result))

    def _slice_layers(self, ticket: PrefillTicket, decode_s: float) -> int:
        """Layers of the prefill's chunk that take about ingest_share x a decode step (the median of
        the last RECENT_DECODE_STEPS, decode_s the latest; at least one layer, one until a decode
        step and a slice have been timed)."""
        if decode_s > 0:
            self._recent_decode_s.append(decode_s)
        if not self._recent_decode_s:
            return 1
        step_s = sorted(self._recent_decode_s)[len(self._recent_decode_s) // 2]
        return self._layers_within(ticket, self.ingest_share * step_s)

    @staticmethod
    def _layers_within(ticket: PrefillTicket, seconds: float) -> int:
        """Layers of the prefill's chunk that take about `seconds` by its recent time per layer (at
        least one; one until a slice of it has been timed)."""
        if ticket.layer_s is None:
            return 1
        return max(1, int(seconds / ticket.layer_s))

    def _chunk_tokens(self, ticket: PrefillTicket) -> int:
        """Tokens the prefill's next step prefills (its first: the engine's chunk size)."""
        if ticket.job is None:
            return self.engine.chunk_tokens
        return ticket.job.next_chunk_tokens

    def _end_answer(self, ticket: AnswerTicket, result) -> None:
        self.running = None
        ticket._put(Done(result))

    def _prefill_step(self, ticket: PrefillTicket, layers: int | None = None) -> int:
        """The prefill's next chunk (or its next `layers` layers), its start or its finish; returns
        the layers run (0 for a start, a finish or a cancel)."""
        try:
            if ticket.cancelled:
                if ticket.job is not None:
                    ticket.job.cancel()
                self.prefills.popleft()
                ticket._finish(error=SchedulerStopped("the prefill was cancelled"))
                return 0
            if ticket.job is None:
                ticket.job = self._start_prefill(ticket.work)
            if not ticket.job.done:
                total = len(self.engine.model.layers)
                ran = total - ticket.job.layer_in_chunk
                if layers is not None and ticket.job.slices:
                    ran = min(ran, layers)
                t0 = time.perf_counter()
                stats = ticket.job.step(layers)
                # (a chunk's layers cost more than the last chunk's: each attends to more)
                ticket.layer_s = slowest_recent(ticket.layer_s, (time.perf_counter() - t0) / ran)
                self.prefill_steps += 1
                self.prefill_chunks += stats is not None
                if stats is not None and ticket.on_chunk is not None:
                    ticket.on_chunk(ticket.job, stats)
                return ran
            result = ticket.job.finish()
            if ticket.on_done is not None:
                ticket.on_done(result)
        except ValueError as exc:  # bad input, or no memory for it: this prefill only
            self.prefills.popleft()
            ticket._finish(error=exc)
            return 0
        self.prefills.popleft()
        ticket._finish(result)
        return 0

    def _start_prefill(self, work: Prefill):
        if work.on_top is not None:
            return self.engine.start_extend(work.on_top(self.engine), work.token_ids,
                                            chunk_tokens=work.chunk_tokens or self.engine.chunk_tokens,
                                            decode_room=work.decode_room)
        job = self.engine.start_prefill(work.token_ids, as_document=work.as_document, drop_unseen=work.drop_unseen,
                                        decode_room=work.decode_room, chunk_tokens=work.chunk_tokens,
                                        checkpoint=work.checkpoint, keep_checkpoint=True, extra=work.checkpoint_extra)
        job.frame = work.frame
        if work.on_resume is not None and job.resume is not None and job.resume.mode != "fresh":
            work.on_resume(job)
        return job

    def _engine_call(self, work: EngineCall):
        if isinstance(work, DropDocument):
            return self.engine.drop_document(work.document)
        return work.job.finish()

    def _fail_all(self, error: BaseException) -> None:
        """End everything still queued or running with `error`."""
        with self._wake:
            answers, prefills, calls = list(self.answers), list(self.prefills), list(self.calls)
            answers += list(self.batched) + list(self.questions)
            self.answers.clear(), self.prefills.clear(), self.calls.clear(), self.questions.clear()
            self.batched = []
            running, self.running = self.running, None
        for ticket in ([running] if running is not None else []) + answers:
            ticket._put(error)
        for ticket in prefills:
            ticket._finish(error=error)
        for call in calls:
            call.error = error
            call.done.set()


RECENT_DECODE_STEPS = 8
"""Decode steps whose median sizes an ingest's slice beside them (Scheduler._slice_layers)."""


def slowest_recent(previous: float | None, measured: float) -> float:
    """The time the next slice of work is sized by (a layer of an ingest, a join): the slowest
    recent one, forgotten by a fifth per measurement, so that a quick outlier never sizes a long
    step and the estimate still comes down when the work gets cheaper."""
    return measured if previous is None else max(measured, 0.8 * previous)


def default_step_tokens(engine, max_batch: int) -> int:
    """The default step budget: one prefill chunk of the engine beside a full batch's decode tokens."""
    return int(engine.chunk_tokens) + max_batch
