"""The engine on models whose layers slide (Ministral: sliding and full layers; Qwen2 with
use_sliding_window; Gemma 3 with two RoPEs), or rotate by LongRoPE (Phi-3), against transformers: prefills at W = 1-3 with pass-KV and pass-Q forced and
chunks that put window edges inside pieces and across chunks; a document split over two decode
ranks answering greedily as transformers does, alone and batched (ask_many) with a question
asked on a second document; every answer the same across world sizes and decode ranks."""

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import (assert_engine_prefills_match, assert_two_documents_answer_as_transformers, hf_greedy,
                           random_prompt, rel_err)

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             max_position_embeddings=1024)


def hf_config(name):
    import transformers

    return {
        # 1 full : 3 sliding layers (window 11), a wide head
        "ministral": lambda: transformers.MinistralConfig(
            **SHAPE, head_dim=32, sliding_window=11,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
        # windows longer than a chunk's pieces, on the last two layers only
        "qwen2-window": lambda: transformers.Qwen2Config(
            **SHAPE, use_sliding_window=True, sliding_window=45, max_window_layers=2),
    }[name]()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import transformers

    models = {}
    for name in ("ministral", "qwen2-window"):
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32).eval()
        with torch.no_grad():
            for param_name, p in hf.named_parameters():
                p.copy_(torch.rand_like(p) + 0.5 if "norm" in param_name else torch.randn_like(p) * 0.1)
        directory = tmp_path_factory.mktemp(name)
        hf.save_pretrained(directory)
        models[name] = (str(directory), hf)
    return models


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("case", ["ministral", "qwen2-window"])
def test_prefill_matches_transformers(saved, case, world):
    directory, hf = saved[case]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=1) as engine:
        assert_engine_prefills_match(engine, hf, ((9, 64), (97, 37), (150, 29)), (case, world))


@pytest.mark.parametrize("world,decode_ranks", [(2, 2), (3, 2)])
def test_answers_on_split_decode_ranks_and_batched_equal_transformers(saved, world, decode_ranks, tmp_path):
    """A 130-token document (windows of 11 reach back into rows other decode ranks hold), greedy
    answers alone and batched, on two documents at once; its sliding layers keep only the rows
    later tokens see, saved so and loaded on 1 and 2 decode ranks."""
    directory, hf = saved["ministral"]
    doc_a, doc_b = random_prompt(130, seed=3).tolist(), random_prompt(70, seed=4).tolist()
    questions = [[7, 11, 13], [5, 9], [21, 22, 23, 24]]
    with Engine(directory, nproc=world, dtype="float32", decode_ranks=decode_ranks, chunk_tokens=32) as engine:
        a, b = assert_two_documents_answer_as_transformers(engine, hf, doc_a, doc_b, questions)
        # The documents' sliding layers kept only what later tokens see (rank 0's slice here):
        # the window of 11 needs the last 10 rows, wherever they are; the full layer keeps all.
        assert a.dropped_unseen and a.cache.kept[1] == 0 and all(a.cache.kept[i] > 0 for i in (0, 2, 3))
        stored = a.cache.length - a.cache.kept[0] + sum(a.cache.length - a.cache.kept[i] for i in (1, 2, 3))
        assert stored < 0.45 * 4 * a.cache.length
        with pytest.raises(ValueError, match="drop_unseen=False"):
            engine.document_prefix(a, 60)
        # The prefill's shards dropped what the next chunk no longer sees chunk by chunk: at the
        # hand-off each rank held its full layer's rows and a few of each sliding layer's.
        every = engine.prefill(doc_a, chunk_tokens=32)
        dropped = engine.prefill(doc_a, chunk_tokens=32, as_document=True, drop_unseen=True)
        assert torch.equal(dropped.logits, every.logits)
        for kept, whole in zip(dropped.stats.kv_shard_bytes_per_rank, every.stats.kv_shard_bytes_per_rank):
            assert kept < 0.45 * whole
        keeps_all = engine.ingest(doc_a, drop_unseen=False)
        assert not keeps_all.dropped_unseen and engine.document_prefix(keeps_all, 60).length == 60
        engine.save_document(a, tmp_path / "a.kv")
    # Saved by 2 decode ranks, loaded on 1 (rows by position) and on 2 others: the same answers.
    for nproc, ranks in ((1, 1), (2, 2)):
        with Engine(directory, nproc=nproc, dtype="float32", decode_ranks=ranks) as engine:
            loaded = engine.load_document(tmp_path / "a.kv")
            assert loaded.dropped_unseen and loaded.cache.kept[0] > 0
            again = engine.generate(loaded, questions[2], max_new_tokens=8, stop_token_ids=[])
            "".join(again)
            assert again.result.token_ids == hf_greedy(hf, doc_a + questions[2]), nproc


@pytest.mark.parametrize("case", ["phi3-longrope", "gemma3-text"])
def test_long_context_families_through_the_engine(case, tmp_path):
    """Phi-3's LongRoPE: a 70-token prompt in chunks of 16 on 2 ranks rotates every chunk with the
    long factors (the whole prompt is past the original 32), as transformers' one call does; a
    20-token prompt keeps the short ones. Gemma 3: windows of 8 over 2 ranks, both RoPEs."""
    from tests.model.test_model_families_long import LONG, SHORT, random_hf_model

    hf = random_hf_model(case)
    hf.save_pretrained(tmp_path)
    with Engine(str(tmp_path), nproc=2, dtype="float32", decode_ranks=1) as engine:
        for n in (SHORT, LONG):
            ids = random_prompt(n, seed=5)
            with torch.no_grad():
                ref = hf(ids[None]).logits[0, -1:]
            for strategy in ("pass-kv", "pass-q"):
                assert rel_err(engine.prefill(ids, chunk_tokens=16, strategy=strategy).logits, ref) < 1e-4, \
                    (case, n, strategy)
