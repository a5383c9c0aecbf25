"""Rows kept past a question (runtime/batch.py, model/kvcache.py): sorted, viewed, lent, joined.

A view of a document's first tokens shares its storage; a question asked on the view writes past
its rows into the document's storage and puts them back. So a view answers exactly as a copy of
the same rows (the same rows in the same order: the same bits), and the document it came from
answers afterwards exactly as before, on one and two decode ranks and in 8-bit caches.
"""

from __future__ import annotations

import pytest
import torch

from ringctx import Engine
from ringctx.model import KVCache
from ringctx.runtime.batch import LentRows, append_rows, joined_rows, prefix_rows


def sliced_cache(positions: list[int], kv_dtype: str = "model") -> KVCache:
    cache = KVCache(2, len(positions) + 4, 2, 8, dtype=torch.float32, kv_dtype=kv_dtype, sliced=True)
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        k = torch.randn(len(positions), 2, 8, generator=g)
        cache.update(layer, 0, k, k * 2)
    cache.positions[:len(positions)] = torch.tensor(positions)
    cache.length = len(positions)
    return cache


def rows_by_position(cache: KVCache) -> dict[int, torch.Tensor]:
    return {int(p): cache.keys(0)[i].clone() for i, p in enumerate(cache.row_positions())}


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_sorting_viewing_and_lending_keep_every_row(kv_dtype):
    cache = sliced_cache([5, 1, 9, 3, 7, 0], kv_dtype)
    assert not cache.in_position_order()
    with pytest.raises(ValueError, match="position order"):
        cache.view_below(4)
    before = rows_by_position(cache)
    ordered = cache.sorted_by_position()
    assert ordered.row_positions().tolist() == [0, 1, 3, 5, 7, 9]
    after = rows_by_position(ordered)
    assert all(torch.equal(before[p], after[p]) for p in before)
    view = ordered.view_below(5)
    assert view.length == 3 and view.row_positions().tolist() == [0, 1, 3]
    assert view.k[0].data_ptr() == ordered.k[0].data_ptr()  # nothing copied
    lent = LentRows(view, view.length, 2)
    view.update(0, 3, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))  # a join writes past the view
    assert not torch.equal(ordered.keys(0)[3], after[5])
    lent.give_back()
    assert torch.equal(ordered.keys(0)[3], after[5]) and torch.equal(ordered.keys(0)[4], after[7])


def test_prefix_append_and_join_keep_positions():
    cache = sliced_cache([5, 1, 9, 3, 7, 0])
    rows = rows_by_position(cache)
    first = prefix_rows(cache, 6, room=2)
    assert first.row_positions().tolist() == [5, 1, 3, 0]  # below 6, in their order
    more = sliced_cache([10, 11])
    joined = joined_rows(first, more, room=1)
    assert joined.row_positions().tolist() == [5, 1, 3, 0, 10, 11] and joined.max_tokens >= 7
    assert all(torch.equal(joined.keys(0)[i], rows[p]) for i, p in enumerate([5, 1, 3, 0]))
    whole = KVCache(2, 8, 2, 8, dtype=torch.float32)  # in sequence order (no positions)
    whole.update(0, 0, torch.ones(3, 2, 8), torch.ones(3, 2, 8))
    whole.length = 3
    with pytest.raises(ValueError, match="continue"):
        append_rows(whole, sliced_cache([7]), room=1)
    assert append_rows(whole, sliced_cache([3]), room=1).length == 4


@pytest.fixture(scope="module", params=[(1, "model"), (2, "model"), (2, "int8")], ids=["1-rank", "2-ranks", "2-int8"])
def engine(request):
    nproc, kv_dtype = request.param
    with Engine("tiny", dtype="float32", nproc=nproc, kv_dtype=kv_dtype, chunk_tokens=48, timeout_s=60) as built:
        yield built


def answer(engine, document, question, n=5):
    batch = engine.batch()
    member = batch.join(document, question, max_new_tokens=n, keep_logits=True)
    while not member.left:
        batch.step()
    return member.result


def test_a_view_answers_as_a_copy_and_leaves_its_document_as_it_was(engine):
    ids = torch.randint(1, 250, (150,), generator=torch.Generator().manual_seed(1))
    document = engine.prefill(ids, as_document=True).document
    before = answer(engine, document, [3, 4, 5])
    view = engine.document_prefix(document, 97, view=True)
    copy = engine.document_prefix(document, 97)
    on_view, on_copy = answer(engine, view, [8, 9, 10, 11]), answer(engine, copy, [8, 9, 10, 11])
    assert on_view.token_ids == on_copy.token_ids
    assert all(torch.equal(a, b) for a, b in zip(on_view.step_logits, on_copy.step_logits))
    again = answer(engine, document, [3, 4, 5])  # the view's question wrote past it and put the rows back
    assert again.token_ids == before.token_ids
    assert all(torch.equal(a, b) for a, b in zip(again.step_logits, before.step_logits))
    assert "".join(engine.generate(view, [8, 9], max_new_tokens=3)) is not None  # an answer alone copies it
    assert answer(engine, document, [3, 4, 5]).token_ids == before.token_ids


def test_prefix_view_sorts_a_slice_nobody_reads_and_copies_one_being_read():
    from types import SimpleNamespace

    from ringctx.runtime.commands import document_prefix
    from ringctx.runtime.document import Document

    def document():
        return Document(cache=sliced_cache([5, 1, 9, 3, 7, 0]), token_ids=torch.arange(10), id=1)

    idle = document()
    state = SimpleNamespace(documents={}, batch=None)
    view = document_prefix(state, 1, 6, 2, 0, True, document=idle)
    assert view.borrowed and idle.cache.in_position_order() and view.cache.row_positions().tolist() == [0, 1, 3, 5]
    read = document()
    state.batch = SimpleNamespace(sequences={7: SimpleNamespace(document=read)})
    copy = document_prefix(state, 1, 6, 3, 0, True, document=read)
    assert not copy.borrowed and not read.cache.in_position_order()  # a question reads it: its rows stay put
    assert sorted(copy.cache.row_positions().tolist()) == [0, 1, 3, 5]
