"""Many sequences decoded together (runtime/batch.py): at W = 1, 2, 4 decode ranks, batches of 1 to 9
sequences over 0 to 3 documents of different lengths, joining and leaving at different steps; every
sequence's logits equal its answer alone (float32, 1e-5 relative), greedy and seeded tokens identical,
slices balanced, the documents' rows untouched, every row freed when the sequences leave."""

import pytest
import torch

from ringctx.engine import Engine
from tests.kernels.test_cpu_kernels import needs_kernels

DOCS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (301, 130, 57)]
QUESTIONS = [[5, 17, 99, 3, 42, 7, 8], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13], [77]]
GREEDY = dict(stop_token_ids=[], keep_logits=True)
SAMPLED = dict(temperature=0.8, top_k=40, seed=7)

# (document index or None, question index, join step, max_new_tokens, sampling): 9 sequences over
# 3 documents and none, joining at steps 0-6 and leaving when their max_new_tokens are spent.
PLAN = [
    (0, 0, 0, 12, {}),
    (0, 1, 0, 5, SAMPLED),
    (1, 2, 1, 9, {}),
    (None, 0, 1, 7, {}),
    (0, 3, 2, 10, {**SAMPLED, "seed": 3}),
    (2, 0, 3, 4, {}),
    (1, 1, 4, 8, SAMPLED),
    (0, 2, 6, 6, {}),
    (None, 3, 6, 3, {**SAMPLED, "seed": 11}),
]


def assert_same_run(got, want):
    assert got.token_ids == want.token_ids
    assert len(got.step_logits) == len(want.step_logits)
    for a, b in zip(got.step_logits, want.step_logits):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def alone(engine, documents, doc, question, steps, sampling):
    """The sequence's answer with nothing else running: Engine.generate (or the model alone)."""
    kwargs = dict(max_new_tokens=steps, **GREEDY, **sampling)
    if doc is None:
        generation = engine.model.stream(QUESTIONS[question], **kwargs)
    else:
        generation = engine.generate(documents[doc], QUESTIONS[question], **kwargs)
    "".join(generation)
    return generation.result


@pytest.fixture(scope="module")
def reference():
    engine = Engine("tiny", dtype="float32")
    documents = [engine.ingest(d, chunk_tokens=64) for d in DOCS]
    results = [alone(engine, documents, doc, q, steps, sampling) for doc, q, _, steps, sampling in PLAN]
    return {"engine": engine, "documents": documents, "results": results}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"decode{n}")
def split_engine(request):
    if request.param == 1:  # one process: the whole cache on it
        yield Engine("tiny", dtype="float32", chunk_tokens=64)
        return
    with Engine("tiny", nproc=4, dtype="float32", decode_ranks=request.param, chunk_tokens=64) as engine:
        yield engine


def run_plan(engine, documents, plan, check_balance=None):
    """Join each sequence at its step, step the batch until every one has left; the results."""
    batch = engine.batch()
    members, results, step = {}, {}, 0
    while len(results) < len(plan):
        for i, (doc, q, join, steps, sampling) in enumerate(plan):
            if join == step:
                document = documents[doc] if doc is not None else None
                members[batch.join(document, QUESTIONS[q], max_new_tokens=steps, **GREEDY, **sampling).id] = i
        if check_balance is not None:
            check_balance(batch)
        for member, piece in batch.step():
            if piece is None:
                results[members[member.id]] = member.result
        step += 1
    assert not batch.members
    return [results[i] for i in range(len(plan))]


