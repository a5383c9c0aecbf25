"""The engine on linear-attention hybrids (tests/model/test_model_qwen3_5.py's tiny Qwen3.5, Qwen3.5
MoE and Qwen3-Next) against transformers: a Gated DeltaNet layer's state crosses the CP ranks in two
exchanges per chunk (runtime/linear_layers.py) instead of a KV ring, the decode ranks advance it
alike, documents carry it.

- prefills at W = 1 to 4, pass-KV and pass-Q forced for the attention layers: prompts shorter than
  the ranks' pieces x the convolution's width (5 tokens over 8 pieces: empty and one-token pieces),
  chunk boundaries inside pieces (97 tokens in chunks of 37), one chunk;
- a document over 3 ranks split over 2 decode ranks, answering as transformers' greedy generate
  does, alone and batched (each question from a copy of the document's state);
- tensor parallelism 2 (key heads and their value heads split); the MoE's experts over 2 EP ranks;
- the state relayed over the ring instead of all-gathered (`linear_exchange="ring"`);
- a document saved by 2 decode ranks and by TP 2, loaded on 1 and 2 decode ranks and at TP 2;
- bad input: a document of another model's states, a recurrence ringctx does not compute."""

import json
import shutil

import pytest

from ringctx.engine import Engine
from tests.helpers import (assert_engine_answers_match, assert_engine_prefills_match,
                           assert_tp2_prefill_and_answer_equal_transformers, hf_greedy, random_prompt)
from tests.model.test_model_qwen3_5 import random_hf_model

CASES = ((5, 64), (97, 37), (150, 150))
QUESTIONS = [[7, 11, 13], [5, 9], [21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (directory, transformers model), each saved once."""
    out = {}

    def get(name):
        if name not in out:
            directory = tmp_path_factory.mktemp(name)
            hf = random_hf_model(name)
            hf.save_pretrained(directory)
            out[name] = (str(directory), hf)
        return out[name]
    return get


@pytest.mark.parametrize("name,world,ep", [("qwen3.5", 1, 1), ("qwen3.5", 4, 1), ("qwen3.5-moe", 2, 2),
                                           ("qwen3-next", 3, 1)], ids=lambda v: str(v))
def test_prefill_matches_transformers(saved, name, world, ep):
    """(The MoE's experts spread over its 2 ranks: --ep 2.)"""
    directory, hf = saved(name)
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=ep, ep=ep) as engine:
        assert_engine_prefills_match(engine, hf, CASES, (name, world))


def test_answers_on_split_decode_ranks_and_batched_and_saved_documents(saved, tmp_path):
    """One engine of 3 ranks, 2 decode ranks: answers alone and batched, repeated (the document's
    state is never written by a question), then the document saved; loaded on 1 and 2 decode ranks."""
    directory, hf = saved("qwen3.5")
    document = random_prompt(100, seed=3).tolist()
    with Engine(directory, nproc=3, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        doc = engine.ingest(document)
        assert_engine_answers_match(engine, hf, doc, document, QUESTIONS)
        again = engine.generate(doc, QUESTIONS[0], max_new_tokens=8, stop_token_ids=[])
        "".join(again)
        assert again.result.token_ids == hf_greedy(hf, document + QUESTIONS[0])
        engine.save_document(doc, str(tmp_path / "doc.kv"))
    want = hf_greedy(hf, document + QUESTIONS[1])
    for ranks in (1, 2):
        with Engine(directory, nproc=ranks, dtype="float32", decode_ranks=ranks) as engine:
            answer = engine.generate(engine.load_document(str(tmp_path / "doc.kv")), QUESTIONS[1], max_new_tokens=8,
                                     stop_token_ids=[])
            "".join(answer)
            assert answer.result.token_ids == want, ranks


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next"])
def test_tensor_parallel_prefill_and_answer_match_transformers(saved, name):
    directory, hf = saved(name)
    assert_tp2_prefill_and_answer_equal_transformers(directory, hf, name)


def test_tensor_parallel_document_loads_at_other_sizes(saved, tmp_path):
    """A document saved at TP 2 (each TP rank its key heads of the states) answers at TP 1 and 2."""
    directory, hf = saved("qwen3.5")
    document = random_prompt(90, seed=4).tolist()
    want = hf_greedy(hf, document + QUESTIONS[2])
    with Engine(directory, nproc=2, tp=2, dtype="float32") as engine:
        engine.save_document(engine.ingest(document), str(tmp_path / "tp.kv"))
        answer = engine.generate(engine.load_document(str(tmp_path / "tp.kv")), QUESTIONS[2], max_new_tokens=8,
                                 stop_token_ids=[])
        "".join(answer)
        assert answer.result.token_ids == want
    with Engine(directory, nproc=1, dtype="float32") as engine:
        answer = engine.generate(engine.load_document(str(tmp_path / "tp.kv")), QUESTIONS[2], max_new_tokens=8,
                                 stop_token_ids=[])
        "".join(answer)
        assert answer.result.token_ids == want


def test_a_document_of_other_states_is_one_line(saved, tmp_path):
    """States whose shapes the model does not have (the manifest altered to pass the fingerprint
    check: what a file of another model's states would look like): one line, before any answer."""
    directory, _ = saved("qwen3.5")
    with Engine(directory, nproc=1, dtype="float32") as engine:
        engine.save_document(engine.ingest(random_prompt(40).tolist()), str(tmp_path / "doc.kv"))
        other = tmp_path / "other.kv"
        shutil.copytree(tmp_path / "doc.kv", other)
        manifest = json.loads((other / "manifest.json").read_text())
        manifest["slices"][0]["linear_tp"] = [2, 0]  # half the heads of every state, as a TP 2 part would hold
        (other / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match="linear-attention states do not match the model") as info:
            engine.load_document(str(other))
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["kimi_linear", "minimax", "mamba2"])
def test_other_recurrences_are_refused_in_one_line(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 32}))
    with pytest.raises(ValueError, match="not supported yet: of the linear-attention hybrids") as info:
        with Engine(str(tmp_path), nproc=1, dtype="float32"):
            pass
    assert "\n" not in str(info.value)


def test_the_ring_relay_of_states_answers_as_the_all_gather(saved):
    """linear_exchange="ring" (what `plan` picks for large states on many ranks): the prefill's
    logits and a document's answer equal transformers' as the all-gather's do."""
    directory, hf = saved("qwen3-next")
    document = random_prompt(97, seed=5).tolist()
    with Engine(directory, nproc=3, dtype="float32", decode_ranks=2, chunk_tokens=37,
                linear_exchange="ring") as engine:
        assert_engine_prefills_match(engine, hf, CASES[:2], "ring")
        answer = engine.generate(engine.ingest(document), QUESTIONS[0], max_new_tokens=8, stop_token_ids=[])
        "".join(answer)
        assert answer.result.token_ids == hf_greedy(hf, document + QUESTIONS[0])
