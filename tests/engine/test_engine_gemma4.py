"""The engine on Gemma 4's dense text model (tests/model/test_model_gemma4.py's tiny one: windows of
8, keys as values, proportional RoPE, v norms, block scalars) against transformers: prefills at
W = 1-3 with pass-KV and pass-Q forced and chunk edges inside windows; a document split over two
decode ranks answering greedily as transformers does, alone and batched."""

import pytest

from ringctx.engine import Engine
from tests.helpers import assert_engine_answers_match, assert_engine_prefills_match, random_prompt
from tests.model.test_model_gemma4 import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4")
    hf = random_hf_model("gemma4-keqv-bias")
    hf.save_pretrained(directory)
    return str(directory), hf


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    directory, hf = saved
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        assert_engine_prefills_match(engine, hf, ((9, 64), (97, 37)), world)


def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved):
    directory, hf = saved
    document = random_prompt(100, seed=3).tolist()
    questions = [[7, 11, 13], [5, 9]]
    with Engine(directory, nproc=2, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        a = engine.ingest(document)
        assert_engine_answers_match(engine, hf, a, document, questions)
