"""The engine on Gemma 4's dense text model (tests/model/test_model_gemma4.py's tiny one: windows of
8, keys as values, proportional RoPE, v norms, block scalars) against transformers: prefills at
W = 1-3 with pass-KV and pass-Q forced and chunk edges inside windows; a document split over two
decode ranks answering greedily as transformers does, alone and batched."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import rel_err
from tests.model.test_model_gemma4 import random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4")
    hf = random_hf_model("gemma4-keqv-bias")
    hf.save_pretrained(directory)
    return str(directory), hf


def prompt(n, seed=1):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_prefill_matches_transformers(saved, world):
    directory, hf = saved
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        for n, chunk in ((9, 64), (97, 37)):
            ids = prompt(n)
            with torch.no_grad():
                ref = hf(ids[None]).logits[0, -1:]
            for strategy in ("pass-kv", "pass-q"):
                result = engine.prefill(ids, chunk_tokens=chunk, strategy=strategy)
                assert rel_err(result.logits, ref) < 1e-4, (world, n, strategy)


def reference_answer(hf, ids, n=8):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved):
    directory, hf = saved
    document = prompt(100, seed=3).tolist()
    questions = [[7, 11, 13], [5, 9]]
    with Engine(directory, nproc=2, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        a = engine.ingest(document)
        alone = engine.generate(a, questions[0], max_new_tokens=8, stop_token_ids=[])
        "".join(alone)
        assert alone.result.token_ids == reference_answer(hf, document + questions[0])
        many = engine.ask_many(a, questions, max_new_tokens=8, stop_token_ids=[])
        for _ in many:
            pass
        for q, result in zip(questions, many.results):
            assert result.token_ids == reference_answer(hf, document + q), q
