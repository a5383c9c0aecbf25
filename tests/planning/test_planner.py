"""Planner: per-chunk strategy, predicted times, TTFT, memory per rank, default chunk size."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ringctx.model.int8_weights import code_bytes
from ringctx.model.presets import get_preset
from ringctx.planning.hardware import DEFAULT_DEVICES_PER_HOST, load_profile
from ringctx.planning.decode_plan import (
    DECODE_ROOM_TOKENS, DEQUANT_BLOCK_TOKENS, DecodeSetting, default_decode_ranks, plan_decode,
)
from ringctx.planning.memory import (
    MEMORY_USABLE_FRACTION, activation_bytes_per_rank, kv_cache_bytes_per_rank, kv_row_bytes, weight_bytes_per_rank,
)
from ringctx.planning.mesh_proposal import mesh_tp_sizes, propose_mesh
from ringctx.planning.prefill_plan import (
    MIN_DEFAULT_CHUNK_TOKENS, decode_problem, fitting_chunk_tokens, plan_prefill, split_chunks,
)
from ringctx.planning.strategy import PASS_KV, PASS_Q, STRATEGIES, choose_strategy, predict_costs, tokens_per_rank

L405 = get_preset("llama3-405b")
L8 = get_preset("llama3-8b")
TINY = get_preset("tiny")


# ----------------------------------------------------------------------------- single and chunked plans


def test_single_prefill_plan():
    plan = plan_prefill(L8, 4, "h100-rdma", tokens=32768, decode_ranks=1)
    assert plan.chunk_tokens == 32768 and len(plan.entries) == 1
    (entry,) = plan.entries
    assert entry.strategy == PASS_KV and entry.new_tokens == 32768 and entry.cached_tokens == 0
    assert set(entry.predicted_ms) == set(STRATEGIES)
    assert plan.ttft_ms == pytest.approx(entry.predicted_ms[PASS_KV] + plan.lm_head_ms + plan.handoff_ms)
    # hand-off: 32 layers gather 8192 rows of 2*8*128*2 bytes from each of 3 ranks at 50 GB/s
    hw = load_profile("h100-rdma")
    expected = 32 * (hw.latency_s + 3 * 8192 * 4096 / hw.bandwidth_bytes_per_s)
    assert plan.handoff_ms == pytest.approx(expected * 1e3)
    # two decode ranks keep their shards and take one other shard each, at once; four move nothing
    two = plan_prefill(L8, 4, "h100-rdma", tokens=32768, decode_ranks=2)
    assert two.handoff_ms == pytest.approx(32 * (hw.latency_s + 8192 * 4096 / hw.bandwidth_bytes_per_s) * 1e3)
    assert plan_prefill(L8, 4, "h100-rdma", tokens=32768).handoff_ms == 0  # default: all 4 ranks decode
    fp8 = plan_prefill(L8, 4, "h100-rdma", tokens=32768, decode_ranks=1, kv_dtype="fp8")
    assert fp8.handoff_ms == pytest.approx(32 * (hw.latency_s + 3 * 8192 * 2 * 8 * 132 / hw.bandwidth_bytes_per_s) * 1e3)
    assert plan_prefill(L8, 4, "h100-rdma", tokens=32768, decode_ranks=1, handoff=False).handoff_ms == 0
    assert plan_prefill(L8, 4, "h100-rdma", tokens=32768, chunk_tokens=10**6).entries == plan.entries


def test_partial_prefill_uses_the_cache():
    # Llama3-405B, N = 4 on h100-rdma: Eq. 2 threshold 4000 tokens (peak C); 1000 new over 100000
    # cached has miss rate 0.0099 < alg5's 0.125 - 4*1000*50e9/(4*800e12*2) * (1 - 0.0099/2) = 0.0939
    plan = plan_prefill(L405, 4, "h100-rdma", tokens=1000, cached=100_000, tp_size=8)
    (entry,) = plan.entries
    assert entry.cached_tokens == 100_000 and entry.max_cached_per_rank == 25_000
    assert entry.strategy == PASS_Q
    assert entry.choice == choose_strategy(1000, 100_000, L405, 4, "h100-rdma", tp_size=8, max_cached_per_rank=25_000)
    assert entry.choice.alg5_miss_rate_threshold == pytest.approx(0.125 - 0.03125 * (1 - 1000 / 101_000 / 2))


@pytest.mark.parametrize("tokens, strategy", [(3200, PASS_Q), (12_800, PASS_KV), (25_600, PASS_KV)])
def test_paper_cp4_tp8_follow_up_at_128k(tokens, strategy):
    # The paper's CP4 x TP8 Llama3-405B runs at T + P = 128,000: pass-Q at a 2.5% miss rate,
    # pass-KV at 10% and 20% (test_strategy derives the thresholds)
    plan = plan_prefill(L405, 4, "h100-rdma", tokens=tokens, cached=128_000 - tokens, tp_size=8)
    assert [e.strategy for e in plan.entries] == [strategy]


def test_ttft_includes_the_tp_all_reduces_and_layer_overhead():
    # Llama3-8B, CP 2 x TP 4 on h200, 8192 tokens in one chunk: n = 4096 rows a rank.
    # Per layer: 2 all-reduces of 2*3/4*4096*4096*2 bytes at 450 GB/s + 20 us, and 40 us overhead.
    plan = plan_prefill(L8, 2, "h200", tokens=8192, tp_size=4)
    (entry,) = plan.entries
    allreduce = 2e-5 + 2 * 3 / 4 * 4096 * 4096 * 2 / 450e9
    assert plan.tp_allreduce_ms == pytest.approx(32 * 2 * allreduce * 1e3)
    assert plan.layer_overhead_ms == pytest.approx(32 * 4e-5 * 1e3)
    cost = entry.costs[entry.strategy]
    assert entry.chosen_ms == pytest.approx(32 * (cost.attention_s + cost.linear_s + 2 * allreduce + 4e-5) * 1e3)
    d = json.loads(plan.to_json())
    assert d["tp_allreduce_ms"] == pytest.approx(plan.tp_allreduce_ms)
    assert d["layer_overhead_ms"] == pytest.approx(plan.layer_overhead_ms)
    # TP 1 has no all-reduce, the overhead stays
    assert plan_prefill(L8, 8, "h200", tokens=8192).tp_allreduce_ms == 0


def test_chunked_plan_tokens_and_cache_progression():
    plan = plan_prefill(L8, 4, "h100-rdma", tokens=10_000, cached=800, chunk_tokens=4096)
    assert split_chunks(10_000, 4096) == [4096, 4096, 1808]
    assert [e.new_tokens for e in plan.entries] == [4096, 4096, 1808]
    assert [e.cached_tokens for e in plan.entries] == [800, 4896, 8992]
    # rows of the fullest rank: ceil(800/4) = 200, then + 1024 per 4096-token chunk
    assert [e.max_cached_per_rank for e in plan.entries] == [200, 1224, 2248]
    assert [e.index for e in plan.entries] == [0, 1, 2]
    assert plan.ttft_ms == pytest.approx(sum(e.chosen_ms for e in plan.entries) + plan.lm_head_ms + plan.handoff_ms)


def test_entry_times_are_the_cost_model():
    plan = plan_prefill(L405, 4, "h100-tcp", tokens=40_000, cached=5000, chunk_tokens=16_384, tp_size=8)
    for e in plan.entries:
        costs = predict_costs(e.new_tokens, e.cached_tokens, L405, 4, "h100-tcp", tp_size=8,
                              max_cached_per_rank=e.max_cached_per_rank)
        assert e.predicted_ms == {s: pytest.approx(costs[s].total_s * 1e3) for s in STRATEGIES}
        assert e.chosen_ms == e.predicted_ms[e.strategy]
    assert plan.best_ttft_ms <= plan.ttft_ms


def test_chunked_prefill_moves_from_pass_kv_to_pass_q():
    # h100-tcp, Llama3-405B, N = 4, chunks of 8192: chunk k has miss rate 1/(k+1); alg5's threshold
    # is 0.1006 (see test_strategy), so chunks 0-8 run pass-KV and the rest pass-Q.
    plan = plan_prefill(L405, 4, "h100-tcp", tokens=1 << 20, chunk_tokens=8192, tp_size=8, weight_dtype="float8")
    strategies = [e.strategy for e in plan.entries]
    assert len(strategies) == 128
    assert strategies == [PASS_KV] * 9 + [PASS_Q] * 119


def test_cost_rule_plan_is_the_best_plan():
    plan = plan_prefill(L405, 4, "h100-tcp", tokens=200_000, chunk_tokens=8192, tp_size=8, rule="cost")
    assert plan.ttft_ms == pytest.approx(plan.best_ttft_ms)


def test_model_by_preset_name_and_profile_by_path():
    path = load_profile("cpu").source_path
    plan = plan_prefill("smollm2-135m", 2, path, tokens=4096, dtype="float32")
    assert plan.model.name == "smollm2-135m" and plan.hardware.name == "cpu"


# ----------------------------------------------------------------------------- memory


def test_memory_hand_computed_llama3_8b():
    # N = 4, TP 1, bf16, 100000 tokens in one chunk: 25000 rows per rank.
    plan = plan_prefill(L8, 4, "h100-rdma", tokens=100_000)
    mem = plan.memory
    assert mem.weights_bytes == L8.n_params * 2 == 8_030_261_248 * 2
    # KV: 25000 rows * kv_bytes_per_token(2) = 25000 * (2*32*8*128*2 = 131072)
    assert mem.kv_cache_bytes == 25_000 * L8.kv_bytes_per_token(2) == 3_276_800_000
    # activations, t = 25000, pass-KV with no cache:
    #   hidden 4*25000*4096*2 = 819,200,000; qkv 25000*(32+16)*128*2 = 307,200,000
    #   mlp 3*25000*14336*2 = 2,150,400,000; accumulator 25000*32*129*4 = 412,800,000
    #   ring 2*(0+25000)*2*8*128*2 = 204,800,000; logits 128256*4 = 513,024
    assert mem.activation_bytes == 3_894_913_024
    assert mem.total_bytes == mem.weights_bytes + 3_276_800_000 + 3_894_913_024
    assert mem.capacity_bytes == 96e9 and mem.usable_bytes == pytest.approx(96e9 * MEMORY_USABLE_FRACTION)
    assert plan.fits and mem.fits


def test_activation_bytes_pass_q_hand_computed():
    # tiny, N = 2, TP 1, float32 (e = 4), chunk 100 -> t = 50:
    #   hidden 4*50*64*4 = 51,200; qkv 50*(4+4)*16*4 = 25,600; mlp 3*50*128*4 = 76,800
    #   accumulator 50*4*17*4 = 13,600; ring 2*50*4*16*4 = 25,600 + 2 * All2All (1*50*4*(64+4) = 13,600)
    #   logits 256*4 = 1,024
    assert activation_bytes_per_rank(TINY, 2, 1, 100, 0, PASS_Q, "float32") == 221_024
    # pass-KV with 30 cached rows: ring 2*(30+50)*2*2*16*4 = 40,960 instead of 52,800
    assert activation_bytes_per_rank(TINY, 2, 1, 100, 30, PASS_KV, "float32") == 221_024 - 52_800 + 40_960
    # one rank, t = 100, no ring buffers: 102,400 + 51,200 + 153,600 + 27,200 + 1,024
    assert activation_bytes_per_rank(TINY, 1, 1, 100, 0, PASS_Q, "float32") == 335_424


def test_memory_under_tensor_parallelism():
    # Llama3-405B, TP 8, float8 weights: n_params/8 bytes; KV has one head per GPU.
    assert weight_bytes_per_rank(L405, 8, "float8") == -(-L405.n_params // 8)
    # 62500 rows * 2 * 126 layers * 1 head * 128 * 2 bytes
    assert kv_cache_bytes_per_rank(L405, 62_500, 8, "bfloat16") == 62_500 * 2 * 126 * 128 * 2
    assert kv_cache_bytes_per_rank(L8, 1000, 1, "bfloat16") == 1000 * L8.kv_bytes_per_token(2)


def test_int8_weights_count_their_codes_where_a_cpu_model_keeps_them():
    """CPU profiles: the bf16 weights plus every block matrix's codes (1 byte) and exponents (1 per
    64), per TP rank, on both sides; GPU profiles: the weights alone (no codes are kept there)."""
    smol = get_preset("smollm2-135m")
    model_w = plan_prefill(smol, 2, "cpu", tokens=4096, dtype="bfloat16")
    int8_w = plan_prefill(smol, 2, "cpu", tokens=4096, dtype="bfloat16", weights="int8")
    codes = 30 * (576 * 960 + 576 * 576 + 2 * 1536 * 576 + 576 * 1536) * 65 // 64  # SmolLM2's blocks
    assert code_bytes(smol) == codes == 107_827_200
    assert int8_w.memory.weights_bytes == model_w.memory.weights_bytes + codes
    assert int8_w.decode.weights_bytes == model_w.decode.weights_bytes + codes
    assert int8_w.to_dict()["weights"] == "int8" and model_w.to_dict()["weights"] == "model"
    assert plan_prefill(L8, 4, "h100-rdma", tokens=1000, weights="int8").memory.weights_bytes == L8.n_params * 2
    tp2 = plan_prefill(L8, 2, "cpu", tokens=1000, tp_size=2, weights="int8")
    assert tp2.memory.weights_bytes == weight_bytes_per_rank(L8, 2, "bfloat16") + code_bytes(L8, 2)
    assert code_bytes(L8, 2) * 2 == code_bytes(L8)
    with pytest.raises(ValueError, match="int8 weights need a bfloat16 or float32 model"):
        plan_prefill(L8, 4, "h100-rdma", tokens=1000, weight_dtype="float8", weights="int8")
    with pytest.raises(ValueError, match="unknown weights 'int4'"):
        plan_prefill(L8, 4, "h100-rdma", tokens=1000, weights="int4")


def test_kv_rows_with_uneven_chunks():
    # 10 new tokens in chunks of 4 on N = 2: chunk rows 2, 2 and (2 tokens -> chunks of 1) 1 -> 5 rows;
    # the cache of 3 adds ceil(3/2) = 2.
    plan = plan_prefill(TINY, 2, "cpu", tokens=10, cached=3, chunk_tokens=4, dtype="float32")
    assert plan.memory.kv_cache_bytes == (2 + 2 + 2 + 1) * TINY.kv_bytes_per_token(4)


def test_does_not_fit():
    plan = plan_prefill(L405, 1, "h100-rdma", tokens=1000)  # 810 GB of bf16 weights on one GPU
    assert not plan.fits and plan.memory.total_bytes > plan.memory.usable_bytes
    assert json.loads(plan.to_json())["fits"] is False


# ----------------------------------------------------------------------------- JSON


def test_plan_json_schema():
    plan = plan_prefill("smollm2-135m", 2, "cpu", tokens=5000, cached=100, chunk_tokens=2048, dtype="float32")
    d = json.loads(plan.to_json())
    for key in ("model", "model_fingerprint", "hardware", "hardware_calibrated", "hardware_source", "cp_size",
                "tp_size", "dtype", "weight_dtype", "kv_dtype", "rule", "tokens", "cached", "chunk_tokens", "entries",
                "lm_head_ms", "ttft_ms", "best_ttft_ms", "memory", "decode", "fits", "suggestion"):
        assert key in d, key
    assert d["hardware_calibrated"] is False and d["chunk_tokens"] == 2048 and len(d["entries"]) == 3
    entry = d["entries"][1]
    assert entry["strategy"] in STRATEGIES and set(entry["predicted_ms"]) == {"pass-kv", "pass-q"}
    assert entry["cached_tokens"] == 2148 and entry["reason"].startswith("alg5: ")
    assert set(entry["costs"]) == set(STRATEGIES) and "sendrecv_bytes" in entry["costs"]["pass-kv"]
    assert set(d["memory"]) == {"weights_bytes", "kv_cache_bytes", "activation_bytes", "capacity_bytes",
                                "usable_bytes", "total_bytes", "fits", "state_bytes"}
    assert d["memory"]["state_bytes"] == 0  # no linear-attention layers
    assert d["ttft_ms"] == pytest.approx(plan.ttft_ms)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=0), "tokens must be an integer >= 1"),
    (dict(tokens=-5), "tokens must be an integer >= 1"),
    (dict(tokens=2.5), "tokens must be an integer >= 1"),
    (dict(cached=-1), "cached must be an integer >= 0"),
    (dict(cp_size=0), "cp_size must be an integer >= 1"),
    (dict(tp_size=0), "tp_size must be an integer >= 1"),
    (dict(tp_size=3), "tp_size=3 does not divide the 32 query heads"),
    (dict(chunk_tokens=0), "chunk_tokens must be an integer >= 1"),
    (dict(rule="alg9"), "unknown strategy rule 'alg9'"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
    (dict(hardware="cpu", dtype="float8"), "no peak_flops for dtype 'float8'"),
    (dict(hardware="tpu-v9"), "unknown hardware profile 'tpu-v9'"),
    (dict(model="llama9"), "unknown model preset 'llama9'"),
    (dict(model=42), "model must be a ModelConfig or a preset name"),
])
def test_plan_validates_inputs(kwargs, match):
    args = dict(model=L8, cp_size=4, hardware="h100-rdma", tokens=1000) | kwargs
    with pytest.raises(ValueError, match=match):
        plan_prefill(**args)


# ----------------------------------------------------------------------------- default chunk size


def test_default_chunk_is_the_whole_prompt_when_it_fits():
    assert fitting_chunk_tokens("smollm2-135m", 2, "cpu", 20_000, dtype="float32") == 20_000


def test_default_chunk_is_the_largest_fitting_power_of_two():
    hw = dataclasses.replace(load_profile("h100-rdma"), memory_bytes=80e9)
    kwargs = dict(tokens=1 << 20, tp_size=8, weight_dtype="float8")
    chunk = fitting_chunk_tokens(L405, 4, hw, **kwargs)
    assert chunk < 1 << 20 and chunk & (chunk - 1) == 0 and chunk >= MIN_DEFAULT_CHUNK_TOKENS
    # the chunk size is about the prefill ranks (the bf16 cache of 1M tokens does not fit one decode host)
    assert plan_prefill(L405, 4, hw, chunk_tokens=chunk, **kwargs).memory.fits
    for strategy_rule in ("alg1", "cost"):  # the bound holds whatever the rule picks
        assert plan_prefill(L405, 4, hw, chunk_tokens=chunk, rule=strategy_rule, **kwargs).memory.fits
    # the documented rule rejects twice the chunk: weights + full KV + worst working set > usable
    rows = tokens_per_rank(1 << 20, 4)
    fixed = weight_bytes_per_rank(L405, 8, "float8") + kv_cache_bytes_per_rank(L405, rows, 8, "bfloat16")
    worst = max(activation_bytes_per_rank(L405, 4, 8, 2 * chunk, rows, s, "bfloat16") for s in STRATEGIES)
    assert fixed + worst > 80e9 * MEMORY_USABLE_FRACTION


def test_default_chunk_refuses_when_nothing_fits():
    with pytest.raises(ValueError, match="does not fit 'h100-rdma'.*more CP ranks"):
        fitting_chunk_tokens(L405, 1, "h100-rdma", 100_000)


# ----------------------------------------------------------------------------- sanity against the paper


def test_paper_scale_predictions():
    # Llama3-405B, TP8 per host, FP8 weights, CP over hosts on the paper's H100s (h100-rdma).
    # Paper: 1M tokens on 16 hosts in 77 s; 128K tokens in 42 s on 1 host, 3.8 s on 16 hosts,
    # latency halving as the host count doubles. The model's numbers are data-sheet ones and the
    # TP all-reduces (450 GB/s NVLink) and launches are guesses: within 2x, about 2x per doubling.
    def ttft_s(tokens, hosts):
        plan = plan_prefill(L405, hosts, "h100-rdma", tokens=tokens, tp_size=8, weight_dtype="float8")
        assert plan.memory.fits  # the prefill ranks; the decode host is test_paper_scale_decode_needs_fp8
        return plan.ttft_ms / 1e3

    assert 77 / 2 <= ttft_s(1 << 20, 16) <= 77 * 2
    assert 42 / 2 <= ttft_s(131072, 1) <= 42 * 2
    assert 3.8 / 2 <= ttft_s(131072, 16) <= 3.8 * 2
    for hosts in (1, 2, 4, 8):
        assert 1.8 <= ttft_s(131072, hosts) / ttft_s(131072, 2 * hosts) <= 2.05


def test_paper_scale_decode_needs_fp8():
    # One TP8 host of H100s decoding the 1M-token 405B prefill: fp8 weights 50.7 GB + the bf16 cache
    # 1,048,832 rows * 2*126 layers*1 head*128*2 = 67.7 GB per GPU > 86.4 GB usable; fp8 KV
    # (132 bytes a head row) makes it 33.3 GB + 50.7 GB, which fits.
    kwargs = dict(tokens=1 << 20, tp_size=8, weight_dtype="float8")
    plan = plan_prefill(L405, 16, "h100-rdma", **kwargs)
    assert plan.memory.fits and not plan.decode.fits and not plan.fits
    assert plan.decode.kv_slice_bytes == ((1 << 20) + 256) * 2 * 126 * 128 * 2
    assert plan.decode_suggestion == DecodeSetting(1, "fp8")
    fp8 = plan_prefill(L405, 16, "h100-rdma", kv_dtype="fp8", **kwargs)
    assert fp8.fits and fp8.decode.kv_slice_bytes == ((1 << 20) + 256) * 2 * 126 * 132


# ----------------------------------------------------------------------------- KV dtype


def test_kv_row_bytes_hand_computed():
    # tiny: 2 layers, 2 KV heads, head_dim 16. A token's K and V: 2*2*2*16 = 128 elements.
    assert kv_row_bytes(TINY, 1, "float32") == 128 * 4 == TINY.kv_bytes_per_token(4)
    assert kv_row_bytes(TINY, 1, "bfloat16") == kv_row_bytes(TINY, 1, "float32", "bfloat16") == 128 * 2
    assert kv_row_bytes(TINY, 1, "bfloat16", "float32") == 128 * 4
    assert kv_row_bytes(TINY, 1, "bfloat16", "float16") == 128 * 2
    # 8-bit: one byte per element + a float32 scale per (token, KV head): 2*2*2 heads-rows * (16 + 4)
    assert kv_row_bytes(TINY, 1, "bfloat16", "fp8") == kv_row_bytes(TINY, 1, "float32", "int8") == 160
    assert kv_row_bytes(TINY, 2, "bfloat16", "fp8") == 80  # TP 2: one KV head per GPU
    # Llama-3.1-8B: 131,072 bytes of bf16 KV per token, 2*32*8*(128+4) = 67,584 in fp8
    assert kv_row_bytes(L8, 1, "bfloat16") == 131_072 and kv_row_bytes(L8, 1, "bfloat16", "fp8") == 67_584
    assert kv_cache_bytes_per_rank(L8, 1000, 1, "bfloat16", "int8") == 67_584_000


def test_prefill_shard_is_stored_in_the_kv_dtype_ring_messages_are_not():
    # test_memory_hand_computed_llama3_8b with an fp8 cache: 25000 rows * 67,584 bytes; the working
    # set (pass-KV ring buffers included) stays in bf16.
    plan = plan_prefill(L8, 4, "h100-rdma", tokens=100_000, kv_dtype="fp8")
    assert plan.memory.kv_cache_bytes == 25_000 * 67_584 == 1_689_600_000
    assert plan.memory.activation_bytes == 3_894_913_024
    assert plan.kv_dtype == "fp8" and plan.dtype == "bfloat16"
    assert plan.ttft_ms == pytest.approx(plan_prefill(L8, 4, "h100-rdma", tokens=100_000).ttft_ms)


def test_default_chunk_counts_the_kv_dtype():
    # 1M tokens on 4 ranks of 60 GB (54 GB usable): weights 16.1 GB + a bf16 shard of 262,144 rows
    # (34.4 GB) leave room for 32K-token chunks; the fp8 shard (17.7 GB) for 256K-token ones
    hw = dataclasses.replace(load_profile("h100-rdma"), memory_bytes=60e9)
    assert fitting_chunk_tokens(L8, 4, hw, 1 << 20) == 32_768
    assert fitting_chunk_tokens(L8, 4, hw, 1 << 20, kv_dtype="fp8") == 262_144


# ----------------------------------------------------------------------------- the decode side


def test_decode_memory_hand_computed_tiny():
    # tiny (vocab 256, dim 64, 4 q / 2 kv heads x 16, ffn 128), float32, 1000 tokens over 2 decode
    # ranks of an h200 host, fp8 cache: slice = ceil((1000 + 256) / 2) = 628 rows
    d = plan_decode(TINY, "h200", 1000, 2, "fp8", dtype="float32")
    assert DECODE_ROOM_TOKENS == 256 and d.slice_tokens == 628 and d.context_tokens == 1000
    assert d.weights_bytes == TINY.n_params * 4
    assert d.kv_slice_bytes == 628 * 160 == 100_480
    # one token, one layer: hidden 4*64*4 = 1024, qkv (4+4)*16*4 = 512, mlp 3*128*4 = 1536,
    # accumulator 4*17*4 = 272
    assert d.token_activation_bytes == 3344
    assert d.scores_bytes == 4 * 628 * 4 == 10_048  # float32 scores of 4 q heads over the slice
    assert d.logits_bytes == 256 * 4
    assert DEQUANT_BLOCK_TOKENS >= 628 and d.dequant_bytes == 2 * 628 * 2 * 16 * 4 == 160_768
    assert d.workspace_bytes == 3344 + 10_048 + 1024 + 160_768
    assert d.total_bytes == TINY.n_params * 4 + 100_480 + d.workspace_bytes
    assert d.capacity_bytes == 141e9 and d.usable_bytes == pytest.approx(141e9 * MEMORY_USABLE_FRACTION)
    assert d.fits and d.max_decode_ranks == 8
    # a float cache is read in place: no dequantized block; bf16 cache 628 * 256 bytes
    f = plan_decode(TINY, "h200", 1000, 2, "bfloat16", dtype="float32")
    assert f.dequant_bytes == 0 and f.kv_slice_bytes == 628 * 256 and f.token_activation_bytes == 3344
    # TP 2: half the weights, the heads split (2 q heads, 1 KV head), up to 8 // 2 = 4 decode ranks
    t = plan_decode(TINY, "h200", 1000, 4, "fp8", tp_size=2, dtype="float32")
    assert t.weights_bytes == -(-TINY.n_params * 4 // 2) and t.max_decode_ranks == 4
    assert t.slice_tokens == 314 and t.kv_slice_bytes == 314 * 80 and t.scores_bytes == 2 * 314 * 4


def test_decode_dequant_block_is_capped():
    d = plan_decode(L8, "h200", 100_000, 1, "int8")
    assert d.dequant_bytes == 2 * DEQUANT_BLOCK_TOKENS * 8 * 128 * 4


def test_decode_fits_at_the_boundary():
    need = plan_decode(L8, "h200", 10_000_000, 8, "fp8").total_bytes
    h200 = load_profile("h200")
    at = dataclasses.replace(h200, memory_bytes=need / MEMORY_USABLE_FRACTION * (1 + 1e-9))
    below = dataclasses.replace(h200, memory_bytes=need / MEMORY_USABLE_FRACTION * (1 - 1e-9))
    assert plan_decode(L8, at, 10_000_000, 8, "fp8").fits
    assert not plan_decode(L8, below, 10_000_000, 8, "fp8").fits
    kwargs = dict(tokens=10_000_000, decode_ranks=8, kv_dtype="fp8")
    assert plan_prefill(L8, 32, at, **kwargs).fits
    plan = plan_prefill(L8, 32, below, **kwargs)
    assert plan.memory.fits and not plan.fits and decode_problem(plan) is not None


def test_ten_million_tokens_llama3_8b_h200_fp8_fits():
    # 10M + 256 rows over 8 H200s: 1,250,032 rows * 67,584 = 84.48 GB + 16.06 GB of bf16 weights
    # + workspace (147,584 + scores 32*1,250,032*4 + logits 128,256*4 + block 2*4096*8*128*4)
    plan = plan_prefill(L8, 32, "h200", tokens=10_000_000, decode_ranks=8, kv_dtype="fp8")
    d = plan.decode
    assert d.slice_tokens == 1_250_032 and d.kv_slice_bytes == 84_482_162_688
    assert d.weights_bytes == 16_060_522_496
    assert d.workspace_bytes == 147_584 + 160_004_096 + 513_024 + 33_554_432
    assert d.total_bytes == 100_736_904_320 <= 141e9 * MEMORY_USABLE_FRACTION
    assert plan.memory.kv_cache_bytes == 312_500 * 67_584  # the prefill shards are fp8 too
    assert plan.memory.fits and d.fits and plan.fits
    assert plan.decode_suggestion is None and decode_problem(plan) is None
    assert json.loads(plan.to_json())["suggestion"] is None


def test_ten_million_tokens_on_one_decode_rank_is_refused():
    plan = plan_prefill(L8, 32, "h200", tokens=10_000_000, decode_ranks=1, kv_dtype="fp8")
    assert plan.memory.fits and not plan.decode.fits and not plan.fits
    # 6 ranks: 1,666,710 rows * 67,584 = 112.6 GB + 16.1 GB > 126.9 GB; 7 ranks: 96.6 GB + 16.1 GB fit
    assert not plan_decode(L8, "h200", 10_000_000, 6, "fp8").fits
    assert plan_decode(L8, "h200", 10_000_000, 7, "fp8").fits
    assert plan.decode_suggestion == DecodeSetting(7, "fp8")
    line = decode_problem(plan)
    assert "\n" not in line and line.startswith("the decode does not fit")
    assert "693.2 GB per device" in line and "126.9 GB usable" in line
    assert line.endswith("the smallest setting that fits is --decode-ranks 7 --kv-dtype fp8")


def test_ten_million_tokens_in_bf16_no_longer_fit():
    # the whole bf16 cache over the host's 8 H200s: 1,250,032 * 131,072 = 163.8 GB per device
    plan = plan_prefill(L8, 32, "h200", tokens=10_000_000)
    assert plan.decode.decode_ranks == 8 and plan.decode.kv_dtype == "model"
    assert plan.decode.kv_slice_bytes == 1_250_032 * 131_072
    assert plan.memory.fits and not plan.fits
    assert plan.decode_suggestion == DecodeSetting(7, "fp8")  # no bf16 count fits, so fp8
    d = json.loads(plan.to_json())
    assert d["fits"] is False and d["memory"]["fits"] is True and d["decode"]["fits"] is False
    assert d["decode"]["smallest_fitting"] == {"decode_ranks": 7, "kv_dtype": "fp8"}
    assert d["suggestion"] == decode_problem(plan) and "(KV cache bfloat16)" in d["suggestion"]


def test_suggestion_keeps_the_kv_dtype_when_more_ranks_suffice():
    # 4M bf16 tokens: 4 ranks need 131.1 GB of bf16 KV per device, 5 ranks 104.9 GB (+ 16.1 GB)
    plan = plan_prefill(L8, 8, "h200", tokens=4_000_000, decode_ranks=1)
    assert not plan_decode(L8, "h200", 4_000_000, 4).fits and plan_decode(L8, "h200", 4_000_000, 5).fits
    assert plan.decode_suggestion == DecodeSetting(5, "model")
    assert decode_problem(plan).endswith("--decode-ranks 5 --kv-dtype model")


def test_nothing_fits_on_one_host():
    # 405B in bf16 on one H100 without TP: 811.7 GB of weights on every decode rank
    plan = plan_prefill(L405, 1, "h100-rdma", tokens=1000)
    assert plan.decode_suggestion is None and not plan.fits
    line = decode_problem(plan)
    assert "no setting on one 'h100-rdma' host fits: even --decode-ranks 8 --kv-dtype fp8 needs 811.8 GB" in line
    assert "devices of 901.9 GB would do" in line and "\n" not in line
    tail = "a larger TP size, a shorter context or a smaller model"
    assert line.endswith(f"use 8-bit weights (--weight-dtype float8), {tail}")
    fp8 = decode_problem(plan_prefill(L405, 1, "h100-rdma", tokens=1000, weight_dtype="float8"))
    assert "--weight-dtype float8" not in fp8 and fp8.endswith(f"use {tail}")
    # an 8-bit cache is never swapped for the other 8-bit format (same size)
    plan = plan_prefill(L8, 64, "h200", tokens=20_000_000, kv_dtype="int8")
    assert plan.decode_suggestion is None
    assert "even --decode-ranks 8 --kv-dtype int8 needs" in decode_problem(plan)


def test_default_decode_ranks():
    h200 = load_profile("h200")
    assert h200.devices_per_host == 8 and load_profile("cpu").devices_per_host == 2
    assert default_decode_ranks(h200, 32, 1) == 8  # every GPU of the decode host
    assert default_decode_ranks(h200, 4, 1) == 4   # the job has fewer ranks
    assert default_decode_ranks(h200, 16, 8) == 1  # a TP8 rank takes the whole host
    assert plan_prefill(L8, 32, "h200", tokens=1000).decode.decode_ranks == 8
    assert plan_prefill(L8, 3, "h200", tokens=1000).decode.decode_ranks == 3
    # profiles without the field: host_cores on CPU hosts, else an 8-GPU host
    cpu_host = dataclasses.replace(load_profile("cpu"), devices_per_host=None, host_cores=4)
    assert cpu_host.host_devices() == 4
    gpu = dataclasses.replace(h200, devices_per_host=None)
    assert gpu.host_devices() == DEFAULT_DEVICES_PER_HOST == 8


def test_decode_ranks_share_a_host_ram_profile():
    # host_cores profiles describe the host's RAM: 2 decode ranks get half of it each
    hw = dataclasses.replace(load_profile("cpu"), host_cores=2, devices_per_host=None)
    assert plan_decode(TINY, hw, 100, 2, dtype="float32").capacity_bytes == pytest.approx(10e9 / 2)
    assert plan_decode(TINY, hw, 100, 1, dtype="float32").capacity_bytes == pytest.approx(10e9)


def test_devices_per_host_in_profiles(tmp_path):
    data = load_profile("h200").to_dict()
    assert data["devices_per_host"] == 8
    data["devices_per_host"] = 4
    path = tmp_path / "four.json"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).host_devices() == 4
    with pytest.raises(ValueError, match="decode_ranks must be an integer from 1 to 4"):
        plan_prefill(L8, 8, str(path), tokens=1000, decode_ranks=5)
    data["devices_per_host"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="field 'devices_per_host' must be a positive integer"):
        load_profile(str(path))


def test_decode_json_fields():
    d = json.loads(plan_prefill(L8, 4, "h100-rdma", tokens=100_000, kv_dtype="int8").to_json())
    assert d["kv_dtype"] == "int8" and d["fits"] is True and d["suggestion"] is None
    assert set(d["decode"]) == {
        "decode_ranks", "max_decode_ranks", "kv_dtype", "context_tokens", "slice_tokens", "weights_bytes",
        "kv_slice_bytes", "kv_slice_all_rows_bytes", "token_activation_bytes", "scores_bytes", "logits_bytes",
        "dequant_bytes", "capacity_bytes", "usable_bytes", "workspace_bytes", "total_bytes", "fits",
        "smallest_fitting", "state_bytes"}
    assert d["decode"]["kv_slice_bytes"] == d["decode"]["kv_slice_all_rows_bytes"]  # every layer full
    dec = d["decode"]
    assert dec["decode_ranks"] == 4 and dec["slice_tokens"] == 25_064 and dec["kv_slice_bytes"] == 25_064 * 67_584
    assert dec["total_bytes"] == dec["weights_bytes"] + dec["kv_slice_bytes"] + dec["workspace_bytes"]
    assert dec["fits"] is True and dec["smallest_fitting"] is None


def test_a_document_of_a_3_to_1_chunked_model_keeps_about_a_quarter_of_its_kv():
    """tiny-llama4 (3 layers in chunks of 8,192 : 1 global) at 1M tokens: the decode slice keeps
    the global layer's rows and the current chunk of the others, about 1/4 of every row."""
    d = json.loads(plan_prefill("tiny-llama4", 2, "cpu", tokens=1_000_000).to_json())["decode"]
    share = d["kv_slice_bytes"] / d["kv_slice_all_rows_bytes"]
    tokens = 1_000_000 + 256  # the decode room
    assert share == pytest.approx((tokens + 3 * (tokens % 8192)) / (4 * tokens), rel=1e-3)
    assert 0.25 < share < 0.26


