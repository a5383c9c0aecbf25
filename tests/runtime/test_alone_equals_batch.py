"""An answer asked alone (Engine.generate, `ringctx ask` with one question) and the same question
decoded beside others (a Batch: `ask_many`, `ringctx serve`) are the same bits in every dtype: the
lone step is the batch kernel with one row, its document's rows attended apart from its own
(model/decode_step.py), its question prefilled by cp_prefill as a join is. Its own module: its
engines spawn ranks, and test_batch's module-scoped engines hold the process group until its end."""

import pytest
import torch

from ringctx.engine import Engine
from ringctx.model import KVCache
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.runtime.test_batch import DOCS, SAMPLED, alone, run_plan


@needs_kernels
@pytest.mark.parametrize("decode_ranks, kv_dtype", [(1, "model"), (1, "fp8"), (1, "int8"), (2, "model"), (2, "fp8")])
def test_an_answer_alone_and_in_a_batch_are_the_same_bits(decode_ranks, kv_dtype):
    """bf16 weights, caches in bf16, fp8, int8: an answer asked alone (Engine.generate: the batch
    kernel with one row, the rows its cache held before it attended apart from its own) has the
    tokens and logits, bit for bit, of the same question decoded beside others (a Batch, as
    ringctx serve and ask_many run it), on one decode rank or two."""
    split = dict(nproc=2, decode_ranks=2) if decode_ranks == 2 else {}
    with Engine("tiny", dtype="bfloat16", kv_dtype=kv_dtype, chunk_tokens=64, **split) as engine:
        documents = [engine.ingest(d) for d in DOCS]
        plan = [(0, 0, 0, 9, {}), (1, 2, 0, 6, SAMPLED), (0, 1, 1, 7, {}), (2, 3, 2, 5, {})]
        for (doc, q, _, steps, sampling), got in zip(plan, run_plan(engine, documents, plan)):
            want = alone(engine, documents, doc, q, steps, sampling)
            assert got.token_ids == want.token_ids
            assert len(got.step_logits) == len(want.step_logits) == steps
            assert all(torch.equal(a, b) for a, b in zip(got.step_logits, want.step_logits))


@needs_kernels
def test_more_rows_than_the_small_products_take_change_no_answer():
    """Ten questions at once (more rows than selection.MAX_ROWS: the LM head goes MAX_ROWS rows at a
    time, as PyTorch's matmul sums by the row count), float32: each answer equal, bit for bit, to
    the question asked alone."""
    questions = [[7 + i, 3 * i + 1, 90 - i] for i in range(10)]
    with Engine("tiny", dtype="float32", chunk_tokens=64) as engine:
        document = engine.ingest(DOCS[0])
        together = engine.ask_many(document, questions, max_new_tokens=4, stop_token_ids=[], keep_logits=True)
        list(together)
        for question, got in zip(questions, together.results):
            answer = engine.generate(document, question, max_new_tokens=4, stop_token_ids=[], keep_logits=True)
            "".join(answer)
            assert got.token_ids == answer.result.token_ids
            assert all(torch.equal(a, b) for a, b in zip(got.step_logits, answer.result.step_logits))


@pytest.mark.parametrize("decode_ranks", [1, 2])
def test_an_answer_has_its_rows_from_its_question_on(monkeypatch, decode_ranks):
    """A lone answer's slices get the room for max_new_tokens when its question is prefilled: no
    slice grows while it decodes (growing copies the whole slice, the document's rows included)."""
    grown = []
    real = KVCache.grown

    def spy(cache, max_tokens):
        if max_tokens > cache.max_tokens:
            grown.append(stage[0])
        return real(cache, max_tokens)

    stage = ["ingest"]
    monkeypatch.setattr(KVCache, "grown", spy)
    split = dict(nproc=2, decode_ranks=2) if decode_ranks == 2 else {}
    with Engine("tiny", dtype="float32", chunk_tokens=64, **split) as engine:
        document = engine.ingest(DOCS[1], decode_room=4)
        stage[0] = "question"
        answer = engine.generate(document, [5, 6, 7], max_new_tokens=300, stop_token_ids=[])
        answer.advance()  # the question's prefill and the first token
        stage[0] = "answer"
        "".join(answer)
        assert len(answer.result.token_ids) == 300
    assert "answer" not in grown and "question" in grown  # on this rank (rank 0's slice)
