"""A rank lost while the scheduler runs an answer ends every ticket with the RankFailure naming it
(its own module: it needs an engine of its own, and an engine per process)."""

import pytest

from ringctx import Engine
from ringctx.engine import RankFailure
from ringctx.engine.scheduler import Scheduler, SchedulerStopped
from ringctx.engine.work_items import LoneAnswer

DOC = [(3 * i) % 250 + 3 for i in range(257)]
QUESTION = [5, 9, 11, 4]


def test_a_rank_lost_mid_answer_ends_every_ticket_naming_it(monkeypatch):
    monkeypatch.setenv("RINGCTX_TEST_KILL", "1:decode4")
    failures = []
    engine = Engine("tiny", nproc=2, dtype="float32", timeout_s=240)
    scheduler = Scheduler(engine, on_failure=failures.append)
    try:
        document = scheduler.call(lambda: engine.ingest(DOC))
        answer = scheduler.submit_answer(LoneAnswer(document, QUESTION, dict(max_new_tokens=50)))
        queued = scheduler.submit_answer(LoneAnswer(document, QUESTION, dict(max_new_tokens=5)))
        with pytest.raises(RankFailure, match=r"rank 1 of 2 .* during decode"):
            list(answer)
        with pytest.raises(RankFailure, match=r"rank 1 of 2"):
            list(queued)
        assert len(failures) == 1 and scheduler.stopped is not None
        with pytest.raises(SchedulerStopped, match="rank 1 of 2"):
            scheduler.submit_answer(LoneAnswer(document, QUESTION))
    finally:
        scheduler.stop()
        engine.close()
    assert not any(p.is_alive() for p in engine.worker_processes)
