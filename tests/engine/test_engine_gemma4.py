"""The engine on Gemma 4's dense text model with the 31B's layout in small (tests/model/
test_model_gemma4.py's "gemma4-heads": windows of 8, full layers with their own head shape, 32-dim
heads and one KV head against the sliding layers' 16 and two, keys as values, proportional RoPE,
v norms, block scalars) against transformers: prefills at W = 1-3 with pass-KV and pass-Q forced
and chunk edges inside windows; a document split over two decode ranks answering greedily as
transformers does, alone and batched, saved and loaded on 1 and 2 decode ranks; an 8-bit cache;
tensor parallelism over heads whose count differs by layer."""

import pytest
import torch

from ringctx.engine import Engine
from ringctx.runtime.documents import read_manifest
from tests.helpers import (assert_engine_answers_match, assert_engine_prefills_match, hf_greedy, random_prompt,
                           rel_err)
from tests.model.test_model_gemma4 import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4")
    hf = random_hf_model("gemma4-heads")
    hf.save_pretrained(directory)
    return str(directory), hf


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    directory, hf = saved
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        assert_engine_prefills_match(engine, hf, ((9, 64), (97, 37)), world)


def test_answers_on_split_decode_ranks_batched_and_reloaded_equal_transformers(saved, tmp_path):
    directory, hf = saved
    document = random_prompt(100, seed=3).tolist()
    questions = [[7, 11, 13], [5, 9]]
    with Engine(directory, nproc=2, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        a = engine.ingest(document)
        assert a.cache.shapes[5] == (1, 32) and a.cache.shapes[0] == (2, 16)
        assert_engine_answers_match(engine, hf, a, document, questions)
        engine.save_document(a, tmp_path / "a.kv")
    for nproc, ranks in ((1, 1), (2, 2)):
        with Engine(directory, nproc=nproc, dtype="float32", decode_ranks=ranks) as engine:
            loaded = engine.load_document(tmp_path / "a.kv")
            again = engine.generate(loaded, questions[1], max_new_tokens=8, stop_token_ids=[])
            "".join(again)
            assert again.result.token_ids == hf_greedy(hf, document + questions[1]), nproc


def test_8bit_cache_and_tensor_parallel(saved, tmp_path):
    """TP 2 splits the sliding layers' two KV heads one per rank and replicates the full layers'
    one; an int8 cache stores each layer's rows at its own width."""
    directory, hf = saved
    ids = random_prompt(97)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1:]
    document = random_prompt(60, seed=4).tolist()
    question = [5, 9]
    want = hf_greedy(hf, document + question)
    with Engine(directory, nproc=2, tp=2, dtype="float32") as engine:
        assert rel_err(engine.prefill(ids, chunk_tokens=37).logits, ref) < 1e-4
        doc = engine.ingest(document)
        answer = engine.generate(doc, question, max_new_tokens=8, stop_token_ids=[])
        "".join(answer)
        assert answer.result.token_ids == want
        engine.save_document(doc, tmp_path / "tp.kv")
    # both TP ranks wrote a part (the sliding layers' heads differ), the full layers' one head twice
    parts = read_manifest(tmp_path / "tp.kv")["slices"][0]["parts"]
    assert [p["layer_heads"][5] for p in parts] == [[0, 1], [0, 1]]
    assert [p["layer_heads"][0] for p in parts] == [[0, 1], [1, 2]]
    for tp in (1, 2):  # loaded whole, and split over two TP ranks again
        with Engine(directory, nproc=tp, tp=tp, dtype="float32") as engine:
            answer = engine.generate(engine.load_document(tmp_path / "tp.kv"), question, max_new_tokens=8,
                                     stop_token_ids=[])
            "".join(answer)
            assert answer.result.token_ids == want, tp
    answers = []
    for ranks in (1, 2):
        with Engine(directory, nproc=2, dtype="float32", kv_dtype="int8", decode_ranks=ranks) as engine:
            doc = engine.ingest(document)
            assert doc.cache.k[5].dtype == torch.int8 and doc.cache.k[5].shape[1:] == (1, 32)
            assert doc.cache.k[0].shape[1:] == (2, 16) and doc.cache.k_scale[5].shape[1:] == (1,)
            answer = engine.generate(doc, [5, 9], max_new_tokens=6, stop_token_ids=[])
            "".join(answer)
            answers.append(answer.result.token_ids)
    assert answers[0] == answers[1]