def test_a_cpu_prefill_shard_of_a_chunked_model_holds_its_global_layer_and_the_chunks_it_sees():
    """tiny-llama4 at 1M tokens on 2 CPU ranks: each shard drops what the next chunk no longer sees
    (KVCache.drop_unseen in place), so at its fullest it holds the global layer's rows and, per
    chunked layer, at most the chunk of 8,192 the last prefill chunk starts in plus its own rows; a
    GPU profile counts every row (its shard frees nothing before the hand-off)."""
    from ringctx.planning.memory import kv_cache_bytes_per_rank

    cpu = json.loads(plan_prefill("tiny-llama4", 2, "cpu", tokens=1_000_000, chunk_tokens=4096).to_json())
    gpu = plan_prefill("tiny-llama4", 2, "h200", tokens=1_000_000, chunk_tokens=4096)
    every = kv_cache_bytes_per_rank(get_preset("tiny-llama4"), 500_000, 1, cpu["dtype"])
    assert gpu.memory.kv_cache_bytes == kv_cache_bytes_per_rank(get_preset("tiny-llama4"), 500_000, 1, gpu.dtype)
    kept = cpu["memory"]["kv_cache_bytes"]
    row = every // 500_000 // 4  # one layer's row
    chunk_rows = 4096 // 2
    assert row * 500_000 < kept <= row * (500_000 + 3 * (8191 + chunk_rows))
    assert kept < 0.3 * every


