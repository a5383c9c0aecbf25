"""The prefill engine at world sizes 1, 2 and 4 against a single-process, single-chunk forward."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ringctx.engine import Engine
from ringctx.model import KVCache, forward_with_cache

TINY_IDS = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(0))


def single_forward(model, ids):
    """Reference: one process, one chunk, the model's own cache path."""
    cache = KVCache.for_model(model.config, ids.numel(), dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        logits = forward_with_cache(model, ids, cache)[0]
    return logits, cache


def assert_same_cache(cache, ref, length, atol):
    assert cache.length == length
    for layer in range(ref.n_layers):
        torch.testing.assert_close(cache.k[layer][:length], ref.k[layer][:length], atol=atol, rtol=0)
        torch.testing.assert_close(cache.v[layer][:length], ref.v[layer][:length], atol=atol, rtol=0)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"W{w}")
def tiny_engine(request):
    with Engine("tiny", nproc=request.param, dtype="float32", decode_ranks=1) as engine:
        yield engine


@pytest.mark.parametrize("chunk_tokens", [301, 64, 37])
@pytest.mark.parametrize("strategy", ["auto", "pass-kv", "pass-q"])
def test_prefill_equals_single_chunk_forward(tiny_engine, chunk_tokens, strategy):
    ref_logits, ref_cache = single_forward(tiny_engine.model, TINY_IDS)
    result = tiny_engine.prefill(TINY_IDS, chunk_tokens=chunk_tokens, strategy=strategy)
    torch.testing.assert_close(result.logits, ref_logits, atol=2e-5, rtol=1e-5)
    assert_same_cache(result.cache, ref_cache, 301, atol=2e-5)
    stats = result.stats
    assert [c.tokens for c in stats.chunks] == [min(chunk_tokens, 301 - s) for s in range(0, 301, chunk_tokens)]
    assert [c.cached for c in stats.chunks] == list(range(0, 301, chunk_tokens))
    assert len(stats.bytes_sent_per_rank) == tiny_engine.world_size
    if tiny_engine.world_size == 1:
        assert stats.bytes_sent_per_rank == [0]
    elif strategy != "auto":
        assert {c.strategy for c in stats.chunks} == {strategy}


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_a_prefill_run_in_layer_slices_gives_the_bits_of_the_whole_one(tiny_engine, strategy):
    """What the scheduler does beside running answers: a chunk a few layers at a time, other
    commands between the slices (here another prefill), the same bits as the chunks run whole."""
    whole = tiny_engine.prefill(TINY_IDS, chunk_tokens=64, strategy=strategy)
    job = tiny_engine.start_prefill(TINY_IDS, chunk_tokens=64, strategy=strategy)
    n_layers, slices, ended = len(tiny_engine.model.layers), [1, 2, 3, 1], []
    while not job.done:
        before = job.layer_in_chunk
        stats = job.step(slices[len(ended) % len(slices)])
        assert (stats is None) == (0 < job.layer_in_chunk < n_layers)
        if stats is None:
            assert job.layer_in_chunk == before + 1
            tiny_engine.prefill(TINY_IDS[:40], chunk_tokens=16)  # other work between two slices
        else:
            ended.append(stats)
    result = job.finish()
    assert [c.tokens for c in ended] == [c.tokens for c in whole.stats.chunks]
    assert all(c.seconds > 0 for c in ended)
    assert torch.equal(result.logits, whole.logits)
    for layer in range(n_layers):
        assert torch.equal(result.cache.k[layer][:301], whole.cache.k[layer][:301])
        assert torch.equal(result.cache.v[layer][:301], whole.cache.v[layer][:301])
    with pytest.raises(ValueError, match="at least one layer"):
        tiny_engine.start_prefill(TINY_IDS[:10]).step(0)


