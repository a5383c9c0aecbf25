"""Documents saved by N decode ranks and loaded by M, 8-bit KV caches split over decode ranks, and
a decode rank that dies mid-answer. (Engines here are made one at a time: one process group per
process, so this module is apart from test_decode_ranks.py's engines.)"""

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from ringctx.engine import Engine, RankFailure
from ringctx.runtime.documents import read_document

from .test_decode_ranks import DOC, STEPS, answer, assert_same_cache, assert_same_logits, reference  # noqa: F401


@pytest.fixture(scope="module")
def saved_by_four(tmp_path_factory):
    path = tmp_path_factory.mktemp("documents") / "doc.kv"
    with Engine("tiny", nproc=4, dtype="float32", decode_ranks=4, chunk_tokens=64) as engine:
        document = engine.ingest(DOC)
        engine.save_document(document, str(path))
    return path


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_document_saved_by_four_decode_ranks_loads_on_any_number(saved_by_four, reference, n):
    assert sorted(p.name for p in saved_by_four.iterdir()) == \
        ["manifest.json"] + [f"slice-{i:05d}.safetensors" for i in range(4)] + ["tokens.safetensors"]
    with Engine("tiny", nproc=3, dtype="float32", decode_ranks=n, chunk_tokens=64) as engine:
        document = engine.load_document(str(saved_by_four))
        assert document.length == len(DOC) and document.token_ids.tolist() == DOC
        rows = engine.document_rows(document)
        assert sum(rows) == len(DOC) and max(rows) - min(rows) <= 1  # resliced evenly on load
        assert_same_cache(engine.whole_cache(document), reference["cache"], len(DOC))
        assert_same_logits(answer(engine, document), reference["greedy"])
    cache, token_ids, _ = read_document(str(saved_by_four), reference["engine"].model)
    assert token_ids.tolist() == DOC and cache.positions is None
    assert_same_cache(cache, reference["cache"], len(DOC))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_caches_split_over_two_ranks_equal_one_rank(kv_dtype, reference, tmp_path):
    one = Engine("tiny", dtype="float32", kv_dtype=kv_dtype)
    single = one.ingest(DOC, chunk_tokens=64)
    assert single.cache.quantized and single.cache.k[0].element_size() == 1
    expected = answer(one, single)
    with Engine("tiny", nproc=2, dtype="float32", kv_dtype=kv_dtype, chunk_tokens=64) as engine:
        document = engine.ingest(DOC)
        assert engine.decode_ranks == 2 and document.cache.kv_dtype == kv_dtype
        result = answer(engine, document)
        # The same quantized rows (the prefill's K/V agree to float32 rounding before quantizing)
        assert result.token_ids == expected.token_ids
        for got, want in zip(result.step_logits, expected.step_logits):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-3
        engine.save_document(document, str(tmp_path / "doc.kv"))
    loaded = one.load_document(str(tmp_path / "doc.kv"))
    assert loaded.cache.kv_dtype == kv_dtype and answer(one, loaded).token_ids == expected.token_ids
    # Against the float32 cache, over the steps whose contexts are still the same (up to the first
    # token the two choose differently): 8-bit K/V move the logits by a little, never a lot.
    same = next((i for i, (a, b) in enumerate(zip(expected.token_ids, reference["greedy"].token_ids)) if a != b),
                STEPS - 1) + 1
    error = max(float((got - want).abs().max() / want.abs().max())
                for got, want in zip(expected.step_logits[:same], reference["greedy"].step_logits[:same]))
    assert 0 < error < (0.02 if kv_dtype == "int8" else 0.1), error


def test_a_decode_rank_that_dies_mid_answer_is_named(monkeypatch):
    monkeypatch.setenv("RINGCTX_TEST_KILL", "1:decode5")  # rank 1 SIGKILLs itself before decode step 5
    engine = Engine("tiny", nproc=2, dtype="float32", timeout_s=240)
    document = engine.ingest(DOC, chunk_tokens=64)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 2 .*(killed|SIGKILL|exited).* during decode"):
        answer(engine, document)
    assert time.monotonic() - start < 120  # moments, not the 240 s timeout (loose: the machine may be loaded)
    with pytest.raises(RankFailure, match="this engine is closed"):
        engine.ingest(DOC)


