"""Decode ranks: after a prefill at W = 4 the KV cache stays split by token over 1, 2, 3 or 4 decode
ranks, which decode together; every result equals one process's. Also 8-bit KV caches, documents
saved by N decode ranks and loaded by M, bad input and a decode rank that dies."""

import pytest
import torch

from ringctx.engine import Engine
from ringctx.runtime.handoff import fill_levels, spread_plan

DOC = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(0)).tolist()
QUESTION = [5, 17, 99, 3, 42, 7, 8]
STEPS = 33
GREEDY = dict(max_new_tokens=STEPS, stop_token_ids=[], keep_logits=True)


def answer(engine, document, question=QUESTION, **kwargs):
    generation = engine.generate(document, question, **{**GREEDY, **kwargs})
    "".join(generation)
    return generation.result


@pytest.fixture(scope="module")
def reference():
    """One process: the document, its whole cache, a greedy and a sampled answer."""
    engine = Engine("tiny", dtype="float32")
    document = engine.ingest(DOC, chunk_tokens=64)
    cache = document.cache
    greedy = answer(engine, document)
    sampled = answer(engine, document, temperature=0.8, top_k=40, seed=7)
    return {"engine": engine, "document": document, "cache": cache, "greedy": greedy, "sampled": sampled}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"decode{n}")
def split_engine(request):
    with Engine("tiny", nproc=4, dtype="float32", decode_ranks=request.param, chunk_tokens=64) as engine:
        yield engine


def assert_same_logits(result, expected):
    assert result.token_ids == expected.token_ids
    assert len(result.step_logits) == len(expected.step_logits) == STEPS
    for got, want in zip(result.step_logits, expected.step_logits):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def assert_same_cache(cache, ref, length):
    assert cache.length == length
    for layer in range(ref.n_layers):
        torch.testing.assert_close(cache.k[layer][:length], ref.k[layer][:length], atol=2e-5, rtol=0)
        torch.testing.assert_close(cache.v[layer][:length], ref.v[layer][:length], atol=2e-5, rtol=0)


def test_hand_off_moves_only_the_other_ranks_rows_and_levels_the_slices(split_engine, reference):
    n = split_engine.decode_ranks
    document = split_engine.ingest(DOC)
    stats = document.stats
    rows = stats.decode_slice_rows_per_rank
    assert sum(rows) == len(DOC) and rows[n:] == [0] * (4 - n)
    assert max(rows[:n]) - min(rows[:n]) <= 64  # within one chunk of total / N
    kv_bytes = [r * document.cache.bytes_per_token for r in rows[:n]]
    assert abs(kv_bytes[0] - len(DOC) * document.cache.bytes_per_token / n) <= 64 * document.cache.bytes_per_token
    # Decode ranks keep their shards (they send nothing); the others send exactly their rows.
    shard_rows = [b // document.cache.bytes_per_token for b in stats.kv_shard_bytes_per_rank]
    if n == 1:
        assert stats.handoff_bytes_per_rank[0] == 0 and min(stats.handoff_bytes_per_rank[1:]) > 0
    else:
        assert stats.handoff_bytes_per_rank[:n] == [0] * n
        for r in range(n, 4):
            assert stats.handoff_bytes_per_rank[r] == shard_rows[r] * document.cache.bytes_per_token
    assert stats.handoff_cross_host_bytes_per_rank == [0] * 4  # one host
    assert_same_cache(split_engine.whole_cache(document), reference["cache"], len(DOC))
    split_engine.drop_document(document)


def test_greedy_and_sampled_answers_equal_one_rank(split_engine, reference):
    document = split_engine.ingest(DOC)
    greedy = answer(split_engine, document)
    assert_same_logits(greedy, reference["greedy"])
    sampled = answer(split_engine, document, temperature=0.8, top_k=40, seed=7)
    assert sampled.token_ids == reference["sampled"].token_ids
    # Questions do not see each other: the same question again gives the same answer.
    assert answer(split_engine, document).token_ids == greedy.token_ids
    split_engine.drop_document(document)


def test_slices_stay_level_as_the_answer_grows(split_engine):
    document = split_engine.ingest(DOC)
    before = split_engine.document_rows(document)
    answer(split_engine, document)
    after = split_engine.document_rows(document)
    grown = [a - b for a, b in zip(after, before)]
    assert sum(grown) == len(QUESTION) + STEPS - 1  # the last sampled token is never fed back
    assert max(after) - min(after) <= max(1, max(before) - min(before))
    if split_engine.decode_ranks > 1:
        assert max(grown) - min(grown) <= len(QUESTION)  # steps go round the ranks
    split_engine.drop_document(document)


def test_bad_decode_settings_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="decode_ranks=3 asks for more ranks than this 2-rank job"):
        Engine("tiny", nproc=2, decode_ranks=3)
    with pytest.raises(ValueError, match="decode_ranks must be a positive number"):
        Engine("tiny", nproc=2, decode_ranks=0)
    with pytest.raises(ValueError, match="unknown kv_dtype 'int4'"):
        Engine("tiny", kv_dtype="int4")