@pytest.mark.parametrize("kwargs, match", [
    (dict(decode_ranks=0), r"decode_ranks must be an integer from 1 to 8 \(the 8 devices of one 'h200' host"),
    (dict(decode_ranks=9), r"decode_ranks must be an integer from 1 to 8 .*got 9; pass 1 to 8"),
    (dict(decode_ranks=2.0), "decode_ranks must be an integer from 1 to 8"),
    (dict(decode_ranks=True), "decode_ranks must be an integer from 1 to 8"),
    (dict(kv_dtype="fp4"), r"unknown kv_dtype 'fp4'; use one of model, bfloat16, float16, float32, fp8, int8"),
    (dict(kv_dtype="float8"), "unknown kv_dtype 'float8'"),
    (dict(model=L405, tp_size=16), r"tp_size=16 is more than the 8 devices of one 'h200' host"),
    (dict(model=L405, tp_size=2, decode_ranks=5), r"from 1 to 4 \(the 8 devices of one 'h200' host / tp_size 2"),
])
def test_decode_inputs_are_checked(kwargs, match):
    args = dict(model=L8, cp_size=32, hardware="h200", tokens=1000) | kwargs
    with pytest.raises(ValueError, match=match):
        plan_prefill(**args)


def test_plan_decode_checks_its_inputs():
    with pytest.raises(ValueError, match="context_tokens must be an integer >= 0"):
        plan_decode(L8, "h200", -1, 1)
    with pytest.raises(ValueError, match="decode_ranks must be an integer from 1 to 8"):
        plan_decode(L8, "h200", 10, None)
    with pytest.raises(ValueError, match="unknown kv_dtype 'q4'"):
        plan_decode(L8, "h200", 10, 1, "q4")


