"""The embedded SmolLM2-135M (9 query / 3 KV heads) at tp = 3, every rank reading only its slices
of the GGUF file: logits equal tp = 1's to 1e-4 relative, and the fact hidden in a long document
is found."""

import pytest

from ringctx.engine import Engine
from tests.engine.test_engine_smollm2 import QUESTION, long_document
from tests.helpers import rel_err


@pytest.fixture(scope="module")
def engine_tp3():
    with Engine("smollm2-135m", nproc=3, tp=3, dtype="float32", chunk_tokens=1024) as engine:
        yield engine


def test_tp3_logits_equal_tp1(engine_tp3):
    single = Engine("smollm2-135m", dtype="float32")
    ids = single.model.tokenizer(long_document(40))["input_ids"]
    want = single.prefill(ids, chunk_tokens=len(ids))
    got = engine_tp3.prefill(ids, chunk_tokens=97, as_document=True)
    assert got.stats.tp_size == 3 and got.stats.cp_size == 1 and len(got.stats.chunks) > 1
    assert rel_err(got.logits, want.logits) < 1e-4
    whole = engine_tp3.whole_cache(got.document)
    for layer in (0, 29):
        assert rel_err(whole.k[layer][:len(ids)], want.cache.k[layer][:len(ids)]) < 1e-4
        assert rel_err(whole.v[layer][:len(ids)], want.cache.v[layer][:len(ids)]) < 1e-4


def test_tp3_finds_the_needle(engine_tp3):
    document = engine_tp3.ingest(long_document())
    assert document.length > 3000
    answer = engine_tp3.ask(document, QUESTION, max_new_tokens=24)
    assert "7492" in answer, answer