def test_auto_uses_both_strategies_as_the_cache_grows(tiny_engine):
    result = tiny_engine.prefill(TINY_IDS, chunk_tokens=37, strategy="auto")
    if tiny_engine.world_size == 1:  # nothing travels: no decision to make
        assert {c.reason for c in result.stats.chunks} == {"one rank: nothing travels"}
        return
    used = [c.strategy for c in result.stats.chunks]
    assert used[0] == "pass-kv" and used[-1] == "pass-q", used
    assert all(c.reason.startswith("alg5") for c in result.stats.chunks)


def test_prefill_on_top_of_a_cache_and_tiny_prompts(tiny_engine):
    first = tiny_engine.prefill(TINY_IDS[:250], chunk_tokens=100)
    follow = tiny_engine.prefill(TINY_IDS[250:], cache=first.cache, cache_token_ids=first.token_ids, chunk_tokens=16)
    ref_logits, ref_cache = single_forward(tiny_engine.model, TINY_IDS)
    torch.testing.assert_close(follow.logits, ref_logits, atol=2e-5, rtol=1e-5)
    assert_same_cache(follow.cache, ref_cache, 301, atol=2e-5)
    assert torch.equal(follow.token_ids, TINY_IDS)
    # Fewer tokens than 2N: some ranks hold nothing.
    for n in (1, 3):
        ref_logits, _ = single_forward(tiny_engine.model, TINY_IDS[:n])
        torch.testing.assert_close(tiny_engine.prefill(TINY_IDS[:n]).logits, ref_logits, atol=2e-5, rtol=1e-5)


def test_bad_input_is_one_clear_error_and_the_engine_survives(tiny_engine):
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        tiny_engine.prefill([1, 2, 256])
    with pytest.raises(ValueError, match="empty"):
        tiny_engine.prefill([])
    with pytest.raises(ValueError, match="unknown strategy"):
        tiny_engine.prefill([1, 2], strategy="pass-x")
    ref_logits, _ = single_forward(tiny_engine.model, TINY_IDS[:20])
    torch.testing.assert_close(tiny_engine.prefill(TINY_IDS[:20]).logits, ref_logits, atol=2e-5, rtol=1e-5)


def test_trace_has_compute_and_communication_of_every_rank(tiny_engine):
    result = tiny_engine.prefill(TINY_IDS[:100], chunk_tokens=50, trace=True)
    events = result.trace_events
    assert len(events) == tiny_engine.world_size
    kinds = {e["tid"] for rank_events in events for e in rank_events}
    assert "compute" in kinds and (tiny_engine.world_size == 1 or "comm" in kinds)


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown strategy"):
        Engine("tiny", strategy="ring")
    with pytest.raises(ValueError, match="nproc"):
        Engine("tiny", nproc=0)
    with pytest.raises(ValueError, match="decode_rank 3"):
        Engine("tiny", decode_rank=3)
    with pytest.raises(ValueError, match="decode_rank must be 0"):
        Engine("tiny", nproc=2, decode_rank=1)


def test_torchrun_launch_writes_json(tmp_path):
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ringctx",
           "prefill", "--model", "tiny", "--tokens", "200", "--chunk-tokens", "64", "--dtype", "float32",
           "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["tokens"] == 200
    assert [c["tokens"] for c in data["chunks"]] == [64, 64, 64, 8]
    assert all(c["strategy"] in ("pass-kv", "pass-q") and c["reason"] for c in data["chunks"])
    assert len(data["bytes_sent_per_rank"]) == 2 and min(data["bytes_sent_per_rank"]) > 0
    assert len(data["peak_rss_bytes_per_rank"]) == 2 and len(data["handoff_peak_rss_bytes_per_rank"]) == 2
    assert min(data["peak_rss_bytes_per_rank"]) > 0
    assert data["ttft_s"] > 0 and data["tokens_per_s"] > 0


