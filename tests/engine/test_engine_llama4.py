"""The engine on Llama 4's attention (tests/model/test_model_llama4.py's tiny dense model: chunks
of 16 on the RoPE layers with q/k norms after RoPE, a NoPE layer whose query temperature steps
every 8 positions) against transformers: prefills at W = 1-3 with pass-KV and pass-Q forced, in
chunks whose edges fall inside the attention chunks (each rank's queries warmed by their global
positions); a document split over two decode ranks answering greedily as transformers does,
alone and batched (ask_many: rows at different positions in one step); tensor parallelism."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import (assert_engine_prefills_match, assert_two_documents_answer_as_transformers, random_prompt,
                           rel_err)
from tests.model.test_model_llama4 import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama4")
    hf = random_hf_model("llama4-text")
    hf.save_pretrained(directory)
    return str(directory), hf


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    directory, hf = saved
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        assert_engine_prefills_match(engine, hf, ((9, 64), (97, 37), (150, 29)), world)


@pytest.mark.parametrize("world,decode_ranks", [(2, 1), (2, 2), (3, 2)])
def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved, world, decode_ranks):
    """A 130-token document on one decode rank or split over two, greedy answers alone and batched
    (questions of different lengths: the rows of a batched step sit at different positions, so
    their temperatures differ)."""
    directory, hf = saved
    doc_a, doc_b = random_prompt(130, seed=3).tolist(), random_prompt(70, seed=4).tolist()
    questions = [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25, 26, 27, 28, 29]]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=decode_ranks, chunk_tokens=32) as engine:
        a, b = assert_two_documents_answer_as_transformers(engine, hf, doc_a, doc_b, questions)


def test_tensor_parallel_prefill_matches_transformers(saved):
    """TP 2 splits the heads (each rank's q/k rows permuted within its heads); the q/k norms and
    the temperature are per head and per token."""
    directory, hf = saved
    ids = random_prompt(97)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1:]
    with Engine(directory, nproc=2, tp=2, dtype="float32") as engine:
        assert rel_err(engine.prefill(ids, chunk_tokens=37).logits, ref) < 1e-4
