"""The engine on Gemma 4 26B-A4B's layout in small (tests/model/test_model_gemma4_moe.py's
"gemma4-moe-keqv": on every layer a dense GeGLU MLP beside 5 experts, top 3, routed by
Gemma4TextRouter; windows of 8, full layers with their own head shape, keys as values) against
transformers: prefills at W = 1 and 3 with pass-KV and pass-Q forced (a short prompt leaves ranks
without tokens: their blocks run on 0 rows); a document over 3 ranks, split over two decode ranks,
answering greedily as transformers' generate does, alone and batched; tensor parallelism 2 (the
dense MLP's and every expert's width split, the router and its scales whole)."""

import pytest

from ringctx.engine import Engine
from tests.helpers import (assert_engine_answers_match, assert_engine_prefills_match,
                           assert_tp2_prefill_and_answer_equal_transformers, random_prompt)
from tests.model.test_model_gemma4_moe import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4-moe")
    hf = random_hf_model("gemma4-moe-keqv")
    hf.save_pretrained(directory)
    return str(directory), hf


@pytest.mark.parametrize("world", [1, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    directory, hf = saved
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        assert_engine_prefills_match(engine, hf, ((5, 64), (97, 37)), world)


def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved):
    directory, hf = saved
    document = random_prompt(100, seed=3).tolist()
    questions = [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25]]
    with Engine(directory, nproc=3, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        assert_engine_answers_match(engine, hf, engine.ingest(document), document, questions)


def test_tensor_parallel_prefill_and_answer_match_transformers(saved):
    directory, hf = saved
    assert_tp2_prefill_and_answer_equal_transformers(directory, hf)


def test_bad_experts_are_one_line_before_any_rank_computes(saved, tmp_path):
    """An expert count the tensors disagree with: the ranks' load fails, the Engine raises that
    one line (no prefill ran)."""
    import json
    import shutil

    directory, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_experts": 4}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d\.[\w.]+' has shape \(5.*\), but the model "
                                         r"config needs \(4.*\)") as info:
        with Engine(str(bad), nproc=2, dtype="float32"):
            pass
    assert "\n" not in str(info.value)