def test_kv_file_dtype_mismatch_is_named(tmp_path):
    from ringctx.model.kvfile import load_kv_cache, save_kv_cache

    engine = Engine("tiny", dtype="float32")
    result = engine.prefill(TINY_IDS[:40])
    path = tmp_path / "tiny.kv"
    save_kv_cache(path, result.cache, engine.model, result.token_ids)
    cache, ids, _ = load_kv_cache(path, engine.model)
    assert torch.equal(ids, TINY_IDS[:40]) and torch.equal(cache.v[1][:40], result.cache.v[1][:40])
    with pytest.raises(ValueError, match="holds float32 K/V but the model runs in bfloat16"):
        load_kv_cache(path, Engine("tiny", dtype="bfloat16").model)
    with pytest.raises(ValueError, match="made with model 'tiny'"):  # same shapes, other random weights
        from ringctx.model import load_model
        load_kv_cache(path, load_model("tiny", dtype="float32", seed=1))


def test_auto_nproc_is_one_rank_per_gpu_and_two_on_a_multicore_cpu(monkeypatch):
    from ringctx.engine import auto_nproc

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert auto_nproc("cpu") == 2 and auto_nproc("cpu", tp=4) == 4  # a mesh needs a multiple of tp
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert auto_nproc("cpu") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert auto_nproc() == 3 and auto_nproc("cuda") == 3 and auto_nproc(None, tp=2) == 2  # never more than the GPUs
    assert auto_nproc("cpu") == 1  # --device cpu on a GPU machine counts cores
    with pytest.raises(ValueError, match="nproc must be a positive integer or 'auto', got 'all'"):
        Engine("tiny", nproc="all")


def test_int8_weights_answer_as_the_quantized_model_on_any_layout(tmp_path):
    """Engine(weights="int8") is the model with int8 values on every rank and path: one rank and
    two decode ranks (the split fused step, in a process of its own: this module's engines hold
    this process's group) give the same greedy answer, its documents say they were made with int8
    weights, and a model read as it is refuses them."""
    from ringctx.runtime.documents import describe_document
    from ringctx.model import load_model
    from ringctx.model.int8_weights import int8_of, quantize_model

    with pytest.raises(ValueError, match="unknown weights 'int4'"):
        Engine("tiny", weights="int4")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        Engine("tiny", weights="int8", dtype="float16")
    reference = load_model("tiny", dtype="bfloat16", device="cpu")
    quantize_model(reference)
    script = (
        "import json, sys\n"
        "from ringctx.engine import Engine\n"
        "with Engine('tiny', nproc=int(sys.argv[1]), dtype='bfloat16', weights='int8') as engine:\n"
        "    document = engine.ingest(json.loads(sys.argv[2]), chat=False)\n"
        "    generation = engine.generate(document, [3, 4, 5], max_new_tokens=6)\n"
        "    list(generation)\n"
        "    print(json.dumps([engine.decode_ranks, generation.result.token_ids]))\n")
    two = subprocess.run([sys.executable, "-c", script, "2", json.dumps(TINY_IDS[:150].tolist())],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert two.returncode == 0, two.stderr[-3000:]
    decode_ranks, two_answer = json.loads(two.stdout.strip().splitlines()[-1])
    assert decode_ranks == 2
    engine = Engine("tiny", dtype="bfloat16", weights="int8")
    assert engine.weights == "int8" and engine.model.weights_format == "int8"
    assert int8_of(engine.model.layers[0].feed_forward.w2.weight) is not None
    for mine, theirs in zip(engine.model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(mine, theirs)
    document = engine.ingest(TINY_IDS[:150].tolist(), chat=False)
    generation = engine.generate(document, [3, 4, 5], max_new_tokens=6)
    list(generation)
    assert generation.result.token_ids == two_answer and len(two_answer) == 6
    engine.save_document(document, str(tmp_path / "doc.kv"))
    assert describe_document(str(tmp_path / "doc.kv"))["weights"] == "int8"
    with pytest.raises(ValueError, match="made with"):
        Engine("tiny", dtype="bfloat16").load_document(str(tmp_path / "doc.kv"))