# ----------------------------------------------------------------------------- choosing the mesh


def test_mesh_tp_sizes_follow_the_heads():
    # 405B: 128 q / 8 KV heads, ffn 53248: every divisor of 8 splits it
    assert mesh_tp_sizes(L405, 8) == ([1, 2, 4, 8], {})
    # on a 6-GPU host 3 and 6 divide neither the 32 query heads of Llama3-8B
    valid, excluded = mesh_tp_sizes(L8, 6)
    assert valid == [1, 2] and set(excluded) == {3, 6}
    assert "tp_size=3 does not divide the 32 query heads" in excluded[3]


def test_propose_mesh_picks_the_smallest_tp_that_fits():
    # 1M tokens of Llama3-405B with fp8 weights on 16 hosts x 8 H100s: n_params/TP bytes of weights
    # per GPU; TP 4 already needs 101.5 GB > 86.4 GB usable, TP 8 fits (weights 50.7 GB).
    kwargs = dict(tokens=1_000_000, weight_dtype="float8")
    proposal = propose_mesh(L405, 16, 8, "h100-rdma", **kwargs)
    assert [(o.cp_size, o.tp_size) for o in proposal.options] == [(128, 1), (64, 2), (32, 4), (16, 8)]
    usable = 96e9 * MEMORY_USABLE_FRACTION
    assert weight_bytes_per_rank(L405, 4, "float8") > usable
    assert [o.fits for o in proposal.options] == [False, False, False, True]
    assert (proposal.chosen.cp_size, proposal.chosen.tp_size) == (16, 8) and not proposal.forced
    assert "TP 8 is the smallest that fits" in proposal.reason and proposal.problem() is None
    for o in proposal.options:  # each option is the plan of its mesh
        expected = plan_prefill(L405, o.cp_size, "h100-rdma", tp_size=o.tp_size, **kwargs)
        assert o.ttft_ms == pytest.approx(expected.ttft_ms) and o.memory_bytes == expected.memory.total_bytes
        assert o.plan.tp_allreduce_ms > 0 if o.tp_size > 1 else o.plan.tp_allreduce_ms == 0
    d = proposal.to_dict()
    assert d["chosen"] == {"cp_size": 16, "tp_size": 8} and len(d["options"]) == 4
    assert json.loads(json.dumps(d))["options"][3]["fits"] is True


