"""The engine on Llama 4's mixture of experts (tests/model/test_model_llama4_moe.py's tiny models:
experts on layers 1 and 3 of 4, 4 experts top 1 by the sigmoid router scaling their inputs, a
shared expert; or experts on 3 layers, top 2, from the multimodal checkpoint) against
transformers: prefills at W = 1 and 3 with pass-KV and pass-Q forced (a short prompt leaves ranks
without tokens: their expert blocks run on 0 rows); a document on one decode rank or split over
two, answered greedily alone and batched (each step's rows routed to different experts); tensor
parallelism 2 (every expert's and the shared expert's width split, the router whole). The fused
CPU decode and prefill steps decline expert layers, so these run the layer path."""

import pytest

from ringctx.engine import Engine
from tests.helpers import (SavedHFModels, assert_engine_prefills_match,
                           assert_tp2_prefill_and_answer_equal_transformers,
                           assert_two_documents_answer_as_transformers, random_prompt)
from tests.model.test_model_llama4_moe import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return SavedHFModels(random_hf_model, tmp_path_factory)


@pytest.mark.parametrize("world", [1, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    """Chunk edges inside the attention chunks of 16; top 1 on two MoE layers, top 2 on three."""
    for case in ("llama4-moe", "llama4-moe-top2"):
        directory, hf = saved[case]
        with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
            assert_engine_prefills_match(engine, hf, ((5, 64), (97, 37)), (case, world))


@pytest.mark.parametrize("case,world,decode_ranks", [("llama4-moe", 3, 2), ("llama4-moe-vlm", 2, 1)])
def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved, case, world, decode_ranks):
    """A 130-token document on one decode rank or split over two, greedy answers alone and batched
    (questions of different lengths), and a second document answered beside it."""
    directory, hf = saved[case]
    doc_a, doc_b = random_prompt(130, seed=3).tolist(), random_prompt(70, seed=4).tolist()
    questions = [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25, 26, 27, 28, 29]]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=decode_ranks, chunk_tokens=32) as engine:
        assert_two_documents_answer_as_transformers(engine, hf, doc_a, doc_b, questions)


def test_tensor_parallel_prefill_and_answer_match_transformers(saved):
    """TP 2 splits every expert's 32 hidden units and the shared expert's 16 / 16, the dense layers'
    MLP 48 / 48; the shared and routed partial outputs join one all-reduce."""
    directory, hf = saved["llama4-moe-top2"]
    assert_tp2_prefill_and_answer_equal_transformers(directory, hf)
