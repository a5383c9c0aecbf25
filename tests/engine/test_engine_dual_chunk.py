"""The engine on a tiny Qwen2 with Dual Chunk Attention (chunk_size 16, local_size 4: chunk_len
12; length scaling past 24 tokens): ring prefills at W = 1-3 with chunks whose pieces cross DCA
chunk boundaries (pass-Q requested, pass-KV run: ring_attention declines pass-Q for DCA) against
the float64 forward; a document split over decode ranks answering greedily alone and batched,
every token equal to the float64 reference's greedy choice with vLLM's per-token length factors
(the document's keys keep its length's factor, the question's tokens the whole prompt's)."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import rel_err
from ringctx.attention.dual_chunk import DualChunk
from tests.model.test_dual_chunk_model import DCA, prompt_factors, random_qwen2, reference_logits, save_with_dca
from tests.model.test_model_families import prompt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-dca")
    hf = random_qwen2(seed=1)
    save_with_dca(hf, directory)
    return str(directory), hf


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_ring_prefill_matches_float64_reference(saved, world):
    directory, hf = saved
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        for n, chunk in ((9, 64), (70, 29)):
            ids = prompt(n, seed=n)
            ref = reference_logits(hf, ids, prompt_factors(n, n))[-1:].float()
            for strategy in ("auto", "pass-q"):
                result = engine.prefill(ids, chunk_tokens=chunk, strategy=strategy)
                assert rel_err(result.logits, ref) < 1e-5, (world, n, strategy)
                if world > 1:
                    assert {c.strategy for c in result.stats.chunks} == {"pass-kv"}


def reference_answer(hf, document, question, n=6):
    """Greedy tokens of the float64 reference: the document prefilled alone (its length's factor),
    then the question (the whole prompt's), then each answer token (its position + 1)."""
    dca = DualChunk(**{"chunk_size": DCA["chunk_size"], "local_size": DCA["local_size"],
                       "original_max_position": DCA["original_max_position_embeddings"]})
    prompt_end = len(document) + len(question)
    tokens, answer = list(document) + list(question), []
    for _ in range(n):
        lengths = [len(document)] * len(document) + [prompt_end] * len(question) + \
            list(range(prompt_end + 1, len(tokens) + 1))
        logits = reference_logits(hf, torch.tensor(tokens), dca.length_factor(torch.tensor(lengths)))
        answer.append(int(logits[-1].argmax()))
        tokens.append(answer[-1])
    return answer


@pytest.mark.parametrize("world,decode_ranks", [(2, 1), (2, 2), (3, 2)])
def test_answers_on_split_decode_ranks_and_batched_equal_the_reference(saved, world, decode_ranks):
    directory, hf = saved
    doc = prompt(70, seed=3).tolist()
    questions = [[7, 11, 13], [5, 9]]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=decode_ranks, chunk_tokens=32) as engine:
        a = engine.ingest(doc)
        alone = engine.generate(a, questions[0], max_new_tokens=6, stop_token_ids=[])
        "".join(alone)
        assert alone.result.token_ids == reference_answer(hf, doc, questions[0])
        many = engine.ask_many(a, questions, max_new_tokens=6, stop_token_ids=[])
        for _ in many:
            pass
        for q, result in zip(questions, many.results):
            assert result.token_ids == reference_answer(hf, doc, q), q


def test_tensor_parallel_ranks_split_the_three_query_versions(saved):
    """CP 2 x TP 2: each TP rank rotates and attends with its own heads' three versions."""
    directory, hf = saved
    ids = prompt(70, seed=70)
    ref = reference_logits(hf, ids, prompt_factors(70, 70))[-1:].float()
    with Engine(directory, nproc=4, tp=2, dtype="float32") as engine:
        assert rel_err(engine.prefill(ids, chunk_tokens=29).logits, ref) < 1e-5
