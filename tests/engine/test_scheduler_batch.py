"""The scheduler's batch: questions decode together (max_batch), join within the step's token budget
(and, while others decode, its time bound) beside an ingest's slices, wait while the rows run out,
leave at once when cancelled; every answer equals the question asked alone. (Tickets are submitted
from a call on the scheduler's own thread, so every case starts from the same queue whatever the
machine's speed.)"""

import pytest
import torch

from ringctx import Engine
from ringctx.engine.scheduler import Done, Scheduler, Text
from ringctx.engine.work_items import Prefill, Question

DOCS = [[(3 * i) % 250 + 3 for i in range(257)], [(5 * i) % 240 + 7 for i in range(90)]]
LONG = [(7 * i) % 250 + 3 for i in range(300)]
QUESTIONS = [[5, 9, 11, 4], [8, 1, 2, 3], [100, 101, 102, 103], [6, 6, 6, 6], [9, 8, 7, 6], [1, 2, 3, 4]]
SAMPLING = [dict(), dict(temperature=0.8, seed=3), dict(), dict(temperature=0.9, top_k=20, seed=5), dict(), dict()]
NEW = [12, 7, 10, 5, 9, 3]


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", nproc=2, dtype="float32", chunk_tokens=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def setup(engine):
    """The documents, and each question's answer alone (Engine.generate, nothing else running)."""
    documents = [engine.ingest(d) for d in DOCS]
    alone = []
    for i, q in enumerate(QUESTIONS):
        generation = engine.generate(documents[i % 2], q, max_new_tokens=NEW[i], stop_token_ids=[], **SAMPLING[i])
        "".join(generation)
        alone.append(generation.result.token_ids)
    return documents, alone


def collect(ticket):
    events = list(ticket)
    assert isinstance(events[-1], Done)
    return "".join(e.text for e in events if isinstance(e, Text)), events[-1].result


def watch(engine, scheduler):
    """The batch's size at every decode step, the tokens of every step before it and the layers of
    an ingest's chunk that ran beside it."""
    batch, seen = engine.batch(), []
    step = batch.step

    def counted():
        seen.append((len(batch.members), scheduler.last_step_tokens, scheduler.last_slice_layers))
        return step()

    batch.step = counted
    return seen


def question(documents, i):
    """Question i about its document, as the batch runs it."""
    q = QUESTIONS[i]
    return Question(q, len(q), dict(max_new_tokens=NEW[i], stop_token_ids=[], **SAMPLING[i]), document=documents[i % 2])


def submit_all(scheduler, documents, ingest=None):
    def submit():
        tickets = [scheduler.submit_question(question(documents, i)) for i in range(len(QUESTIONS))]
        return tickets, ingest() if ingest else None
    return scheduler.call(submit)


def run_questions(engine, scheduler, documents, ingest=None):
    """Every question through `scheduler`, and `ingest`'s prefill beside them: (each answer's
    result, the batch size and step tokens at every step, the prefill's result or None). Stops the
    scheduler and takes the step counter off the batch."""
    seen = watch(engine, scheduler)
    try:
        tickets, prefill = submit_all(scheduler, documents, ingest)
        results = [collect(t)[1] for t in tickets]
        prefilled = prefill.wait(timeout=300) if prefill is not None else None
    finally:
        scheduler.stop()
        del engine.batch().step
    return results, seen, prefilled


def test_questions_batch_within_the_budget_beside_an_ingest(engine, setup):
    documents, alone = setup
    scheduler = Scheduler(engine, max_batch=3, max_step_tokens=70)
    results, seen, long = run_questions(engine, scheduler, documents, lambda: scheduler.submit_prefill(Prefill(LONG)))
    assert [r.token_ids for r in results] == alone
    assert torch.equal(long.logits, engine.prefill(LONG).logits)  # slices beside answers: the same bits
    sizes = [n for n, _, _ in seen]
    assert max(sizes) == 3 and min(sizes) >= 1
    assert all(tokens <= 70 for _, tokens, _ in seen)  # decode tokens + joins within the budget
    # Beside answers the ingest ran in slices of whole layers, never a whole chunk in one step.
    slices = [layers for n, _, layers in seen if n]
    assert any(slices) and max(slices) <= len(engine.model.layers)
    assert engine.state.batch.sequences == {} and scheduler.rows_reserved == 0


def test_questions_wait_while_the_rows_run_out(engine, setup):
    documents, alone = setup
    scheduler = Scheduler(engine, max_batch=8, max_rows=4 + 12 + 4 + 7)  # the first two questions' rows
    results, seen, _ = run_questions(engine, scheduler, documents)
    assert [r.token_ids for r in results] == alone
    assert max(n for n, _, _ in seen) == 2