def test_every_sequence_of_a_batch_equals_its_answer_alone(split_engine, reference):
    documents = [split_engine.ingest(d) for d in DOCS]
    n = split_engine.decode_ranks
    doc_rows = [split_engine.document_rows(d) for d in documents]

    at_join = {}

    def check_balance(batch):
        """Every sequence's rows (its document's and its own) per decode rank: its question's prefill
        spreads them like any prefill over the document's slices, and decoding never unlevels them."""
        decoder = split_engine.state.batch
        for member in batch.members:
            sequence = decoder.sequences[member.id]
            rows = sequence.rows
            assert len(rows) == n and sum(rows) == sequence.length
            spread = max(rows) - min(rows)
            if member.id not in at_join:
                doc = doc_rows[documents.index(member.document)] if member.document is not None else [0]
                question = len(member.generation.prompt_ids)
                assert spread <= max(doc) - min(doc) + -(-question // n) + 1
                at_join[member.id] = spread
            assert spread <= max(at_join[member.id], 1)

    got = run_plan(split_engine, documents, PLAN, check_balance)
    for g, want in zip(got, reference["results"]):
        assert_same_run(g, want)
    # The documents' rows were never written, and nothing of the sequences is left on any rank
    assert [split_engine.document_rows(d) for d in documents] == doc_rows
    assert split_engine.state.batch.sequences == {}
    for document, text in zip(documents, DOCS):
        whole = split_engine.whole_cache(document)
        ref = reference["documents"][DOCS.index(text)].cache
        for layer in range(ref.n_layers):
            torch.testing.assert_close(whole.k[layer][:len(text)], ref.k[layer][:len(text)], atol=2e-5, rtol=0)
    # A batch of one is the same too, and a lone answer after the batch is unchanged
    (single,) = run_plan(split_engine, documents, [PLAN[2][:2] + (0,) + PLAN[2][3:]])
    assert_same_run(single, reference["results"][2])
    assert_same_run(alone(split_engine, documents, 0, 0, 12, {}), reference["results"][0])


def test_ask_many_streams_every_answer_labelled(split_engine, reference):
    document = split_engine.ingest(DOCS[0])
    questions = [QUESTIONS[0], QUESTIONS[1], QUESTIONS[3]]
    answers = split_engine.ask_many(document, questions, max_batch=2, max_new_tokens=6, stop_token_ids=[])
    pieces = list(answers)
    assert {i for i, _ in pieces} <= {0, 1, 2}
    for i, q in enumerate(questions):
        want = alone(reference["engine"], reference["documents"], 0, QUESTIONS.index(q), 6, {})
        assert answers.results[i].token_ids == want.token_ids
    assert split_engine.state.batch.sequences == {}


def test_bad_questions_are_refused_and_the_batch_goes_on(split_engine):
    document = split_engine.ingest(DOCS[2])
    with pytest.raises(ValueError, match="empty"):
        split_engine.ask_many(document, ["ok", ""])
    batch = split_engine.batch()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        batch.join(document, [10 ** 9], max_new_tokens=3)
    assert not batch.members and (split_engine.state.batch is None or split_engine.state.batch.sequences == {})
    member = batch.join(document, QUESTIONS[0], max_new_tokens=2, **GREEDY)
    while batch.members:
        batch.step()
    assert len(member.result.token_ids) == 2
    # the lone path likewise refuses before any rank takes the answer, and the engine goes on
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        split_engine.generate(document, [5, -1], max_new_tokens=3)
    answer = split_engine.generate(document, QUESTIONS[0], max_new_tokens=2, **GREEDY)
    "".join(answer)
    assert len(answer.result.token_ids) == 2


def test_batched_logits_equal_the_whole_sequence_run_at_once():
    """Against an independent reference: each sequence (document + question + its tokens) run through
    the model at once with causal attention, no cache (model.generate.sequence_logits)."""
    from ringctx.model.generate import sequence_logits

    engine = Engine("tiny", dtype="float32")
    documents = [engine.ingest(d, chunk_tokens=64) for d in DOCS[1:]]
    plan = [(0, 0, 0, 6, {}), (1, 2, 0, 4, SAMPLED), (None, 1, 1, 5, {}), (0, 3, 2, 3, {})]
    for (doc, q, _, steps, _), result in zip(plan, run_plan(engine, documents, plan)):
        prefix = (DOCS[1:][doc] if doc is not None else []) + QUESTIONS[q]
        want = sequence_logits(engine.model, prefix + result.token_ids[:-1])[len(prefix) - 1:]
        assert len(result.step_logits) == steps == want.shape[0]
        for got, row in zip(result.step_logits, want):
            assert float((got - row).abs().max() / row.abs().max()) < 1e-5


@needs_kernels
def test_fused_batch_step_equals_the_pytorch_batch_path(monkeypatch):
    """The batch's steps run in the fused CPU kernel where it applies (one call per step) and give
    the logits of the PyTorch layer-by-layer path (float32, 1e-5 relative), tokens identical."""
    from ringctx.model.decode_step import FusedBatchStep

    plan = [(0, 0, 0, 6, {}), (1, 2, 0, 4, SAMPLED), (None, 1, 1, 5, {}), (0, 3, 2, 3, {})]
    calls = []
    fused_call = FusedBatchStep.__call__
    monkeypatch.setattr(FusedBatchStep, "__call__", lambda self, *a: calls.append(len(a[0])) or fused_call(self, *a))
    engine = Engine("tiny", dtype="float32")
    documents = [engine.ingest(d, chunk_tokens=64) for d in DOCS[1:]]
    fused = run_plan(engine, documents, plan)
    assert calls and max(calls) == 4  # every step fused, the widest with all four sequences

    monkeypatch.setattr(FusedBatchStep, "build", classmethod(lambda cls, model: None))
    engine = Engine("tiny", dtype="float32")
    documents = [engine.ingest(d, chunk_tokens=64) for d in DOCS[1:]]
    steps = len(calls)
    for got, want in zip(fused, run_plan(engine, documents, plan)):
        assert_same_run(got, want)
    assert len(calls) == steps  # the second run never entered the kernel

