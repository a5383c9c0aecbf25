"""Ingest checkpoints through the Engine: an ingest stopped after some chunks (and inside one)
resumes from its checkpoint bit for bit on the same ranks (the rows, the last logits, the
answers), for windowed layers that drop rows chunk by chunk, Llama 4's layers and experts,
a Gated DeltaNet hybrid's states, 8-bit KV caches under tensor parallelism; on another number of ranks or chunk size it reslices the
tokens done and stays exact; a checkpoint of other tokens or another model is one line.

The ranks' files themselves (journal, torn records, checksums) are tested in
tests/runtime/test_checkpoint_files.py, the CLI and torchrun with real kills in
tests/cli/test_ingest_resume.py, the server in tests/serve/test_live_server.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ringctx.engine import Engine
from tests.helpers import random_prompt, rel_err

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             max_position_embeddings=1024, head_dim=32, sliding_window=11,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
DOCUMENT = random_prompt(300, seed=5).tolist()
QUESTION = [7, 11, 13, 17]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> str:
    """A random Ministral (1 full : 3 sliding layers, window 11) saved as a Hugging Face directory."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.MinistralConfig(**SHAPE), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    directory = tmp_path_factory.mktemp("ministral")
    hf.save_pretrained(directory)
    return str(directory)


def answer(engine, document) -> list[int]:
    """Eight greedy tokens after QUESTION on `document`."""
    out = engine.generate(document, QUESTION, max_new_tokens=8)
    for _ in out:
        pass
    return out.result.token_ids


def stop_after(engine, checkpoint, chunks: int, layers: int = 1, **kwargs):
    """An ingest of DOCUMENT cut off after `chunks` chunks and `layers` layers of the next one."""
    job = engine.start_ingest(DOCUMENT, checkpoint=checkpoint, **kwargs)
    assert job.resume.mode == "fresh"
    for _ in range(chunks):
        job.step()
    if layers:
        job.step(layers=layers)
    job.cancel()
    return job.total_chunks


def resumed(engine, checkpoint, **kwargs):
    """The ingest of DOCUMENT run again on its checkpoint: (its plan, its finished PrefillResult)."""
    job = engine.start_ingest(DOCUMENT, checkpoint=checkpoint, **kwargs)
    plan = job.resume
    while not job.done:
        job.step()
    return plan, job.finish()


def assert_same_bits(engine, a, b):
    """Two ingests' results: the same logits, every row of every layer, states, and answers."""
    assert torch.equal(a.logits, b.logits)
    wa, wb = engine.whole_cache(a.document), engine.whole_cache(b.document)
    if wa is not None:
        assert wa.length == wb.length and wa.kept == wb.kept
        for layer in range(wa.n_layers):
            for x, y in zip(wa.storage_tensors(layer), wb.storage_tensors(layer)):
                n = wa.length - wa.kept[layer]
                assert torch.equal(x[:n], y[:n]), f"layer {layer} differs"
        for x, y in zip(a.document.cache.linear_states or (), b.document.cache.linear_states or ()):
            if x is not None:
                assert torch.equal(x.conv, y.conv) and torch.equal(x.recurrent, y.recurrent)
    assert answer(engine, a.document) == answer(engine, b.document)


