"""The engine on mixtures of experts (tests/model/test_model_moe.py's tiny Mixtral and Qwen3-MoE with
dense and sparse layers mixed) against transformers: prefills at W = 1-3 with pass-KV and pass-Q
forced (short prompts leave ranks without tokens: their expert blocks run on 0 rows); documents on
one decode rank or split over two, answered greedily alone and batched (ask_many: each step's rows
routed to different experts); tensor parallelism 2 (every expert's width split, the router whole).
The fused CPU decode and prefill steps decline expert layers, so these run the layer path."""

import pytest

from ringctx.engine import Engine
from tests.helpers import (SavedHFModels, assert_engine_prefills_match,
                           assert_tp2_prefill_and_answer_equal_transformers,
                           assert_two_documents_answer_as_transformers, hf_greedy, random_prompt)
from tests.model.test_model_moe import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return SavedHFModels(random_hf_model, tmp_path_factory)


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    """Both families in one engine start each (the Qwen3-MoE case mixes dense and sparse layers)."""
    for case in ("qwen3-moe-step", "mixtral-window"):
        directory, hf = saved[case]
        with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
            assert_engine_prefills_match(engine, hf, ((5, 64), (97, 37)), (case, world))


@pytest.mark.parametrize("case,world,decode_ranks", [("qwen3-moe-norm", 2, 2), ("mixtral", 3, 2),
                                                     ("qwen3-moe-step", 2, 1)])
def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved, case, world, decode_ranks, tmp_path):
    """A 130-token document on one decode rank or split over two, greedy answers alone and batched
    (questions of different lengths), and a second document answered beside it, then saved and
    loaded back (its manifest's config carries the experts)."""
    directory, hf = saved[case]
    doc_a, doc_b = random_prompt(130, seed=3).tolist(), random_prompt(70, seed=4).tolist()
    questions = [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25, 26, 27, 28, 29]]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=decode_ranks, chunk_tokens=32) as engine:
        a, b = assert_two_documents_answer_as_transformers(engine, hf, doc_a, doc_b, questions)
        engine.save_document(b, str(tmp_path / "b.kv"))
        loaded = engine.load_document(str(tmp_path / "b.kv"))
        again = engine.generate(loaded, questions[2], max_new_tokens=8, stop_token_ids=[])
        "".join(again)
        assert again.result.token_ids == hf_greedy(hf, doc_b + questions[2])


def test_tensor_parallel_prefill_and_answer_match_transformers(saved):
    """TP 2 splits every expert's hidden units (3 of 5 experts a token, widths 24 / 32 split 12 / 16
    a rank) and the dense layers' MLP; the experts' partial outputs join the MLP's all-reduce."""
    for case in ("qwen3-moe-step", "mixtral"):
        directory, hf = saved[case]
        assert_tp2_prefill_and_answer_equal_transformers(directory, hf, case)