def test_a_cancelled_question_leaves_at_once_and_frees_its_rows(engine, setup):
    documents, alone = setup
    scheduler = Scheduler(engine, max_batch=4)
    try:
        long = scheduler.submit_question(Question(QUESTIONS[0], 4, dict(max_new_tokens=3000, stop_token_ids=[]),
                                                  document=documents[0]))
        while not scheduler.call(lambda: long.member is not None and long.member.generation.next_input() is not None):
            pass  # until it has joined and is decoding
        other = scheduler.submit_question(question(documents, 1))
        assert scheduler.call(lambda: scheduler.rows_reserved) >= 4 + 3000
        long.cancel()
        rest = list(long)
        assert isinstance(rest[-1], Done) and rest[-1].result is None
        assert collect(other)[1].token_ids == alone[1]
        assert scheduler.call(lambda: (dict(engine.state.batch.sequences), scheduler.rows_reserved)) == ({}, 0)
    finally:
        scheduler.stop()


def test_prompts_longer_than_the_budget_join_one_per_step(engine, setup):
    documents, alone = setup
    scheduler = Scheduler(engine, max_batch=8, max_step_tokens=3)  # every prompt (4 tokens) is longer
    results, seen, _ = run_questions(engine, scheduler, documents)
    assert [r.token_ids for r in results] == alone
    sizes = [n for n, _, _ in seen]
    assert sizes[:3] == [1, 2, 3]  # one joins per step, beside the ones decoding: none is stuck
    assert all(tokens <= len(QUESTIONS[0]) + n for n, tokens, _ in seen)


@pytest.mark.parametrize("join_share, joins_per_step", [(1e-9, 1), (1e9, 4)])
def test_while_answers_decode_joins_are_bounded_by_time(engine, setup, join_share, joins_per_step):
    """A burst of questions beside an answer in flight: with a tiny join_share one joins per step
    (the answer waits one prefill between two tokens, not all four), with a huge one all four join
    in the step they come (the token budget holds them); the answers are the same either way."""
    documents, alone = setup
    scheduler = Scheduler(engine, max_batch=8, join_share=join_share)
    seen = watch(engine, scheduler)
    batch, tickets, before = engine.batch(), [], []
    counted = batch.step

    def step_then_burst():  # the burst comes right after the first question's first decode step, on
        events = counted()  # the scheduler's thread: all four arrive at once, whatever the timing
        if not tickets:
            before.append(len(seen))
            tickets.extend(scheduler.submit_question(question(documents, i)) for i in range(1, 5))
        return events

    batch.step = step_then_burst
    try:
        first = scheduler.submit_question(question(documents, 0))
        results = [collect(first)[1]]
        results += [collect(t)[1] for t in tickets]
        held = scheduler.joins_held
    finally:
        scheduler.stop()
        del batch.step
    assert len(tickets) == 4 and [r.token_ids for r in results] == alone[:5]
    sizes = [n for n, _, _ in seen[before[0]:]]
    assert sizes[:4] == ([2, 3, 4, 5] if joins_per_step == 1 else [5, 5, 5, 5]), sizes
    assert (held >= 3) == (joins_per_step == 1)


def test_a_question_arriving_mid_chunk_gets_its_first_token_before_the_chunk_ends(engine, setup, monkeypatch):
    """An ingest runs alone in slices of a layer (idle_slice_s shorter than any layer); a question
    submitted right after its first slice, i.e. in the middle of its first chunk, joins at the next
    step (its join samples its first token) before that chunk's last layer runs, and its answer
    and the ingest's bits are those each gives alone."""
    documents, alone = setup
    scheduler = Scheduler(engine, idle_slice_s=1e-9, ingest_share=1e-9)
    events, tickets = [], []
    start_prefill, batch = engine.start_prefill, engine.batch()
    join = batch.join

    def started(*args, **kw):  # the ingest's job, its steps watched (on the scheduler's thread)
        job = start_prefill(*args, **kw)
        step = job.step

        def watched(layers=None):
            stats = step(layers)
            events.append("slice")
            if not tickets and stats is None:  # mid-chunk: the question arrives now
                tickets.append(scheduler.submit_question(question(documents, 0)))
            return stats

        job.step = watched
        return job

    def joined(*args, **kw):
        member = join(*args, **kw)
        events.append("first token")
        return member

    monkeypatch.setattr(engine, "start_prefill", started)
    monkeypatch.setattr(batch, "join", joined)
    try:
        ingest = scheduler.submit_prefill(Prefill(LONG), on_chunk=lambda job, stats: events.append("chunk"))
        long = ingest.wait(timeout=300)
        result = collect(tickets[0])[1]
    finally:
        scheduler.stop()
    assert events.index("slice") < events.index("first token") < events.index("chunk"), events
    assert result.token_ids == alone[0]
    assert torch.equal(long.logits, engine.prefill(LONG).logits)


def test_shares_must_be_positive(engine):
    for kw in (dict(join_share=0), dict(ingest_share=-1.0), dict(idle_slice_s=0.0)):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be > 0"):
            Scheduler(engine, **kw)
