"""The prefill engine on every model family and RoPE type of tests/model/test_model_families.py (Qwen3
with YaRN or biases, Llama with YaRN or linear RoPE, Mistral with a wide head_dim, Llama with
dynamic RoPE) at W = 1 and 2 with pass-KV and pass-Q, against transformers: a rank holding tokens
past the original context gets what one device would (RoPE at global positions), and dynamic RoPE
past its context is refused by every rank together, before any ring communication."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import SavedHFModels, rel_err
from tests.model.test_model_families import INSIDE, PAST, prompt, random_hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return SavedHFModels(random_hf_model, tmp_path_factory)


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("case", ["qwen3-yarn-tied", "qwen3-bias", "llama-yarn-mscale", "llama-linear",
                                  "mistral-head-dim"])
def test_prefill_matches_transformers_inside_and_past_the_context(saved, case, world):
    """Every family and RoPE type (dynamic: below) through the engine, both strategies, with
    chunks (37 tokens) that put tokens past the original context (32) on every rank."""
    directory, hf = saved[case]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        for n in (INSIDE, PAST):
            ids = prompt(n)
            with torch.no_grad():
                ref = hf(ids[None]).logits[0, -1:]
            for strategy in ("pass-kv", "pass-q"):
                result = engine.prefill(ids, chunk_tokens=37, strategy=strategy)
                assert rel_err(result.logits, ref) < 1e-4, (case, world, n, strategy)
                assert int(result.logits.argmax()) == int(ref.argmax())
                if world > 1:
                    assert {c.strategy for c in result.stats.chunks} == {strategy}


def test_dynamic_rope_past_its_context_is_refused_on_every_rank(saved):
    directory, hf = saved["llama-dynamic"]
    limit = hf.config.max_position_embeddings
    # allowed past the trained context, dynamic RoPE is still refused there: its angles would
    # depend on the prompt's length
    with Engine(directory, nproc=2, dtype="float32", decode_ranks=1, allow_long_context=True) as engine:
        with pytest.raises(ValueError, match=rf"{limit + 5} tokens go past position {limit}"):
            engine.prefill(prompt(limit + 5), strategy="pass-kv")
        ids = prompt(limit)  # the engine survives, and runs up to the limit
        with torch.no_grad():
            ref = hf(ids[None]).logits[0, -1:]
        assert rel_err(engine.prefill(ids, chunk_tokens=32, strategy="pass-q").logits, ref) < 1e-4


def test_qwen3_under_tensor_parallelism_matches_transformers(saved):
    """TP 2 splits the heads; each rank holds the whole [head_dim] q/k norm weights."""
    directory, hf = saved["qwen3-yarn-tied"]
    ids = prompt(PAST)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1:]
    with Engine(directory, nproc=2, tp=2, dtype="float32") as engine:
        assert rel_err(engine.prefill(ids, chunk_tokens=37).logits, ref) < 1e-4


def test_qwen3_yarn_greedy_answer_on_two_decode_ranks_equals_transformers(saved):
    """Ingested at W = 2, the cache split over both ranks, which decode together (the fused CPU step
    with q/k norms where the kernels are built) past the original context: transformers' tokens,
    and every decode step's logits within 1e-4 relative of transformers'."""
    directory, hf = saved["qwen3-yarn-tied"]
    document_ids, question = prompt(PAST - 10, seed=3).tolist(), [7, 11, 13]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([document_ids + question]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, len(document_ids) + len(question):].tolist()
    with Engine(directory, nproc=2, dtype="float32", decode_ranks=2, chunk_tokens=32) as engine:
        document = engine.ingest(document_ids)
        assert document.stats.decode_slice_rows_per_rank[1] > 0  # both ranks hold part of the cache
        generation = engine.generate(document, question, max_new_tokens=8, stop_token_ids=[], keep_logits=True)
        "".join(generation)
    assert generation.result.token_ids == ref_tokens
    # step 0's logits come from the question's prefill (the prefill tests above check those); the
    # later ones from the decode steps this test is about
    decoded = list(zip(generation.result.step_logits, ref.logits, strict=True))[1:]
    for step, (got, want) in enumerate(decoded, start=1):
        assert rel_err(got, want[0]) < 1e-4, step
