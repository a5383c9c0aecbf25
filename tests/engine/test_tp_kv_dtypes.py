"""8-bit and bf16 KV caches under tensor parallelism: each TP rank quantizes its own KV heads (a
scale per token and KV head, as one process does); what reaches the decode ranks equals one
process's cache to a step of its format, and greedy answers are the same."""

import pytest
import torch

from ringctx.engine import Engine

DOC = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(2)).tolist()
QUESTION = [5, 6, 7]


def run(engine):
    result = engine.prefill(DOC, chunk_tokens=64, as_document=True)
    generation = engine.generate(result.document, QUESTION, max_new_tokens=10, stop_token_ids=[])
    "".join(generation)
    return result.logits, generation.result.token_ids, engine.whole_cache(result.document)


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "int8"), ("bfloat16", "fp8"), ("bfloat16", "model")])
def test_cp2_tp2_caches_equal_one_process_to_a_step_of_their_format(dtype, kv_dtype):
    want_logits, want_tokens, want_cache = run(Engine("tiny", dtype=dtype, kv_dtype=kv_dtype))
    with Engine("tiny", nproc=4, tp=2, dtype=dtype, kv_dtype=kv_dtype) as engine:
        logits, tokens, cache = run(engine)
    # float32 sums agree to rounding; bf16 all-reduces round each rank's partial sum once more
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    assert float((logits - want_logits).abs().max() / want_logits.abs().max()) < tolerance
    assert tokens == want_tokens
    n = len(DOC)
    for layer in range(cache.n_layers):
        got, want = cache.read_rows(layer, 0, n), want_cache.read_rows(layer, 0, n)  # dequantized K, V
        for g, w, which in zip(got, want, ("k", "v")):
            diff = (g.float() - w.float()).abs()
            if dtype == "float32":  # rows may round to the neighbouring int8 code: one step, the row's scale
                step = getattr(want_cache, f"{which}_scale")[layer][:n, :, None]
                assert bool((diff <= 1.01 * step + 1e-7).all()), (layer, which)
            else:  # bf16 activations whose all-reduces rounded differently; fp8's top step is 1/8
                bound = 0.125 if kv_dtype == "fp8" else 2e-2
                assert float(diff.max()) <= bound * float(w.float().abs().max()), (layer, which)