def test_spread_plan_levels_decode_ranks_and_feeds_them_at_once():
    assert fill_levels([10, 12, 11], 5) == [3, 1, 1]
    plan = spread_plan([40, 40, 40, 40], [0, 1])
    assert [(t.src, t.dst, t.n) for t in plan] == [(2, 0, 40), (3, 1, 40)]  # both receive at once
    for rows, decode in (([41, 40, 40, 39], [0, 1, 2]), ([7, 0, 5, 9, 3], [1, 2]), ([5, 5], [0])):
        plan = spread_plan(rows, decode)
        got = {d: sum(t.n for t in plan if t.dst == d) for d in decode}
        final = {d: rows[d] + got[d] for d in decode}
        assert sum(final.values()) == sum(rows)
        assert all(final[d] <= min(final.values()) + 1 for d in decode if got[d])  # raised to one level
        for src in set(range(len(rows))) - set(decode):
            assert sum(t.n for t in plan if t.src == src) == rows[src]


def test_an_unread_answer_is_ended_by_the_next_question(split_engine, reference):
    document = split_engine.ingest(DOC)
    unread = split_engine.generate(document, QUESTION, **GREEDY)  # the other ranks wait in it
    assert_same_logits(answer(split_engine, document), reference["greedy"])
    if split_engine.decode_ranks > 1:
        with pytest.raises(ValueError, match="ended by a newer question"):
            list(unread)
    assert_same_logits(answer(split_engine, document), reference["greedy"])  # the engine is still usable


def test_documents_the_caller_lets_go_of_are_dropped_on_every_rank(split_engine):
    import gc

    gone = split_engine.ingest(DOC).id  # the caller keeps no reference: gone at once here
    gc.collect()
    assert gone not in split_engine._documents
    if split_engine.mode == "spawn":
        assert gone in split_engine._forgotten
    document = split_engine.ingest(DOC)  # this command first tells the workers to drop theirs
    assert split_engine._forgotten == [] and list(split_engine._documents) == [document.id]


def test_extend_prefills_on_top_of_the_split_document_like_one_rank(split_engine, reference):
    """A document extended on its decode ranks equals one process's prefill of the whole text: the
    cache, the answer; an answer's rows are dropped first; a short follow-up goes pass-Q."""
    head, tail = DOC[:237], DOC[237:]
    document = split_engine.ingest(head)
    answer(split_engine, document)  # rows that extend must drop
    stats = split_engine.extend(document, tail)
    assert document.length == len(DOC) and document.token_ids.tolist() == DOC
    assert stats.cached == len(head) and sum(c.tokens for c in stats.chunks) == len(tail)
    assert sum(split_engine.document_rows(document)) == len(DOC)
    assert_same_cache(split_engine.whole_cache(document), reference["cache"], len(DOC))
    assert_same_logits(answer(split_engine, document), reference["greedy"])
    if split_engine.decode_ranks > 1:  # 64 new tokens on 237 cached: the query is the cheaper to pass
        assert [c.strategy for c in stats.chunks] == ["pass-q"]
    with pytest.raises(ValueError, match="nothing to extend the document with"):
        split_engine.extend(document, [])
    split_engine.drop_document(document)
