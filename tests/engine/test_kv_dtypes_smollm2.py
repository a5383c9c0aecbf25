"""8-bit KV caches on the embedded SmolLM2-135M, split over two decode ranks: the needle is still
found, and the first answer token's logits stay close to the bf16 cache's (the bound is checked,
the measured error printed)."""

import pytest

from ringctx.engine import Engine

from .test_engine_smollm2 import QUESTION, long_document

BOUND = {"fp8": 0.04, "int8": 0.04}
"""Largest relative logit error (max |diff| / max |logit|) allowed against the bf16 cache; measured
values are recorded in docs/BENCHMARKS.md."""


@pytest.fixture(scope="module")
def bf16_answer():
    with Engine("smollm2-135m", nproc=2, dtype="bfloat16", chunk_tokens=1024) as engine:
        document = engine.ingest(long_document())
        generation = engine.generate(document, QUESTION, max_new_tokens=24, keep_logits=True)
        text = "".join(generation)
    assert "7492" in text, text
    return generation.result


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_8bit_cache_finds_the_needle_close_to_the_bf16_cache(bf16_answer, kv_dtype):
    with Engine("smollm2-135m", nproc=2, dtype="bfloat16", chunk_tokens=1024, kv_dtype=kv_dtype) as engine:
        document = engine.ingest(long_document())
        assert engine.decode_ranks == 2 and document.cache.kv_dtype == kv_dtype
        assert document.cache.bytes_per_token * 2 < 23040 * 1.1  # about half of bf16's 23,040 bytes a token
        generation = engine.generate(document, QUESTION, max_new_tokens=24, keep_logits=True)
        text = "".join(generation)
    assert "7492" in text, text
    got, want = generation.result.step_logits[0], bf16_answer.step_logits[0]  # the same context: question prefill
    error = float((got - want).abs().max() / want.abs().max())
    agree = sum(a == b for a, b in zip(generation.result.token_ids, bf16_answer.token_ids))
    print(f"{kv_dtype}: first-token logit error {error:.4f} against the bf16 cache; greedy tokens agreeing "
          f"{agree} of {len(bf16_answer.token_ids)}")
    assert error < BOUND[kv_dtype]
    assert int(got.argmax()) == int(want.argmax())
