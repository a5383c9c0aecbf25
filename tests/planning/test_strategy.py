"""Strategy heuristic (paper Eq. 1-3, Algorithms 1 and 5), cost model, empirical rule, profiles.

Every formula is checked against numbers computed by hand in the comments.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ringctx.model.config import ModelConfig
from ringctx.model.presets import get_preset
from ringctx.planning.hardware import (
    EmpiricalRuleCoefficients, HardwareProfile, ThroughputPoint, builtin_profiles, canonical_dtype,
    element_bytes, interpolate_throughput, load_profile, save_profile,
)
from ringctx.planning.strategy import (
    PASS_KV, PASS_Q, RULES, alg5_miss_rate_threshold, alg5_prefers_pass_kv, all2all_bytes_per_rank,
    attention_flops, cached_rows_per_rank, choose_strategy, fit_default_rules, fit_empirical_rule,
    fit_empirical_rule_to_alg5, fitting_grid, linear_flops, linear_params_per_layer, local_heads,
    message_size_threshold, miss_rate, pass_kv_compute_threshold, pass_kv_message_bytes, pass_q_context_threshold,
    pass_q_message_bytes, predict_costs, predict_strategy_cost, ring_seconds, tokens_per_rank, transfer_seconds,
)

L405 = get_preset("llama3-405b")
L8 = get_preset("llama3-8b")
SMOL = get_preset("smollm2-135m")
TINY = get_preset("tiny")


def profile(**overrides) -> HardwareProfile:
    """A profile with round numbers; fields overridable."""
    base = HardwareProfile(name="test", description="round numbers", calibrated=False,
                           peak_flops={"bfloat16": 1e12, "float32": 5e11}, achieved_fraction=1.0,
                           bandwidth_bytes_per_s=1e9, latency_s=1e-5, memory_bytes=1e10)
    return dataclasses.replace(base, **overrides)


# The paper's H100 numbers: C = 800 TF/s (peak), BW = 50 GB/s, e = 2. The thresholds use the peak
# whatever the achieved fraction; achieved_fraction 1 makes the cost model run on the same C.
PAPER_H100 = dataclasses.replace(load_profile("h100-rdma"), achieved_fraction=1.0, latency_s=0.0)


# ----------------------------------------------------------------------------- Eq. 1-3, Alg. 1/5


def test_message_size_threshold_llama3_405b_is_12_5_percent():
    # 2 * NKV / NH = 2 * 8 / 128
    assert message_size_threshold(L405.n_heads, L405.n_kv_heads) == 0.125
    assert message_size_threshold(SMOL.n_heads, SMOL.n_kv_heads) == pytest.approx(2 * 3 / 9)


def test_pass_kv_compute_threshold_paper_h100_is_4000_tokens():
    # N*C*NKV*e/(2*NH*BW) = 4 * 800e12 * 8 * 2 / (2 * 128 * 50e9) = 4000
    assert pass_kv_compute_threshold(4, 800e12, 128, 8, 2, 50e9) == pytest.approx(4000)
    choice = choose_strategy(4096, 0, L405, 4, PAPER_H100)
    assert choice.compute_threshold_tokens == pytest.approx(4000)
    assert (choice.peak_flops, choice.bandwidth_bytes_per_s, choice.element_bytes) == (800e12, 50e9, 2)
    # the built-in profile's cost model runs at 63% of peak, its thresholds at the peak, as the paper's
    builtin = choose_strategy(4096, 0, L405, 4, "h100-rdma")
    assert load_profile("h100-rdma").achieved_fraction < 1
    assert builtin.peak_flops == 800e12 and builtin.compute_threshold_tokens == pytest.approx(4000)


def test_pass_q_context_threshold_eq3():
    # N*e*C/(4*BW) = 4 * 2 * 800e12 / (4 * 50e9) = 32000
    assert pass_q_context_threshold(4, 800e12, 2, 50e9) == pytest.approx(32000)


def test_alg5_threshold_hand_computed_and_below_alg1():
    # 0.125 - 4*T*BW/(N*C*e) * (1 - m/2), 4*1000*50e9/(4*800e12*2) = 0.03125:
    # T = 1000, P = 9000 (m = 0.1): 0.125 - 0.03125 * 0.95 = 0.0953125
    assert alg5_miss_rate_threshold(1000, 9000, 4, 800e12, 128, 8, 2, 50e9) == pytest.approx(0.0953125)
    # a cache far larger than T (m -> 0): the paper's 0.125 - 0.03125
    assert alg5_miss_rate_threshold(1000, 10**12, 4, 800e12, 128, 8, 2, 50e9) == pytest.approx(0.09375)
    for T in (1, 10, 100, 1000, 3999, 100_000):
        for P in (0, T, 100 * T):
            assert alg5_miss_rate_threshold(T, P, 4, 800e12, 128, 8, 2, 50e9) < message_size_threshold(128, 8)


def test_miss_rate():
    assert miss_rate(1000, 3000) == 0.25
    assert miss_rate(5, 0) == 1.0


def test_compute_threshold_decides_both_rules_at_4000():
    # Alg. 5's miss-rate threshold is 2r*(1 - T/4000) -> 3.1e-5 at T = 3999: the cache must be huge
    # (m = 3999/(3999+1e9) = 4e-6) for only Eq. 2 to decide.
    P = 10**9
    for rule in ("alg1", "alg5"):
        at = choose_strategy(4000, P, L405, 4, PAPER_H100, rule)
        below = choose_strategy(3999, P, L405, 4, PAPER_H100, rule)
        assert at.strategy == PASS_KV and "4000" in at.reason and "Eq. 2" in at.reason
        assert below.strategy == PASS_Q and "3999 < 4000" in below.reason


def test_alg1_and_alg5_disagree_between_their_miss_rate_thresholds():
    # T = 1000, P = 9000: miss rate 0.1, between alg5's 0.09531 and alg1's 0.125; T < 4000.
    alg1 = choose_strategy(1000, 9000, L405, 4, PAPER_H100, "alg1")
    alg5 = choose_strategy(1000, 9000, L405, 4, PAPER_H100, "alg5")
    assert alg1.strategy == PASS_Q and "0.1 < 0.125" in alg1.reason
    assert alg5.strategy == PASS_KV and "0.1 >= 0.09531" in alg5.reason
    assert alg5.alg5_miss_rate_threshold == pytest.approx(0.0953125)


# The paper's CP4 x TP8 Llama3-405B partial prefills at 128K context (T + P = 128,000): pass-Q
# is faster below a 5% miss rate, pass-KV above it.
PAPER_128K = 128_000


def test_paper_cp4_tp8_partial_prefill_at_2_5_percent_picks_pass_q():
    # h100-rdma as built in; per GPU under TP8: NH = 16, NKV = 1.
    # Eq. 2 with the peak C: 4*800e12*1*2/(2*16*50e9) = 4000 > 3200, so the miss rate decides.
    # Alg. 5: 0.125 - 4*3200*50e9/(4*800e12*2) * (1 - 0.025/2) = 0.125 - 0.1*0.9875 = 0.02625 > m = 0.025.
    T = 3200
    choice = choose_strategy(T, PAPER_128K - T, L405, 4, "h100-rdma", tp_size=8)
    assert choice.strategy == PASS_Q
    assert (choice.n_heads, choice.n_kv_heads, choice.tp_size) == (16, 1, 8)
    assert choice.compute_threshold_tokens == pytest.approx(4000)
    assert choice.miss_rate == pytest.approx(0.025)
    assert choice.alg5_miss_rate_threshold == pytest.approx(0.125 - 0.1 * (1 - 0.025 / 2))
    # Without the causal factor (the paper's 4*T*(T+P)*D FLOPs) the threshold is exactly m: a tie
    # that Algorithm 5's >= gives to pass-KV; with the achieved C (63% of peak) Eq. 2 alone would
    # pick pass-KV (threshold 0.63 * 4000 = 2520 < 3200).
    assert 0.125 - 4 * T * 50e9 / (4 * 800e12 * 2) == pytest.approx(choice.miss_rate)
    assert pass_kv_compute_threshold(4, 0.63 * 800e12, 16, 1, 2, 50e9) == pytest.approx(2520)


@pytest.mark.parametrize("miss", [0.1, 0.2])
def test_paper_cp4_tp8_partial_prefill_at_higher_miss_rates_picks_pass_kv(miss):
    # T = 12,800 and 25,600 are both >= 4000: pass-KV's transfer hides under compute (Eq. 2)
    T = round(PAPER_128K * miss)
    choice = choose_strategy(T, PAPER_128K - T, L405, 4, "h100-rdma", tp_size=8)
    assert choice.strategy == PASS_KV and "Eq. 2" in choice.reason and T >= choice.compute_threshold_tokens


def test_paper_cp4_tp8_crossover_near_5_percent():
    # pass-Q at 1% and 2.5%, pass-KV from 5% on (T = 6400 >= 4000)
    picks = {m: choose_strategy(round(PAPER_128K * m), PAPER_128K - round(PAPER_128K * m), L405, 4, "h100-rdma",
                                tp_size=8).strategy for m in (0.01, 0.025, 0.05, 0.1, 0.2, 0.5)}
    assert picks == {0.01: PASS_Q, 0.025: PASS_Q, 0.05: PASS_KV, 0.1: PASS_KV, 0.2: PASS_KV, 0.5: PASS_KV}


def test_reasons_name_the_heads_per_tp_rank():
    # Llama3-8B (32 q / 8 KV heads): TP 4 splits both, the ratio and every threshold stay the model's
    one, four = (choose_strategy(100, 10_000, L8, 4, "h100-rdma", rule, tp_size=tp) for tp, rule in
                 ((1, "alg5"), (4, "alg5")))
    assert (four.n_heads, four.n_kv_heads) == (8, 2)
    assert four.message_size_threshold == one.message_size_threshold == 2 * 8 / 32
    assert four.compute_threshold_tokens == pytest.approx(one.compute_threshold_tokens)
    assert four.strategy == one.strategy
    assert "heads per TP rank (TP 4): NH=8, NKV=2 of the model's 32/8" in four.reason
    assert "heads per TP rank" not in one.reason
    for rule in ("alg1", "empirical", "cost"):
        assert "heads per TP rank (TP 4)" in choose_strategy(100, 10_000, L8, 4, "h100-rdma", rule, tp_size=4).reason


def test_replicated_kv_heads_change_the_ratio():
    # TP 16 > NKV = 8: each GPU holds 2 query heads and a replica of 1 KV head, so NKV/NH = 1/2 = 16/32
    # per GPU: Eq. 1 becomes 2*16/32 = 1, Eq. 2 N*C*1*e/(2*2*BW) = 4*800e12*2/(4*50e9) = 32000 tokens.
    choice = choose_strategy(100, 10_000, L8, 4, "h100-rdma", tp_size=16)
    assert (choice.n_heads, choice.n_kv_heads) == (2, 1)
    assert choice.message_size_threshold == 2 * 16 / 32 == 1.0
    assert choice.compute_threshold_tokens == pytest.approx(4 * 800e12 * 2 / (4 * 50e9))
    assert "NKV/NH = 16/32, not 8/32" in choice.reason and "replica" in choice.reason
    # a miss rate of 0.6 is pass-KV with the model's ratio (>= 2*8/32 = 0.5; Eq. 2 needs 16000 tokens),
    # pass-Q per GPU (< 1)
    T, P = 6000, 4000
    assert choose_strategy(T, P, L8, 4, "h100-rdma", "alg1").strategy == PASS_KV
    assert choose_strategy(T, P, L8, 4, "h100-rdma", "alg1", tp_size=16).strategy == PASS_Q


def test_message_size_clause_picks_pass_kv_at_high_miss_rate():
    # T = 1000 < 4000 but miss rate 0.5 >= 0.125 (Eq. 1)
    choice = choose_strategy(1000, 1000, L405, 4, PAPER_H100, "alg1")
    assert choice.strategy == PASS_KV and "0.5 >= 0.125" in choice.reason and "Eq. 1" in choice.reason


@pytest.mark.parametrize("name", ["h100-rdma", "h100-tcp", "h200", "cpu"])
@pytest.mark.parametrize("model", [L405, L8, SMOL, TINY], ids=lambda m: m.name)
def test_full_prefill_chooses_pass_kv(name, model):
    hw = load_profile(name)
    dtype = "float32" if name == "cpu" else "bfloat16"
    for N in (2, 4, 8):
        for T in (1, 7, 100, 4096, 1 << 20):
            for rule in ("alg1", "alg5", "cost"):
                assert choose_strategy(T, 0, model, N, hw, rule, dtype=dtype).strategy == PASS_KV, (N, T, rule)
        # The log-linear fit approximates alg5: it is off at a few tokens, and for tiny (2*NKV/NH = 1,
        # so Eq. 1 picks pass-KV only at P = 0 exactly) the P = 0 edge is not representable.
        if message_size_threshold(model.n_heads, model.n_kv_heads) >= 1:
            continue
        for T in (4096, 1 << 20):
            assert choose_strategy(T, 0, model, N, hw, "empirical", dtype=dtype).strategy == PASS_KV, (N, T)


@pytest.mark.parametrize("name", ["h100-rdma", "h100-tcp", "h200", "cpu"])
@pytest.mark.parametrize("model", [L405, L8, SMOL], ids=lambda m: m.name)
def test_decode_with_a_large_cache_chooses_pass_q(name, model):
    hw = load_profile(name)
    for N in (2, 4):
        for rule in RULES:
            choice = choose_strategy(1, 1_000_000, model, N, hw, rule)
            assert choice.strategy == PASS_Q, (N, rule, choice.reason)


def test_chunked_prefill_moves_from_pass_kv_to_pass_q_once():
    # h100-tcp: peak C = 800e12, BW = 3e9; Llama3-405B on N = 4, chunks of 8192.
    # Eq. 2: 4*800e12*8*2/(2*128*3e9) = 66667 > 8192, so only the miss rate decides.
    # Alg. 5: 0.125 - 4*8192*3e9/(4*800e12*2) * (1 - m/2) = 0.125 - 0.01536 * (1 - m/2)
    # chunk k has P = 8192*k, m = 1/(k+1): k = 8 -> m 0.1111 >= 0.11049 (pass-KV),
    # k = 9 -> m 0.1 < 0.11041 (pass-Q)
    hw = load_profile("h100-tcp")
    strategies = [choose_strategy(8192, 8192 * k, L405, 4, hw).strategy for k in range(64)]
    assert strategies == [PASS_KV] * 9 + [PASS_Q] * 55
    assert choose_strategy(8192, 0, L405, 4, hw).compute_threshold_tokens == pytest.approx(
        4 * 800e12 * 16 / (256 * 3e9))
    assert choose_strategy(8192, 8 * 8192, L405, 4, hw).alg5_miss_rate_threshold == pytest.approx(
        0.125 - 0.01536 * (1 - 1 / 18))


def test_choice_numbers_and_to_dict():
    choice = choose_strategy(1000, 3000, L405, 4, PAPER_H100, "alg5")
    d = choice.to_dict()
    assert d["miss_rate"] == 0.25 and d["message_size_threshold"] == 0.125
    assert d["pass_q_context_threshold_tokens"] == pytest.approx(32000)
    assert d["empirical_score"] is None and d["rule"] == "alg5" and d["strategy"] == PASS_KV
    json.dumps(d)


def test_single_rank_reason_says_no_ring():
    assert "cp_size=1" in choose_strategy(100, 100, L8, 1, "h100-rdma").reason


@pytest.mark.parametrize("args, match", [
    ((0, 0, L8, 4), "new_tokens"), ((-3, 0, L8, 4), "new_tokens"), ((10, -1, L8, 4), "cached_tokens"),
    ((10, 0, L8, 0), "cp_size"), ((1.5, 0, L8, 4), "new_tokens"), ((True, 0, L8, 4), "new_tokens"),
])
def test_choose_strategy_validates_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        choose_strategy(*args, "h100-rdma")


def test_choose_strategy_takes_preset_names_and_checks_tp():
    assert choose_strategy(10, 0, "llama3-8b", 4, "h100-rdma") == choose_strategy(10, 0, L8, 4, "h100-rdma")
    with pytest.raises(ValueError, match="tp_size=5 does not divide the 32 query heads"):
        choose_strategy(10, 0, L8, 4, "h100-rdma", tp_size=5)


def test_choose_strategy_rejects_unknown_rule_and_dtype():
    with pytest.raises(ValueError, match="unknown strategy rule 'alg7'"):
        choose_strategy(10, 0, L8, 4, "h100-rdma", "alg7")
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        choose_strategy(10, 0, L8, 4, "h100-rdma", dtype="int4")
    with pytest.raises(ValueError, match="no peak_flops for dtype 'float8'"):
        choose_strategy(10, 0, L8, 2, "cpu", dtype="fp8")


# ----------------------------------------------------------------------------- byte and FLOP formulas


def test_tokens_per_rank_matches_balanced_layout():
    assert tokens_per_rank(4096, 4) == 1024       # 2N divides T: ceil(T/N)
    assert tokens_per_rank(10, 2) == 6            # chunks of 3: rank 1 holds C1 + C2
    assert tokens_per_rank(4097, 4) == 1026       # chunks of 513, ranks 1-3 hold two full ones
    assert tokens_per_rank(1, 4) == 1 and tokens_per_rank(7, 1) == 7
    assert cached_rows_per_rank(10, 4) == 3
    layout_mod = pytest.importorskip("ringctx.parallel.layout")
    for T in (1, 5, 10, 17, 4097):
        for N in (1, 2, 3, 4):
            layout = layout_mod.ShardLayout.balanced([T], N, [T * 3 + 1])
            assert tokens_per_rank(T, N) == layout.q_message_rows
            assert tokens_per_rank(T, N) + cached_rows_per_rank(T * 3 + 1, N) >= layout.kv_message_rows


def test_message_bytes_hand_computed():
    # Llama3-405B under TP8: 16 query heads, 1 KV head per GPU, DH 128, bf16; N = 4, T = 4096.
    heads, kv_heads = local_heads(L405, 8)
    assert (heads, kv_heads) == (16, 1)
    # pass-KV: 2 * (1000 + 1024) * 1 * 128 * 2
    assert pass_kv_message_bytes(1000, 4096, 4, kv_heads, 128, 2) == 1_036_288
    # pass-Q: 1024 * 16 * 128 * 2
    assert pass_q_message_bytes(4096, 4, heads, 128, 2) == 4_194_304
    # All2All: 3 * 1024 * 16 * (128*2 + 4)
    assert all2all_bytes_per_rank(4096, 4, heads, 128, 2) == 12_779_520
    assert all2all_bytes_per_rank(4096, 1, heads, 128, 2) == 0


def test_message_ratio_is_eq1():
    # With 2N | T and N | P: KV bytes / Q bytes = 2*(T+P)*NKV / (T*NH) = (2*NKV/NH) / m.
    for T, P in ((8, 0), (64, 64), (8, 4096), (1024, 100_000 - 100_000 % 4)):
        kv = pass_kv_message_bytes(P // 4, T, 4, 8, 128, 2)
        q = pass_q_message_bytes(T, 4, 128, 128, 2)
        assert kv / q == pytest.approx(message_size_threshold(128, 8) / miss_rate(T, P))


def test_attention_flops_hand_computed():
    # 4*T*D*(P + T/2) = 2*T*D*(2P + T): T=4, P=2, D=8 -> 2*4*8*8 = 512
    assert attention_flops(4, 2, 8) == 512
    assert attention_flops(1000, 0, 128) == 4 * 1000 * 1000 * 128 // 2  # full prefill: half of 4*T^2*D
    assert attention_flops(1, 10**6, 128) == pytest.approx(4 * 1 * 128 * (10**6 + 1), rel=1e-6)


def test_linear_flops_hand_computed():
    # Llama3-8B: 4096*(32+16)*128 + 32*128*4096 + 3*4096*14336 = 218,103,808 weights per layer
    assert linear_params_per_layer(L8) == 218_103_808
    assert L8.n_params == L8.n_layers * (linear_params_per_layer(L8) + 2 * L8.dim) + 2 * L8.vocab_size * L8.dim + L8.dim
    assert linear_flops(10, L8, 1) == 2 * 10 * 218_103_808
    assert linear_flops(10, L8, 8) == 2 * 10 * 218_103_808 // 8


def test_local_heads_and_tp_validation():
    assert local_heads(L8, 1) == (32, 8) and local_heads(L8, 4) == (8, 2)
    assert local_heads(L8, 16) == (2, 1)  # 8 KV heads over 16 GPUs: replicated, one each
    with pytest.raises(ValueError, match="tp_size=3 does not divide the 32 query heads"):
        local_heads(L8, 3)
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        local_heads(L8, 0)
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        local_heads(ModelConfig(name="odd", vocab_size=8, dim=96, n_layers=1, n_heads=12, n_kv_heads=4,
                                ffn_dim=96), 6)


def test_transfer_and_ring_seconds():
    assert transfer_seconds(1_000_000, 1e9, 1e-4) == pytest.approx(1.1e-3)        # 1e-4 + 1e-3
    assert transfer_seconds(1_000_000, 1e9, 1e-4, messages=3) == pytest.approx(1.3e-3)
    assert transfer_seconds(0, 1e9, 1e-4, messages=0) == 0.0
    assert ring_seconds(1.0, 2.0, 4) == 7.0   # 3 * max(1, 2) + 1
    assert ring_seconds(2.0, 1.0, 4) == 8.0   # 3 * 2 + 2
    assert ring_seconds(2.0, 5.0, 1) == 2.0   # no ring


# ----------------------------------------------------------------------------- cost model


def test_cost_model_hand_computed_tiny():
    # tiny: dim 64, 4 heads, 2 KV heads, DH 16, ffn 128, 2 layers; bf16 (e = 2).
    # C = 1e12 FLOP/s, BW = 1e9 B/s, latency 1e-5 s; T = 1000, P = 3000, N = 2: n = 500, max P_i = 1500.
    hw = profile()
    costs = predict_costs(1000, 3000, TINY, 2, hw)
    kv, q = costs[PASS_KV], costs[PASS_Q]
    # attention FLOPs 2*1000*64*(6000+1000) = 896e6, per step / N^2 = 224e6 -> 2.24e-4 s
    assert kv.compute_s == pytest.approx(2.24e-4) and q.compute_s == pytest.approx(2.24e-4)
    # pass-KV message 2*(1500+500)*2*16*2 = 256,000 B -> 1e-5 + 2.56e-4 s
    assert kv.sendrecv_bytes == 256_000 and kv.sendrecv_s == pytest.approx(2.66e-4)
    assert kv.attention_s == pytest.approx(2.66e-4 + 2.24e-4)           # 1*max(comp, comm) + comp
    assert kv.exposed_comm_s == pytest.approx(4.2e-5)
    assert kv.all2all_bytes == 0 and kv.all2all_s == 0
    # pass-Q message 500*4*16*2 = 64,000 B -> 7.4e-5 s; All2All 1*500*4*(32+4) = 72,000 B -> 8.2e-5 s
    assert q.sendrecv_bytes == 64_000 and q.sendrecv_s == pytest.approx(7.4e-5)
    assert q.all2all_bytes == 72_000 and q.all2all_s == pytest.approx(8.2e-5)
    assert q.attention_s == pytest.approx(2 * 2.24e-4 + 8.2e-5)
    assert q.exposed_comm_s == pytest.approx(8.2e-5)
    # linear: 64*8*16 + 64*64 + 3*64*128 = 36,864 weights; 2*500*36,864 FLOPs -> 3.6864e-5 s
    assert kv.linear_s == pytest.approx(3.6864e-5)
    assert kv.total_s == pytest.approx(2 * (4.9e-4 + 3.6864e-5))
    assert kv.to_dict()["total_s"] == pytest.approx(kv.total_s)


def test_cost_model_single_rank_has_no_communication():
    costs = predict_costs(5000, 5000, L8, 1, "h100-rdma")
    for cost in costs.values():
        assert cost.sendrecv_bytes == 0 and cost.all2all_bytes == 0 and cost.exposed_comm_s == 0
    assert costs[PASS_KV].total_s == costs[PASS_Q].total_s


def test_cost_model_latency_dominates_small_messages():
    # 2 tokens on 2 ranks with 1 ms latency: transfers are all latency; pass-Q pays one more (All2All).
    hw = profile(latency_s=1e-3)
    kv, q = predict_costs(2, 0, TINY, 2, hw).values()
    assert kv.sendrecv_s == pytest.approx(1e-3, rel=1e-3)
    assert q.all2all_s == pytest.approx(1e-3, rel=1e-3)
    assert q.attention_s - kv.attention_s == pytest.approx(1e-3, rel=1e-2)


def test_cost_model_uses_calibrated_tables():
    table = {"bfloat16": (ThroughputPoint(256, 1e11), ThroughputPoint(4096, 4e11))}
    hw = profile(attention_throughput=table, linear_flops_per_s={"bfloat16": 2e11})
    cost = predict_strategy_cost(PASS_KV, 512, 0, TINY, 2, hw)
    # n = 256 query rows per rank -> 1e11 FLOP/s; attention FLOPs 2*512*64*512 / 4 per step
    assert cost.compute_s == pytest.approx(2 * 512 * 64 * 512 / 4 / 1e11)
    assert cost.linear_s == pytest.approx(2 * 256 * 36_864 / 2e11)


def test_cost_model_agrees_with_alg5_when_pass_q_ring_is_hidden():
    # Regime of Algorithm 5's derivation: pass-Q's ring hides (Eq. 3: T+P >= N*e*C/(4*BW)),
    # pass-KV's may not; the cost model runs on the thresholds' C (achieved_fraction 1). No
    # latency, P >= 8T, and 25% away from alg5's boundary (the model counts float32 LSEs and
    # per-rank All2All volume). The TP all-reduces and the layer overhead are the same for both.
    hw = PAPER_H100
    C, BW, N = hw.achieved_flops("bfloat16"), hw.bandwidth_bytes_per_s, 4
    checked = 0
    for T in (2**k for k in range(4, 22)):
        for P in (2**k for k in range(24)):
            if T + P < pass_q_context_threshold(N, C, 2, BW) or P < 8 * T:
                continue
            choice = choose_strategy(T, P, L405, N, hw, "alg5", tp_size=8)
            near_boundary = abs(choice.miss_rate / choice.alg5_miss_rate_threshold - 1) < 0.25
            if T < choice.compute_threshold_tokens and near_boundary:
                continue
            cost = choose_strategy(T, P, L405, N, hw, "cost", tp_size=8)
            assert cost.strategy == choice.strategy, (T, P, cost.reason, choice.reason)
            checked += 1
    assert checked > 100


def test_cost_model_when_communication_dominates():
    # BW = 1 MB/s: nothing hides. The ring traffic alone orders like Eq. 1 (pass-KV's per-step
    # message is smaller iff m > 2*NKV/NH); pass-Q's All2All returns as many bytes as its ring
    # carried, so with it the crossover is near NKV/NH = 0.0625 instead of 0.125.
    hw = dataclasses.replace(load_profile("h100-rdma"), latency_s=0.0, bandwidth_bytes_per_s=1e6)
    T = 4096
    for m in (1.0, 0.5, 0.25, 0.13, 0.12, 0.1, 0.07, 0.06, 0.01):
        P = round(T / m) - T
        P -= P % 4
        kv, q = predict_costs(T, P, L405, 4, hw, tp_size=8).values()
        ring_kv, ring_q = kv.attention_s - kv.all2all_s, q.attention_s - q.all2all_s
        assert (ring_kv < ring_q) == (miss_rate(T, P) > 0.125), m
        assert (kv.attention_s < q.attention_s) == (miss_rate(T, P) > 0.0625), m
        if miss_rate(T, P) >= 0.125 or miss_rate(T, P) < 0.0625:  # outside the band they all agree
            assert choose_strategy(T, P, L405, 4, hw, "alg5").strategy == choose_strategy(
                T, P, L405, 4, hw, "cost", tp_size=8).strategy


def test_cost_model_fixed_costs_hand_computed():
    # tiny under TP 2 (2 q heads, 1 KV head, ffn 64 per GPU), bf16; T = 1000, P = 3000, N = 2: n = 500.
    # One all-reduce: 2*(2-1)/2 * 500*64*2 = 64,000 bytes -> 1e-5 + 64e3/2e9 = 4.2e-5 s; two a layer.
    hw = profile(tp_bandwidth_bytes_per_s=2e9, tp_latency_s=1e-5, layer_overhead_s=2e-4)
    for cost in predict_costs(1000, 3000, TINY, 2, hw, tp_size=2).values():
        assert cost.tp_allreduce_s == pytest.approx(2 * 4.2e-5) and cost.layer_overhead_s == 2e-4
        assert cost.layer_s == pytest.approx(cost.attention_s + cost.linear_s + 8.4e-5 + 2e-4)
        assert cost.total_s == pytest.approx(TINY.n_layers * cost.layer_s)
        assert cost.to_dict()["tp_allreduce_s"] == cost.tp_allreduce_s
    # TP 1 has no all-reduce; the layer overhead stays (one rank included)
    for N in (1, 2):
        one = predict_strategy_cost(PASS_KV, 1000, 3000, TINY, N, hw)
        assert one.tp_allreduce_s == 0 and one.layer_s == pytest.approx(one.attention_s + one.linear_s + 2e-4)
    # a profile without the TP link prices it at the inter-rank latency and bandwidth (1e-5 s, 1e9 B/s)
    plain = profile()
    assert plain.tp_link() == (1e-5, 1e9) and plain.layer_overhead_s == 0
    assert predict_strategy_cost(PASS_Q, 1000, 3000, TINY, 2, plain, tp_size=2).tp_allreduce_s == pytest.approx(
        2 * (1e-5 + 64_000 / 1e9))


def test_short_prompt_on_a_long_cache_pays_the_fixed_costs():
    # A 64-token question on a 1M-token Llama3-405B cache, CP16 x TP8 on h100-rdma: n = 4 rows a
    # rank. pass-Q's layer is 15 ring SendRecvs (latency 10 us + 16 KB at 50 GB/s each, longer
    # than the 4 us of compute they overlap), 15 All2All latencies, 2 TP all-reduces
    # (20 us + 2*7/8*4*16384*2 B at 450 GB/s) and the 40 us overhead; the FLOPs explain little.
    hw = load_profile("h100-rdma")
    q = predict_strategy_cost(PASS_Q, 64, 10**6, L405, 16, hw, tp_size=8, weight_dtype="float8")
    allreduce = 2e-5 + 2 * 7 / 8 * 4 * 16384 * 2 / 450e9
    assert q.tp_allreduce_s == pytest.approx(2 * allreduce) and q.layer_overhead_s == 4e-5
    assert q.sendrecv_s == pytest.approx(1e-5 + 4 * 16 * 128 * 2 / 50e9) and q.sendrecv_s > q.compute_s
    assert q.all2all_s == pytest.approx(15 * 1e-5 + q.all2all_bytes / 50e9)
    flops_only = 16 * q.compute_s + q.linear_s
    assert q.layer_s == pytest.approx(15 * q.sendrecv_s + q.compute_s + q.all2all_s + q.linear_s + 2 * allreduce + 4e-5)
    assert q.layer_s > 5 * flops_only
    assert choose_strategy(64, 10**6, L405, 16, hw, "cost", tp_size=8).strategy == PASS_Q


def test_predict_cost_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy 'pass-x'"):
        predict_strategy_cost("pass-x", 10, 0, TINY, 2, profile())


# ----------------------------------------------------------------------------- empirical rule


def test_empirical_score_hand_computed():
    rule = EmpiricalRuleCoefficients(a=1.0, b=2.0, c=-3.0, cp_size=4, n_heads=128, n_kv_heads=8,
                                     dtype="bfloat16", source="calibrated", agreement=1.0)
    # ln 100 + 2*ln 0.25 - 3 = 4.60517 - 2.77259 - 3 = -1.16742
    assert rule.score(100, 300) == pytest.approx(math.log(100) + 2 * math.log(0.25) - 3)
    assert rule.score(100, 300) == pytest.approx(-1.16742, abs=1e-5)
    hw = profile(empirical_rules=(rule,))
    choice = choose_strategy(100, 300, L405, 4, hw, "empirical")
    assert choice.strategy == PASS_Q and choice.empirical_score == pytest.approx(-1.16742, abs=1e-5)
    assert "calibrated coefficients of profile 'test'" in choice.reason
    # e^5 new tokens, no cache: h = 5 + 0 - 3 = 2 > 0
    assert choose_strategy(round(math.exp(5)), 0, L405, 4, hw, "empirical").strategy == PASS_KV


def test_empirical_rule_matches_by_gqa_ratio_n_and_dtype():
    rule = EmpiricalRuleCoefficients(a=1, b=1, c=0, cp_size=4, n_heads=64, n_kv_heads=8, dtype="bfloat16",
                                     source="fit-to-alg5", agreement=0.9)
    assert rule.matches(128, 16, 4, "bf16")
    assert not rule.matches(128, 8, 4, "bfloat16") and not rule.matches(64, 8, 2, "bfloat16")
    assert not rule.matches(64, 8, 4, "float32")


def test_empirical_falls_back_to_an_alg5_fit_and_says_so():
    choice = choose_strategy(100, 10**6, L405, 3, "h100-rdma", "empirical")  # profile stores N in 2,4,8,16
    assert "has no coefficients" in choice.reason and "fitted to alg5 now" in choice.reason
    assert choice.strategy == PASS_Q


def test_fit_recovers_a_log_linear_rule():
    T, P = fitting_grid(max_tokens=2**16, points_per_octave=2)
    labels = np.log(T) + 2 * np.log(T / (T + P)) - 5 > 0
    a, b, c, agreement = fit_empirical_rule(T, P, labels, l2=1e-4)
    assert agreement > 0.99 and a > 0 and b > 0 and c < 0
    assert b / a == pytest.approx(2, rel=0.2) and c / a == pytest.approx(-5, rel=0.2)


def test_fitting_grid():
    T, P = fitting_grid(max_tokens=16, points_per_octave=1)
    assert sorted(set(T.tolist())) == [1, 2, 4, 8, 16] and sorted(set(P.tolist())) == [0, 1, 2, 4, 8, 16]
    assert len(T) == 5 * 6


def test_alg5_predicate_matches_choose_strategy():
    hw = load_profile("h100-tcp")
    C, BW = hw.peak("bfloat16"), hw.bandwidth_bytes_per_s
    for T, P in ((1, 0), (1, 10**6), (8192, 65536), (8192, 73728), (50000, 10**6)):
        expect = choose_strategy(T, P, L405, 4, hw).strategy == PASS_KV
        assert bool(alg5_prefers_pass_kv(T, P, 4, C, 128, 8, 2, BW)) == expect


@pytest.mark.parametrize("name", ["h100-rdma", "h100-tcp", "h200", "cpu"])
def test_builtin_empirical_defaults_are_the_alg5_fit(name):
    hw = load_profile(name)
    assert len(hw.empirical_rules) == 12
    for stored in hw.empirical_rules:
        model = next(m for m in (L8, get_preset("llama3-70b"), L405, SMOL, TINY)
                     if (m.n_heads, m.n_kv_heads) == (stored.n_heads, stored.n_kv_heads))
        (fresh,) = fit_default_rules(hw, [model], [stored.cp_size], [stored.dtype])
        for key in ("a", "b", "c", "agreement"):
            assert getattr(stored, key) == pytest.approx(getattr(fresh, key), abs=2e-4), (stored, key)
        assert stored.source == "fit-to-alg5" and stored.agreement >= 0.94


def test_fit_to_alg5_returns_coefficients_for_the_setting():
    rule = fit_empirical_rule_to_alg5(L405, 4, "h100-rdma")
    assert (rule.cp_size, rule.n_heads, rule.n_kv_heads, rule.dtype) == (4, 128, 8, "bfloat16")
    assert rule.a > 0 and rule.b > 0 and rule.agreement > 0.95


# ----------------------------------------------------------------------------- hardware profiles


def test_builtin_profiles_load_with_documented_numbers():
    assert {"h100-rdma", "h100-tcp", "h200", "cpu"} <= set(builtin_profiles())
    rdma, tcp, h200, cpu = (load_profile(n) for n in ("h100-rdma", "h100-tcp", "h200", "cpu"))
    assert rdma.peak("bfloat16") == 800e12 and rdma.bandwidth_bytes_per_s == 50e9
    assert rdma.achieved_flops("bf16") == pytest.approx(800e12 * rdma.achieved_fraction)
    assert tcp.bandwidth_bytes_per_s == 3e9 and tcp.peak("bfloat16") == 800e12
    assert h200.peak("bfloat16") == 989e12 and h200.memory_bytes == 141e9
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12 and h200.bandwidth_bytes_per_s == 50e9
    assert cpu.bandwidth_bytes_per_s == 1.5e9 and not cpu.calibrated and "uncalibrated" in cpu.description
    for hw in (rdma, tcp, h200, cpu):
        assert hw.latency_s > 0 and hw.memory_bytes > 0 and 0 < hw.achieved_fraction <= 1
        assert hw.source_path and hw.source_path.endswith(f"{hw.name}.json")
        assert hw.tp_latency_s > 0 and hw.layer_overhead_s > 0
    for gpu in (rdma, tcp, h200):  # NVLink 4 inside the host, 30-50 us of launches a layer
        assert gpu.tp_link() == (2e-5, 450e9) and 30e-6 <= gpu.layer_overhead_s <= 50e-6
    assert cpu.tp_link()[1] < 10e9  # a memory copy between local processes


def test_dtypes():
    assert canonical_dtype("bf16") == "bfloat16" and canonical_dtype("torch.float32") == "float32"
    assert element_bytes("fp8") == 1 and element_bytes("half") == 2 and element_bytes("float32") == 4
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        element_bytes("int8")


def test_interpolate_throughput():
    points = (ThroughputPoint(1024, 1e12), ThroughputPoint(4096, 3e12))
    assert interpolate_throughput(points, 2048) == pytest.approx(2e12)   # halfway in log2
    assert interpolate_throughput(points, 100) == 1e12 and interpolate_throughput(points, 10**6) == 3e12
    hw = profile(attention_throughput={"bfloat16": points})
    assert hw.attention_flops_per_s("bf16", 2048) == pytest.approx(2e12)
    assert hw.attention_flops_per_s("float32", 2048) == 5e11  # no table: peak * fraction


def test_save_and_load_round_trip(tmp_path):
    hw = profile(attention_throughput={"bfloat16": (ThroughputPoint(512, 2e11),)},
                 linear_flops_per_s={"float32": 9e10}, notes="measured",
                 empirical_rules=(fit_empirical_rule_to_alg5(TINY, 2, profile()),))
    path = save_profile(hw, tmp_path / "mine.json")
    again = load_profile(str(path))
    assert again == hw and again.source_path == str(path)
    assert json.loads(path.read_text())["schema_version"] == 1


def test_unknown_profile_name():
    with pytest.raises(ValueError, match=r"unknown hardware profile 'a100'.*h100-rdma.*path to a JSON profile"):
        load_profile("a100")


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _valid() -> dict:
    return load_profile("h100-rdma").to_dict()


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("bandwidth_bytes_per_s"), "field 'bandwidth_bytes_per_s' is missing"),
    (lambda d: d.update(bandwidth_bytes_per_s=-1), "field 'bandwidth_bytes_per_s' must be > 0"),
    (lambda d: d.update(latency_s="fast"), "field 'latency_s' must be a finite number"),
    (lambda d: d.update(achieved_fraction=1.5), "field 'achieved_fraction' must be > 0 and <= 1"),
    (lambda d: d.update(calibrated="yes"), "field 'calibrated' must be true or false"),
    (lambda d: d.update(bandwith=1), "field 'bandwith' is not a profile field"),
    (lambda d: d.update(peak_flops={}), "field 'peak_flops' must be a non-empty object"),
    (lambda d: d.update(peak_flops={"int3": 1e12}), "field 'peak_flops' has an unknown dtype key 'int3'"),
    (lambda d: d.update(peak_flops={"bfloat16": True}), "field 'peak_flops.bfloat16' must be a finite number"),
    (lambda d: d.update(schema_version=2), "field 'schema_version' is 2"),
    (lambda d: d.update(attention_throughput={"bfloat16": [{"block_tokens": 0, "flops_per_s": 1.0}]}),
     r"field 'attention_throughput.bfloat16\[0\].block_tokens' must be a positive integer"),
    (lambda d: d["empirical_rules"][3].pop("c"), r"field 'empirical_rules\[3\]' must have exactly the fields"),
    (lambda d: d["empirical_rules"][0].update(cp_size=0), r"field 'empirical_rules\[0\].cp_size' must be a positive"),
    (lambda d: d["empirical_rules"][0].update(agreement=2), r"field 'empirical_rules\[0\].agreement' must be"),
    (lambda d: d.update(tp_bandwidth_bytes_per_s=0), "field 'tp_bandwidth_bytes_per_s' must be > 0"),
    (lambda d: d.update(tp_latency_s=-1e-6), "field 'tp_latency_s' must be >= 0"),
    (lambda d: d.update(layer_overhead_s="40us"), "field 'layer_overhead_s' must be a finite number"),
])
def test_malformed_profiles_name_file_and_field(tmp_path, mutate, match):
    data = _valid()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as err:
        load_profile(path)
    assert "bad.json" in str(err.value) and "fix the file" in str(err.value)


def test_profiles_without_the_tp_link_fields_still_load(tmp_path):
    # files written before tp_bandwidth_bytes_per_s / tp_latency_s / layer_overhead_s existed
    data = _valid()
    for key in ("tp_bandwidth_bytes_per_s", "tp_latency_s", "layer_overhead_s"):
        del data[key]
    hw = load_profile(_write(tmp_path, data))
    assert hw.tp_bandwidth_bytes_per_s is None and hw.tp_latency_s is None and hw.layer_overhead_s == 0
    assert hw.tp_link() == (hw.latency_s, hw.bandwidth_bytes_per_s)
    data.update(tp_bandwidth_bytes_per_s=None, tp_latency_s=None)  # as save_profile writes them
    assert load_profile(_write(tmp_path, data)).tp_link() == (hw.latency_s, hw.bandwidth_bytes_per_s)
    with_link = dataclasses.replace(hw, tp_bandwidth_bytes_per_s=3e11, tp_latency_s=0.0, layer_overhead_s=1e-5)
    assert load_profile(str(save_profile(with_link, tmp_path / "link.json"))) == dataclasses.replace(
        with_link, source_path=str(tmp_path / "link.json"))


def test_invalid_json_names_file_and_line(tmp_path):
    path = _write(tmp_path, '{"name": "x",\n  "oops"\n}')
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON \(line 3"):
        load_profile(path)
    with pytest.raises(ValueError, match="must be a JSON object"):
        load_profile(_write(tmp_path, "[1, 2]"))


def test_short_reasons_name_the_deciding_numbers_in_under_60_characters():
    """Every rule's short reason: the condition that decided with its numbers and the verdict; the
    formula carries the constants (once per table); the full reason is unchanged."""
    for rule in ("alg1", "alg5", "empirical", "cost"):
        for T, P, N, tp in ((100_000, 900_000, 4, 1), (3200, 124_800, 4, 1), (100, 10_000, 8, 4), (4096, 0, 2, 1),
                            (48, 12288, 1, 1)):
            choice = choose_strategy(T, P, L8, N, "h100-rdma", rule, tp_size=tp)
            short = choice.short_reason
            assert len(short) < 60 and short.endswith("-> pass-KV" if choice.strategy == PASS_KV else "-> pass-Q")
            assert choice.formula.startswith(f"{rule}: ") and choice.formula not in choice.reason
            if rule in ("alg1", "alg5"):
                assert f"N={N}" in choice.formula and "BW=" in choice.formula
    at = choose_strategy(4000, 10**9, L405, 4, PAPER_H100, "alg5")
    assert at.short_reason == "Eq.2: T=4000 >= 4000 -> pass-KV"
    below = choose_strategy(3200, 124_800, L405, 4, PAPER_H100, "alg5")
    assert below.strategy == PASS_Q
    assert below.short_reason == f"Alg.5: m=0.025 < {below.alg5_miss_rate_threshold:.2g} -> pass-Q"
    assert choose_strategy(3200, 124_800, L405, 4, PAPER_H100, "alg1").short_reason == "Eq.1: m=0.025 < 0.12 -> pass-Q"
    assert choose_strategy(100, 100, L8, 1, "h100-rdma").short_reason.startswith("N=1, no ring: ")
