"""A step-level scheduler over an Engine: one thread runs the engine's work a step at a time.

    submit_prefill(...) / submit_answer(...) / call(fn)     from any thread: returns a ticket at once
    the scheduler's thread, each turn:
        an answer is running     -> one token of it (Answer.advance: one decode step on the decode ranks)
        else a prefill is queued -> one chunk of it (PrefillJob.step: one chunk on every CP rank)
        calls (save, load, drop) -> run between two steps, in the order they came

Answers come first: a question about a ready document waits for at most the chunk in progress
of a long ingest, never for the ingest. So that a steady stream of questions cannot stall an
ingest for ever, a prefill also gets one chunk whenever `prefill_every_s` seconds have passed
since its last one. One answer decodes at a time (the next one starts when it ends); a
prefill's chunk sets the worst wait: about the time of one chunk at the document's current
length (each chunk attends to every token before it).

The Engine is not thread-safe: only the scheduler's thread touches it once the scheduler runs.
Tickets are how other threads see the work: an AnswerTicket is an iterator of events (text
pieces, then the result), a PrefillTicket reports each chunk and the result.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .failures import RankFailure


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
    """An answer in the scheduler: iterate it (from any thread) for Text events then one Done;
    `cancel()` ends it at the next step. Errors (bad input, a lost rank) are raised from the iterator."""

    def __init__(self, start: Callable[[], Any]):
        self.start = start  # on the scheduler's thread: -> the Engine's Answer
        self.answer = None
        self.cancelled = False
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._events: queue.Queue = queue.Queue()

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

    def _put(self, event) -> None:
        self._events.put(event)


class PrefillTicket:
    """A prefill in the scheduler. `on_chunk(job, chunk_stats)` runs on the scheduler's thread after
    each chunk and `on_done(result)` after the hand-off (it may use the engine: it is on that thread);
    `wait()` returns the PrefillResult (or raises its error); `cancel()` gives it up."""

    def __init__(self, start: Callable[[], Any], on_chunk=None, on_done=None):
        self.start = start  # on the scheduler's thread: -> the Engine's PrefillJob
        self.on_chunk, self.on_done = on_chunk, on_done
        self.job = None
        self.cancelled = False
        self.last_chunk = time.monotonic()
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


class _Call:
    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None


class Scheduler:
    """Runs an Engine's prefills, answers and other calls on one thread, a step at a time.

    Args:
        engine: the Engine (rank 0's); only this scheduler's thread uses it from now on.
        prefill_every_s: a queued prefill gets a chunk at least this often, even while answers run.
        on_failure: called once (on the scheduler's thread) with the RankFailure that ended it.
    """

    def __init__(self, engine, *, prefill_every_s: float = 30.0, on_failure: Callable[[BaseException], None] = None):
        self.engine = engine
        self.prefill_every_s = prefill_every_s
        self.on_failure = on_failure
        self.answers: collections.deque[AnswerTicket] = collections.deque()
        self.prefills: collections.deque[PrefillTicket] = collections.deque()
        self.calls: collections.deque[_Call] = collections.deque()
        self.running: AnswerTicket | None = None
        self.stopped: str | None = None
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="ringctx-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from any thread
    def submit_answer(self, start: Callable[[], Any]) -> AnswerTicket:
        """Queue an answer; `start()` runs on the scheduler's thread and returns the Engine's Answer."""
        return self._submit(self.answers, AnswerTicket(start))

    def submit_prefill(self, start: Callable[[], Any], on_chunk=None, on_done=None) -> PrefillTicket:
        """Queue a prefill; `start()` runs on the scheduler's thread and returns the Engine's PrefillJob."""
        return self._submit(self.prefills, PrefillTicket(start, on_chunk, on_done))

    def call(self, fn: Callable[[], Any], timeout: float | None = None):
        """Run fn() on the scheduler's thread between two steps and return what it returns (or raise)."""
        call = self._submit(self.calls, _Call(fn))
        if not call.done.wait(timeout):
            raise TimeoutError("the engine did not get to this call in time")
        if call.error is not None:
            raise call.error
        return call.result

    @property
    def queued_answers(self) -> int:
        return len(self.answers)

    def stop(self, reason: str = "the server is stopping") -> None:
        """Stop after the current step; everything still queued ends with SchedulerStopped."""
        with self._wake:
            if self.stopped is None:
                self.stopped = reason
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def idle(self) -> bool:
        return self.running is None and not self.answers and not self.prefills and not self.calls

    def _submit(self, where: collections.deque, item):
        with self._wake:
            if self.stopped is not None:
                raise SchedulerStopped(self.stopped)
            where.append(item)
            self._wake.notify()
        return item

    # ------------------------------------------------------------------ the scheduler's thread
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self.stopped is None and self.idle():
                    self._wake.wait()
                if self.stopped is not None:
                    break
            try:
                self._turn()
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

    def _turn(self) -> None:
        """One step: a call, a token of the running answer, or a chunk of the first prefill."""
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
        prefill = self.prefills[0] if self.prefills else None
        overdue = prefill is not None and time.monotonic() - prefill.last_chunk >= self.prefill_every_s
        if (self.running is not None or self.answers) and not overdue:
            self._answer_step()
        elif prefill is not None:
            self._prefill_step(prefill)

    def _answer_step(self) -> None:
        ticket = self.running
        if ticket is None:
            ticket = self.running = self.answers.popleft()
            ticket.started = time.monotonic()
            if ticket.cancelled:
                self._end_answer(ticket, None)
                return
            try:
                ticket.answer = ticket.start()
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

    def _end_answer(self, ticket: AnswerTicket, result) -> None:
        self.running = None
        ticket._put(Done(result))

    def _prefill_step(self, ticket: PrefillTicket) -> None:
        try:
            if ticket.cancelled:
                if ticket.job is not None:
                    ticket.job.cancel()
                self.prefills.popleft()
                ticket._finish(error=SchedulerStopped("the prefill was cancelled"))
                return
            if ticket.job is None:
                ticket.job = ticket.start()
            if not ticket.job.done:
                stats = ticket.job.step()
                ticket.last_chunk = time.monotonic()
                if ticket.on_chunk is not None:
                    ticket.on_chunk(ticket.job, stats)
                return
            result = ticket.job.finish()
            if ticket.on_done is not None:
                ticket.on_done(result)
        except ValueError as exc:  # bad input, or no memory for it: this prefill only
            self.prefills.popleft()
            ticket._finish(error=exc)
            return
        self.prefills.popleft()
        ticket._finish(result)

    def _fail_all(self, error: BaseException) -> None:
        """End everything still queued or running with `error`."""
        with self._wake:
            answers, prefills, calls = list(self.answers), list(self.prefills), list(self.calls)
            self.answers.clear(), self.prefills.clear(), self.calls.clear()
            running, self.running = self.running, None
        for ticket in ([running] if running is not None else []) + answers:
            ticket._put(error)
        for ticket in prefills:
            ticket._finish(error=error)
        for call in calls:
            call.error = error
            call.done.set()
