"""The step-level scheduler: prefills a chunk at a time and answers a token at a time, interleaved on
two ranks, give exactly what each gives alone; cancelled work frees its place; a lost rank ends
every ticket with the RankFailure naming it."""

import asyncio
import threading
import time

import pytest
import torch

from ringctx import Engine
from ringctx.engine.scheduler import IDLE_SLICE_S, Done, Scheduler, SchedulerStopped, Text
from ringctx.engine.work_items import LoneAnswer, Prefill

DOC = [(3 * i) % 250 + 3 for i in range(257)]
LONG = [(7 * i) % 250 + 3 for i in range(700)]
QUESTION = [5, 9, 11, 4]
GREEDY = dict(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", nproc=2, dtype="float32", chunk_tokens=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(engine):
    """What the engine gives with nothing else running: the answer's tokens and logits, the long prefill's logits."""
    document = engine.ingest(DOC)
    generation = engine.generate(document, QUESTION, keep_logits=True, **GREEDY)
    text = "".join(generation)
    prefill = engine.prefill(LONG)
    return {"tokens": generation.result.token_ids, "logits": generation.result.step_logits, "text": text,
            "long_logits": prefill.logits.clone()}


def collect(ticket):
    events = list(ticket)
    assert isinstance(events[-1], Done)
    return "".join(e.text for e in events if isinstance(e, Text)), events[-1].result


def test_an_answer_interleaved_with_a_long_prefill_equals_each_alone(engine, alone):
    chunk_times = []
    scheduler = Scheduler(engine)
    try:
        document = scheduler.call(lambda: engine.ingest(DOC))
        prefill = scheduler.submit_prefill(Prefill(LONG),
                                           on_chunk=lambda job, stats: chunk_times.append(time.monotonic()))
        answer = scheduler.submit_answer(LoneAnswer(document, QUESTION, dict(keep_logits=True, **GREEDY)))
        text, result = collect(answer)
        long = prefill.wait(timeout=300)
    finally:
        scheduler.stop()
    assert result.token_ids == alone["tokens"] and text == alone["text"]
    for got, want in zip(result.step_logits, alone["logits"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(long.logits, alone["long_logits"], rtol=1e-5, atol=1e-6)
    # The answer started before the prefill's last chunk (answers come first), and both finished.
    assert answer.started is not None and answer.started < chunk_times[-1]
    assert len(chunk_times) == len(range(0, len(LONG), 64))


def test_a_prefill_gets_chunks_while_answers_keep_coming(engine):
    """A queued prefill advances beside the answers (a slice beside each token), not after them."""
    chunk_times = []
    scheduler = Scheduler(engine)
    try:
        document = scheduler.call(lambda: engine.ingest(DOC))
        answers = [scheduler.submit_answer(LoneAnswer(document, QUESTION, GREEDY)) for _ in range(2)]
        prefill = scheduler.submit_prefill(Prefill(LONG),
                                           on_chunk=lambda job, stats: chunk_times.append(time.monotonic()))
        for a in answers:
            collect(a)
        prefill.wait(timeout=300)
    finally:
        scheduler.stop()
    assert chunk_times[0] < answers[1].started  # the prefill did not wait for every answer


def test_an_idle_ingest_runs_in_slices_with_the_bits_of_whole_chunks(engine, alone):
    """With nothing decoding an ingest still never runs a whole chunk in one step: each step runs
    the layers that fit idle_slice_s (the first, untimed, one layer), so a question arriving mid-chunk
    waits one slice; the prefill's bits are those of its chunks run whole."""
    n_layers, n_chunks = len(engine.model.layers), len(range(0, len(LONG), 64))
    for idle_slice_s in (1e-9, IDLE_SLICE_S):
        scheduler = Scheduler(engine, idle_slice_s=idle_slice_s)
        try:
            long = scheduler.submit_prefill(Prefill(LONG)).wait(timeout=300)
            steps, chunks = scheduler.prefill_steps, scheduler.prefill_chunks
        finally:
            scheduler.stop()
        assert torch.equal(long.logits, alone["long_logits"])
        assert chunks == n_chunks
        if idle_slice_s == 1e-9:  # shorter than any layer: a layer per step
            assert steps == n_chunks * n_layers
        else:  # the first chunk's first slice is one layer (nothing timed yet): its chunk took 2 steps or more
            assert n_chunks < steps <= n_chunks * n_layers


def test_a_cancelled_answer_ends_at_once_and_the_next_is_unchanged(engine, alone):
    scheduler = Scheduler(engine)
    try:
        document = scheduler.call(lambda: engine.ingest(DOC))
        first = scheduler.submit_answer(LoneAnswer(document, QUESTION, dict(max_new_tokens=3000)))  # within tiny's 4,096
        while scheduler.running is not first or first.answer is None:  # wait until it decodes
            time.sleep(0.001)
        first.cancel()
        rest = list(first)
        assert isinstance(rest[-1], Done) and rest[-1].result is None  # ended unfinished
        text, result = collect(scheduler.submit_answer(LoneAnswer(document, QUESTION, GREEDY)))
        assert result.token_ids == alone["tokens"]
        assert scheduler.call(lambda: engine.document_rows(document)) and scheduler.idle()
    finally:
        scheduler.stop()


def test_bad_input_fails_its_ticket_only(engine):
    scheduler = Scheduler(engine)
    try:
        bad = scheduler.submit_prefill(Prefill([10 ** 6]))  # outside the vocabulary
        with pytest.raises(ValueError, match="outside the vocabulary"):
            bad.wait(timeout=120)
        with pytest.raises(ValueError, match="bad call"):
            scheduler.call(_raise_value_error)
        assert scheduler.stopped is None and scheduler.call(lambda: 41 + 1) == 42
    finally:
        scheduler.stop()
    with pytest.raises(SchedulerStopped):
        scheduler.submit_answer(LoneAnswer(None, QUESTION))


def _raise_value_error():
    raise ValueError("bad call")


def test_tickets_are_read_from_other_threads(engine, alone):
    scheduler = Scheduler(engine)
    results = {}
    try:
        document = scheduler.call(lambda: engine.ingest(DOC))
        tickets = [scheduler.submit_answer(LoneAnswer(document, QUESTION, GREEDY)) for _ in range(3)]
        threads = [threading.Thread(target=lambda i=i, t=t: results.__setitem__(i, collect(t))) for i, t in
                   enumerate(tickets)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        scheduler.stop()
    assert [results[i][1].token_ids for i in range(3)] == [alone["tokens"]] * 3


def test_tickets_are_read_on_an_event_loop(engine, alone):
    """`async for` over tickets (the server's streamed answers): the same events as reading them from a
    thread, several at once on one loop; an error is raised from the iteration; a ticket whose loop
    has closed does not disturb the scheduler."""
    scheduler = Scheduler(engine)

    async def read(ticket):
        return [event async for event in ticket]

    async def read_all(tickets):
        return await asyncio.gather(*(read(t) for t in tickets))

    try:
        document = scheduler.call(lambda: engine.ingest(DOC))
        tickets = [scheduler.submit_answer(LoneAnswer(document, QUESTION, GREEDY)) for _ in range(3)]
        for events in asyncio.run(read_all(tickets)):
            assert isinstance(events[-1], Done) and events[-1].result.token_ids == alone["tokens"]
            assert "".join(e.text for e in events if isinstance(e, Text)) == alone["text"]
        bad = scheduler.submit_answer(LoneAnswer(document, [10 ** 6], GREEDY))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            asyncio.run(read(bad))

        async def give_up(ticket) -> bool:  # stops reading, and its loop closes, while the answer runs
            try:
                await asyncio.wait_for(read(ticket), timeout=0.05)
                return True  # (it finished first)
            except asyncio.TimeoutError:
                return False

        left = scheduler.submit_answer(LoneAnswer(document, QUESTION, dict(max_new_tokens=300)))
        if not asyncio.run(give_up(left)):
            assert isinstance(list(left)[-1], Done)  # the rest is still there to read, from a thread
        text, result = collect(scheduler.submit_answer(LoneAnswer(document, QUESTION, GREEDY)))
        assert result.token_ids == alone["tokens"] and scheduler.stopped is None
    finally:
        scheduler.stop()


def test_an_engine_given_as_a_function_is_built_on_the_schedulers_thread_and_answers_the_same(alone):
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return Engine("tiny", nproc=1, dtype="float32", chunk_tokens=64)

    scheduler = Scheduler(build)
    try:
        assert built_on == [scheduler._thread] and isinstance(scheduler.engine, Engine)
        engine = scheduler.engine
        document = scheduler.call(lambda: engine.ingest(DOC))
        text, result = collect(scheduler.submit_answer(
            LoneAnswer(document, QUESTION, dict(keep_logits=True, **GREEDY))))
        assert result.token_ids == alone["tokens"]
    finally:
        scheduler.stop()
        scheduler.engine.close()


def test_a_build_that_fails_raises_from_the_constructor():
    def build():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        Scheduler(build)


def test_idle_turns_move_a_documents_small_pages_into_huge_ones_without_changing_answers(engine, alone):
    """A document's cache is written in small pages (the first touch of 2 MiB pages stalled the
    chunks writing it); with nothing to run, the scheduler moves it into 2 MiB pages a page per
    turn (ringctx.host_memory.collapse_steps) on every decode rank, every byte kept."""
    scheduler = Scheduler(engine)
    try:
        def ingest():  # on the scheduler's thread, before any idle turn can run
            made = engine.ingest(DOC)
            return made, made.cache.small_pages

        document, written_in_small_pages = scheduler.call(ingest)
        assert written_in_small_pages
        deadline = time.monotonic() + 60
        while document.cache.small_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not document.cache.small_pages, "the idle turns never reached the document's cache"
        while scheduler.call(engine.move_document_pages) and time.monotonic() < deadline:
            pass
        text, result = collect(scheduler.submit_answer(
            LoneAnswer(document, QUESTION, dict(keep_logits=True, **GREEDY))))
    finally:
        scheduler.stop()
    assert result.token_ids == alone["tokens"] and text == alone["text"]


def test_every_decode_rank_moves_its_own_slices_into_huge_pages(engine, alone):
    """Engine.move_document_pages (a scheduler's idle turn) on each decode rank: both ranks' slices
    of a new document are counted, moved, and then none is left; the answer is unchanged."""
    document = engine.ingest(DOC)
    assert engine.decode_ranks == 2 and engine.move_document_pages() >= 2  # one slice on each rank
    for _ in range(10_000):
        if engine.move_document_pages() == 0:
            break
    assert engine.move_document_pages() == 0
    generation = engine.generate(document, QUESTION, **GREEDY)
    "".join(generation)
    assert generation.result.token_ids == alone["tokens"]