def test_propose_mesh_forced_tp_and_gpus_per_host():
    proposal = propose_mesh(L405, 16, 8, "h100-rdma", 1_000_000, weight_dtype="float8", tp_size=4)
    assert proposal.forced and (proposal.chosen.cp_size, proposal.chosen.tp_size) == (32, 4)
    assert not proposal.chosen.fits and proposal.problem() is None  # forced: planned, fitting or not
    # 4-GPU hosts: the host size replaces the profile's devices_per_host (the decode host too)
    four = propose_mesh(L8, 2, 4, "h200", 100_000)
    assert [(o.cp_size, o.tp_size) for o in four.options] == [(8, 1), (4, 2), (2, 4)]
    assert four.chosen.tp_size == 1 and four.chosen.plan.decode.max_decode_ranks == 4
    with pytest.raises(ValueError, match="tp_size=3 does not divide the 8 GPUs of a host"):
        propose_mesh(L8, 2, 8, "h200", 1000, tp_size=3)
    with pytest.raises(ValueError, match="hosts must be an integer >= 1"):
        propose_mesh(L8, 0, 8, "h200", 1000)


def test_propose_mesh_when_nothing_fits():
    # bf16 weights of 405B: 101.5 GB per GPU even at TP 8
    proposal = propose_mesh(L405, 16, 8, "h100-rdma", 1_000_000)
    assert proposal.chosen is None and not any(o.fits for o in proposal.options)
    line = proposal.problem()
    assert line.startswith("no mesh of 16 hosts x 8 GPUs fits llama3-405b with 1,000,000 tokens")
    assert "CP 16 x TP 8" in line and "--weight-dtype float8" in line and "\n" not in line
    assert proposal.to_dict()["chosen"] is None