CASES = {
    # one rank: the windowed layers drop their rows in place chunk by chunk (a ring buffer)
    "windowed-W1": dict(model="windowed", nproc=1),
    # three ranks, two decode ranks: every rank's shard restored, then spread at the hand-off
    "windowed-W3": dict(model="windowed", nproc=3, decode_ranks=2),
    # a hybrid: its linear layers' conv and recurrent states at the last chunk's end, relayed
    "qwen3.5-W2-relay": dict(model="tiny-qwen3.5", nproc=2, linear_exchange="ring"),
    # a mixture of experts (routed and shared experts), chunked and NoPE layers
    "llama4-W2": dict(model="tiny-llama4", nproc=2),
    # 8-bit rows and their scales, each TP rank its own heads
    "int8-tp2": dict(model="tiny", nproc=4, tp=2, kv_dtype="int8"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stopped_ingest_resumes_bit_for_bit_on_the_same_ranks(case, windowed, tmp_path):
    settings = dict(CASES[case])
    model = windowed if settings.pop("model") == "windowed" else CASES[case]["model"]
    checkpoint = str(tmp_path / "doc.ingest")
    with Engine(model, dtype="float32", chunk_tokens=48, **settings) as engine:
        whole = engine.start_ingest(DOCUMENT)
        while not whole.done:
            whole.step()
        whole = whole.finish()
        total = stop_after(engine, checkpoint, chunks=3)
        plan, result = resumed(engine, checkpoint)
        assert (plan.mode, plan.chunks, plan.done_tokens) == ("exact", 3, 144)
        assert [c.index for c in result.stats.chunks] == list(range(total))  # the restored ones' stats too
        assert_same_bits(engine, result, whole)
        assert not os.path.exists(checkpoint)  # it goes with the prefill's finish
        # every chunk written, then stopped before the hand-off: the logits come back from the file
        job = engine.start_ingest(DOCUMENT, checkpoint=checkpoint)
        while not job.done:
            job.step()
        job.cancel()
        plan, again = resumed(engine, checkpoint)
        assert (plan.mode, plan.chunks) == ("exact", total)
        assert_same_bits(engine, again, whole)


def test_a_resume_on_other_ranks_or_chunks_reslices_and_stays_exact(windowed, tmp_path):
    """Stopped on 2 ranks; resumed on 3 ranks with 2 decode ranks (resliced as documents load; the
    restored rows spread to the decode ranks with the new ones), stopped again after a chunk and
    resumed exactly on top of the resliced base; the same as the reslice run through without the
    second stop, and within the usual tolerance of an ingest that never stopped."""
    first, copy = str(tmp_path / "a.ingest"), str(tmp_path / "b.ingest")
    with Engine(windowed, nproc=2, dtype="float32", chunk_tokens=48) as engine:
        stop_after(engine, first, chunks=3, layers=2)
    shutil.copytree(first, copy)
    with Engine(windowed, nproc=3, decode_ranks=2, dtype="float32", chunk_tokens=48) as engine:
        whole = engine.start_ingest(DOCUMENT)
        while not whole.done:
            whole.step()
        whole = whole.finish()
        job = engine.start_ingest(DOCUMENT, checkpoint=first)
        assert (job.resume.mode, job.resume.done_tokens) == ("reslice", 144)
        assert "2 CP x 1 TP ranks" in job.resume.describe(300)
        job.step()
        job.cancel()
        assert sorted(os.listdir(first)) == ["ingest.json", "run-001", "tokens.safetensors"]  # run-000 went
        plan, twice = resumed(engine, first)
        assert (plan.mode, plan.base_tokens, plan.chunks) == ("exact", 144, 1)
        plan, once = resumed(engine, copy)
        assert plan.mode == "reslice"
        assert_same_bits(engine, twice, once)
        assert rel_err(once.logits, whole.logits) < 1e-5
        a, b = engine.whole_cache(once.document), engine.whole_cache(whole.document)
        assert rel_err(a.keys(1)[:300], b.keys(1)[:300]) < 1e-5
        assert answer(engine, once.document) == answer(engine, whole.document)
    with Engine(windowed, nproc=1, dtype="float32", chunk_tokens=40) as engine:  # another chunk size, one rank
        stop_after(engine, first, chunks=2, layers=0, chunk_tokens=48)
        plan, result = resumed(engine, first)
        assert (plan.mode, plan.done_tokens) == ("reslice", 96)
        whole = engine.ingest(DOCUMENT)
        assert rel_err(result.logits, engine.prefill(DOCUMENT, as_document=True).logits) < 1e-5
        assert answer(engine, result.document) == answer(engine, whole)


def test_a_checkpoint_of_other_tokens_or_another_model_is_one_line(tmp_path):
    checkpoint = str(tmp_path / "doc.ingest")
    with Engine("tiny", dtype="float32", chunk_tokens=64) as engine:
        stop_after(engine, checkpoint, chunks=2)
        with pytest.raises(ValueError, match=r"other tokens \(300 tokens.*start over with --restart"):
            engine.start_ingest(DOCUMENT[:-1], checkpoint=checkpoint)
        with pytest.raises(ValueError, match="other tokens"):  # as many tokens, one of them other
            engine.start_ingest(DOCUMENT[:-1] + [3 if DOCUMENT[-1] != 3 else 4], checkpoint=checkpoint)
        assert os.path.isdir(os.path.join(checkpoint, "run-000"))  # what was complete stays
    with Engine("tiny", dtype="bfloat16", chunk_tokens=64) as engine:
        with pytest.raises(ValueError, match="made with dtype 'float32', this ingest has 'bfloat16'"):
            engine.start_ingest(DOCUMENT, checkpoint=checkpoint)
        job = engine.start_ingest(DOCUMENT, checkpoint=checkpoint, restart=True)
        assert job.resume.mode == "fresh"
        job.cancel()
    with Engine("tiny-llama4", dtype="bfloat16", chunk_tokens=64) as engine:
        with pytest.raises(ValueError, match="made with model"):
            engine.start_ingest(DOCUMENT, checkpoint=checkpoint)


@pytest.mark.parametrize("before,after", [
    # a hybrid's linear-layer states come from CP rank 0's records of the other mesh
    (dict(model="tiny-qwen3.5", nproc=2), dict(model="tiny-qwen3.5", nproc=1)),
    # 8-bit rows saved by two TP ranks' heads, read back whole by one (the rows as stored)
    (dict(model="tiny", nproc=4, tp=2, kv_dtype="int8"), dict(model="tiny", nproc=2, kv_dtype="int8")),
], ids=["qwen3.5-W2-to-W1", "int8-tp2-to-tp1"])
def test_a_reslice_carries_states_and_heads_across_meshes(before, after, tmp_path):
    checkpoint = str(tmp_path / "doc.ingest")
    with Engine(dtype="float32", chunk_tokens=48, **before) as engine:
        stop_after(engine, checkpoint, chunks=3)
    with Engine(dtype="float32", chunk_tokens=48, **after) as engine:
        plan, result = resumed(engine, checkpoint)
        assert (plan.mode, plan.done_tokens) == ("reslice", 144)
        whole = engine.start_ingest(DOCUMENT)
        while not whole.done:
            whole.step()
        whole = whole.finish()
        assert rel_err(result.logits, whole.logits) < 1e-5
        assert answer(engine, result.document) == answer(engine, whole.document)