def test_a_decode_rank_that_stops_answering_times_out_named(reference):
    engine = Engine("tiny", nproc=2, dtype="float32", timeout_s=3)
    document = engine.ingest(DOC, chunk_tokens=64)
    worker = engine.worker_processes[0]
    os.kill(worker.pid, signal.SIGSTOP)  # alive but silent
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure, match=rf"did not complete within the 3 s timeout: rank 1 \(pid {worker.pid}\) "
                                              r"is stopped"):
            answer(engine, document)
        assert time.monotonic() - start < 60  # the 3 s timeout and the diagnosis, not a hang
    finally:
        if worker.is_alive():
            worker.kill()


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_ranks_without_the_fused_kernel_decode_with_those_that_have_it(monkeypatch, reference, kv_dtype):
    """RINGCTX_CPU_KERNELS=0 reaches the spawned rank only (this process built its kernels already):
    rank 0 runs the fused step, rank 1 the PyTorch layers; the merged answer is the same."""
    if kv_dtype == "model":
        expected = reference["greedy"]
    else:
        one = Engine("tiny", dtype="float32", kv_dtype=kv_dtype)
        expected = answer(one, one.ingest(DOC, chunk_tokens=64))
    monkeypatch.setenv("RINGCTX_CPU_KERNELS", "0")
    with Engine("tiny", nproc=2, dtype="float32", chunk_tokens=64, kv_dtype=kv_dtype) as engine:
        document = engine.ingest(DOC)
        result = answer(engine, document)
    assert result.token_ids == expected.token_ids
    for got, want in zip(result.step_logits, expected.step_logits):
        assert float((got - want).abs().max() / want.abs().max()) < (1e-5 if kv_dtype == "model" else 1e-3)


@pytest.mark.parametrize("nproc,decode_ranks,kv_dtype", [(2, 1, "int8"), (3, 2, "fp8")])
def test_8bit_rows_travel_as_stored_in_the_hand_off(nproc, decode_ranks, kv_dtype):
    """One decode rank gathers every rank's 8-bit rows in sequence order; two of three keep theirs
    and receive the third's. Either way the cache holds one process's 8-bit rows (a code may differ
    by one step where the prefills' float32 K/V round differently) and scales."""
    one = Engine("tiny", dtype="float32", kv_dtype=kv_dtype)
    single = one.ingest(DOC, chunk_tokens=64)
    with Engine("tiny", nproc=nproc, dtype="float32", kv_dtype=kv_dtype, decode_ranks=decode_ranks,
                chunk_tokens=64) as engine:
        document = engine.ingest(DOC)
        sent = document.stats.handoff_bytes_per_rank
        assert sent[:decode_ranks] == [0] * decode_ranks and min(sent[decode_ranks:]) > 0
        whole = engine.whole_cache(document)
        assert whole.kv_dtype == kv_dtype and whole.length == len(DOC)
        for layer in range(whole.n_layers):
            for got, want in zip(whole.read_rows(layer, 0, len(DOC)), single.cache.read_rows(layer, 0, len(DOC))):
                step = want.abs().amax(dim=-1, keepdim=True) / (127 if kv_dtype == "int8" else 8)
                assert bool(((got - want).abs() <= step + 1e-6).all())
            torch.testing.assert_close(whole.k_scale[layer][:len(DOC)], single.cache.k_scale[layer][:len(DOC)],
                                       rtol=1e-5, atol=0)
        assert answer(engine, document).token_ids == answer(one, single).token_ids


def test_a_document_saved_in_the_background_is_the_one_saved_at_once(reference, tmp_path):
    """Engine.start_save: the slices are written on a thread of each decode rank while the engine
    answers; finish() completes the same directory as save_document does (the same files and
    tensors; a file's header may order its metadata otherwise: safetensors keeps it in a hash map)."""
    with Engine("tiny", nproc=2, dtype="float32", decode_ranks=2, chunk_tokens=64) as engine:
        document = engine.ingest(DOC)
        engine.save_document(document, str(tmp_path / "at_once.kv"))
        job = engine.start_save(document, str(tmp_path / "background.kv"))
        assert_same_logits(answer(engine, document), reference["greedy"])  # the engine answers meanwhile
        assert job.wait_written(timeout=120) and job.written
        assert not (tmp_path / "background.kv").exists()  # complete only once finished
        job.finish()
        with pytest.raises(ValueError, match="cannot create"):
            engine.start_save(document, str(tmp_path / "at_once.kv" / "manifest.json" / "x.kv"))
        assert_same_logits(answer(engine, document), reference["greedy"])  # and it stays usable
    at_once, background = tmp_path / "at_once.kv", tmp_path / "background.kv"
    names = sorted(p.name for p in at_once.iterdir())
    assert names == sorted(p.name for p in background.iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            a, b = load_file(at_once / name), load_file(background / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (at_once, background)]
    for m in manifests:
        for entry in m["slices"]:
            entry.pop("sha256")  # each checked against its file by read_document below
    assert manifests[0] == manifests[1]
    cache, token_ids, _ = read_document(str(background), reference["engine"].model)
    assert token_ids.tolist() == DOC
    assert_same_cache(cache, reference["cache"], len(DOC))
