"""Calibration: fits, profile fields for live measurements, the ring-aware cost model, scoring rules
against measurements, and a quick calibration on the shared 2-rank gloo pool."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ringctx.model.config_hf import hf_config_dict
from ringctx.model.presets import get_preset
from ringctx.planning.calibrate import (
    LAYER_OVERHEAD_TOKENS, CalibrationSettings, calibrate, fit_latency_bandwidth, fit_linear_block, ring_strategy_job,
)
from ringctx.planning.empirical import (
    evaluate_picks, fit_rule_to_measurements, leave_one_out_picks,
)
from ringctx.planning.hardware import (
    HardwareProfile, RingCalibration, ThroughputPoint, load_profile, save_profile,
)
from ringctx.planning.prefill_plan import plan_prefill, resolve_model_config
from ringctx.planning.strategy import (
    PASS_KV, PASS_Q, attention_flops, attention_seconds_per_rank, choose_strategy, linear_params_per_layer,
    overlapped_seconds, predict_costs,
)

SMOL = get_preset("smollm2-135m")
TINY = get_preset("tiny")


def ring(n: int, **kw) -> RingCalibration:
    base = dict(cp_size=n, threads_per_rank=1, compute_scale=1.0, latency_s=1e-4, bandwidth_bytes_per_s=1e9,
                all2all_latency_s=2e-4, all2all_bandwidth_bytes_per_s=5e8, comm_overlap=0.0,
                overhead_s={"pass-kv": 1e-3, "pass-q": 2e-3})
    return RingCalibration(**{**base, **kw})


def cpu_profile(**kw) -> HardwareProfile:
    base = HardwareProfile(name="cal", description="test", calibrated=True, peak_flops={"bfloat16": 4e10},
                           achieved_fraction=1.0, bandwidth_bytes_per_s=1e9, latency_s=1e-4, memory_bytes=2e10,
                           host_cores=2, ring_sizes={2: ring(2)})
    return dataclasses.replace(base, **kw)


# ----------------------------------------------------------------------------- fits


def test_fit_latency_bandwidth_recovers_the_line():
    sizes = [4096, 65536, 524288, 2097152, 8388608]
    times = [2e-4 + s / 1.5e9 for s in sizes]
    lat, bw = fit_latency_bandwidth(sizes, times)
    assert lat == pytest.approx(2e-4, rel=1e-6) and bw == pytest.approx(1.5e9, rel=1e-6)


def test_fit_latency_bandwidth_never_negative():
    # a slow small message makes the intercept negative in a plain fit: refit through the origin
    lat, bw = fit_latency_bandwidth([1000, 1_000_000], [1e-3, 1e-3 + 1e-3])
    assert lat >= 0 and bw > 0
    lat, bw = fit_latency_bandwidth([1000, 2000], [5e-4, 4e-4])  # no growth with size: all latency
    assert lat == pytest.approx(4.5e-4) and bw > 1e9


def test_fit_linear_block_separates_the_layer_overhead():
    # blocks of 1, 128 and 1024 tokens: 300 us + 2*t*1e6 FLOPs at 50 GFLOP/s
    params = 1_000_000
    block = [(t, 3e-4 + 2 * t * params / 5e10, 0.0) for t in (1, 128, 1024)]
    overhead, rate = fit_linear_block(block, params)
    assert overhead == pytest.approx(3e-4, rel=1e-6) and rate == pytest.approx(5e10, rel=1e-6)
    assert LAYER_OVERHEAD_TOKENS == 1


# ----------------------------------------------------------------------------- profile fields


def test_ring_numbers_measured_scaled_and_gpu():
    hw = cpu_profile()
    assert hw.ring(2).source == "measured at N=2" and hw.ring(2).comm_overlap == 0.0
    four = hw.ring(4)  # 4 ranks on 2 cores: half the compute, transfers 2x slower
    assert four.source == "scaled from N=2"
    assert four.compute_scale == pytest.approx(0.5) and four.latency_s == pytest.approx(2e-4)
    assert four.bandwidth_bytes_per_s == pytest.approx(5e8) and four.overhead_s["pass-q"] == pytest.approx(4e-3)
    assert hw.ring(1).compute_scale == pytest.approx(2.0)  # one rank with both cores' threads
    gpu = load_profile("h100-rdma").ring(8)
    assert gpu.source == "profile" and gpu.compute_scale == 1 and gpu.comm_overlap == 1.0
    assert gpu.all2all_latency_s is None


def test_profile_with_live_fields_round_trips(tmp_path):
    hw = cpu_profile(attention_throughput={"bfloat16": (ThroughputPoint(16, 1e10), ThroughputPoint(1024, 4e10))},
                     attention_causal_throughput={"bfloat16": (ThroughputPoint(16, 3e9),)},
                     attention_call_overhead_s=5e-5, comm_overlap=0.25, ring_sizes={1: ring(1), 2: ring(2)})
    path = save_profile(hw, tmp_path / "p.json")
    again = load_profile(str(path))
    assert again == hw
    data = json.loads(path.read_text())
    assert data["ring_sizes"]["2"]["overhead_s"] == {"pass-kv": 1e-3, "pass-q": 2e-3}
    del data["ring_sizes"]["2"]["attention_factor"]  # optional: older files lack it
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).ring_sizes[2].attention_factor == 1.0


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["ring_sizes"]["2"].pop("comm_overlap"), r"ring_sizes.2.*must have the fields"),
    (lambda d: d["ring_sizes"]["2"].update(comm_overlap=1.5), r"ring_sizes.2.comm_overlap.*<= 1"),
    (lambda d: d["ring_sizes"]["2"].update(cp_size=3), r"keyed '2' but its cp_size is 3"),
    (lambda d: d.update(host_cores=0), r"'host_cores' must be a positive integer"),
    (lambda d: d["ring_sizes"]["2"].update(overhead_s={"pass-kv": 0}), r"overhead_s"),
    (lambda d: d["ring_sizes"]["2"].update(attention_factor=0), r"attention_factor.*must be > 0"),
])
def test_malformed_live_fields_name_the_field(tmp_path, mutate, match):
    data = cpu_profile().to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_profile(str(path))


# ----------------------------------------------------------------------------- cost model with live numbers


def test_attention_seconds_per_rank_sums_to_the_flops_without_tables():
    hw = cpu_profile()  # no tables: peak * fraction everywhere, no call overhead
    for T, P, N in ((4096, 0, 2), (1000, 3000, 4), (64, 10_000, 1), (7, 5, 3)):
        seconds = attention_seconds_per_rank(T, P, N, 576, hw, "bfloat16")
        assert seconds == pytest.approx(attention_flops(T, P, 576) / N / 4e10, rel=1e-9)


def test_attention_seconds_counts_calls_and_tables():
    hw = cpu_profile(attention_call_overhead_s=1e-4,
                     attention_causal_throughput={"bfloat16": (ThroughputPoint(1, 1e10),)})
    # one rank, no cache: one diagonal block of T rows (causal table) and one call
    assert attention_seconds_per_rank(1000, 0, 1, 576, hw, "bfloat16") == pytest.approx(
        2 * 1000 * 1000 * 576 / 1e10 + 1e-4)


def test_attention_factor_slows_ring_attention_only():
    hw = cpu_profile()
    slow = cpu_profile(ring_sizes={2: ring(2, attention_factor=2.0)})
    fast_kv, slow_kv = (predict_costs(1024, 8192, SMOL, 2, h)["pass-kv"] for h in (hw, slow))
    assert slow_kv.compute_s == pytest.approx(2 * fast_kv.compute_s) and slow_kv.linear_s == fast_kv.linear_s


def test_cost_model_without_overlap_adds_transfers_and_counts_two_all_to_alls():
    hw = cpu_profile()
    kv, q = predict_costs(1024, 8192, SMOL, 2, hw).values()
    assert kv.attention_s == pytest.approx(1e-3 + kv.compute_s + kv.sendrecv_s + kv.compute_s)
    assert q.all2all_s == pytest.approx(2 * 2e-4 + q.all2all_bytes / 5e8)
    assert q.attention_s == pytest.approx(2e-3 + 2 * q.compute_s + q.sendrecv_s + q.all2all_s)
    assert kv.overhead_s == 1e-3 and kv.exposed_comm_s == pytest.approx(kv.sendrecv_s)
    assert overlapped_seconds(3.0, 1.0, 1.0) == 3.0 and overlapped_seconds(3.0, 1.0, 0.0) == 4.0
    assert overlapped_seconds(3.0, 1.0, 0.5) == 3.5


def test_cost_rule_prefers_pass_q_when_kv_messages_are_expensive():
    hw = cpu_profile(ring_sizes={2: ring(2, bandwidth_bytes_per_s=1e7, overhead_s={"pass-kv": 0.0, "pass-q": 0.0})})
    assert choose_strategy(64, 100_000, SMOL, 2, hw, "cost").strategy == PASS_Q
    assert choose_strategy(4096, 0, SMOL, 2, hw, "cost").strategy == PASS_KV


def test_host_memory_is_shared_by_the_ranks():
    plan = plan_prefill(SMOL, 4, cpu_profile(), tokens=1000)
    assert plan.memory.capacity_bytes == pytest.approx(2e10 / 4)


# ----------------------------------------------------------------------------- scoring rules


def _m(T, P, kv, q):
    return {"new_tokens": T, "cached_tokens": P, "seconds": {PASS_KV: kv, PASS_Q: q}}


def test_evaluate_picks():
    ms = [_m(100, 0, 1.0, 2.0), _m(100, 9900, 2.0, 1.0), _m(100, 100, 1.0, 1.02)]
    score = evaluate_picks(ms, [PASS_KV, PASS_KV, PASS_Q])
    assert score["decisive"] == 2 and score["right_decisive"] == 1 and score["accuracy_decisive"] == 0.5
    assert score["mean_regret"] == pytest.approx((0 + 1.0 + 0.02) / 3)
    assert score["worst_regret"] == pytest.approx(1.0)
    assert score["worst_case"] == {"new_tokens": 100, "cached_tokens": 9900, "pick": PASS_KV}
    with pytest.raises(ValueError, match="3 measurements but 1 picks"):
        evaluate_picks(ms, [PASS_KV])


def test_fit_rule_to_measurements_finds_the_boundary():
    # pass-Q faster below miss rate 0.2, pass-KV above, for every T
    ms = []
    for T in (64, 256, 1024, 4096):
        for m in (0.01, 0.05, 0.1, 0.3, 0.5, 1.0):
            P = round(T / m) - T
            ms.append(_m(T, P, 1.0, 0.8) if m < 0.2 else _m(T, P, 0.8, 1.0))
    rule = fit_rule_to_measurements(ms, SMOL, 2, "bf16")
    assert rule.source == "calibrated" and rule.agreement == 1.0 and rule.dtype == "bfloat16"
    assert rule.score(512, 512 * 9) < 0 < rule.score(512, 512)
    picks = leave_one_out_picks(ms, SMOL, 2, "bf16")
    assert evaluate_picks(ms, picks)["accuracy_decisive"] >= 0.9


# ----------------------------------------------------------------------------- model configs


def test_resolve_model_config(tmp_path):
    assert resolve_model_config("tiny") == TINY
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(SMOL)))
    cfg = resolve_model_config(str(tmp_path))
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.dim, cfg.n_layers) == (9, 3, 576, 30)
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*smollm2-135m"):
        resolve_model_config("gpt-5")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"nope")
    with pytest.raises(ValueError, match="neither a GGUF file"):
        resolve_model_config(str(junk))


# ----------------------------------------------------------------------------- live group (shared pool)


def test_quick_calibration_writes_a_profile_the_planner_uses(rank_pool, tmp_path):
    settings = CalibrationSettings.make("smollm2-135m", cp_sizes=(2,), quick=True)
    result = calibrate(settings, pools={2: rank_pool(2)})
    hw = result.profile
    path = save_profile(hw, tmp_path / "ringctx-hardware.json")
    again = load_profile(str(path))
    assert again.calibrated and again.host_cores >= 1 and set(again.ring_sizes) == {1, 2}
    r = again.ring_sizes[2]
    assert r.latency_s >= 0 and r.bandwidth_bytes_per_s > 0 and 0 <= r.comm_overlap <= 1
    assert r.compute_scale > 0 and all(v >= 0 for v in r.overhead_s.values())
    assert again.attention_throughput["bfloat16"] and again.attention_causal_throughput["bfloat16"]
    assert again.linear_flops_per_s["bfloat16"] > 0
    assert {(x.cp_size, x.source) for x in again.empirical_rules} == {(2, "fit-to-cost-model")}
    live = result.samples["live"]["2"]
    assert [nb for nb, _ in live["sendrecv"]] == list(settings.message_bytes)
    # the TP link: all_reduce among the 2 local ranks, each moving 2*(2-1)/2 = all of the buffer
    assert [nb for nb, _ in live["allreduce"]] == list(settings.message_bytes)
    assert (again.tp_latency_s, again.tp_bandwidth_bytes_per_s) == fit_latency_bandwidth(*zip(*live["allreduce"]))
    assert again.tp_latency_s >= 0 and again.tp_bandwidth_bytes_per_s > 0
    # the layer overhead: the intercept of the decoder-block times, one token included
    block = result.samples["compute"]["bfloat16"]["linear"]["block"]
    assert [t for t, *_ in block] == [LAYER_OVERHEAD_TOKENS, *settings.linear_tokens]
    overhead, rate = fit_linear_block(block, linear_params_per_layer(SMOL))
    assert again.layer_overhead_s == pytest.approx(overhead) and again.linear_flops_per_s["bfloat16"] == rate
    assert plan_prefill("smollm2-135m", 2, again, tokens=64).layer_overhead_ms == pytest.approx(
        SMOL.n_layers * again.layer_overhead_s * 1e3)
    plan = plan_prefill("smollm2-135m", 2, str(path), tokens=2048, chunk_tokens=1024)
    assert plan.to_dict()["hardware_calibrated"] is True and plan.ttft_ms > 0
    assert plan.entries[1].costs[PASS_Q].all2all_s > 0
    for rule in ("alg5", "empirical", "cost"):
        assert choose_strategy(256, 4096, SMOL, 2, again, rule).strategy in (PASS_KV, PASS_Q)
    assert math.isfinite(result.seconds)


def test_ring_strategy_job_times_both_strategies(rank_pool):
    settings = {"model": TINY.to_dict(), "dtype": "float32", "cases": [(16, 0), (8, 40)], "repeats": 2}
    results = rank_pool(2).run(ring_strategy_job, settings)
    assert results[0] == results[1]  # every rank returns the slowest rank's times
    assert [(r["new_tokens"], r["cached_tokens"]) for r in results[0]] == [(16, 0), (8, 40)]
    for r in results[0]:
        assert set(r["seconds"]) == {PASS_KV, PASS_Q} and all(len(v) == 2 for v in r["samples"].values())
        assert all(np.isfinite(list(r["seconds"].values())))


def test_calibrate_spmd_uses_the_existing_group(rank_pool):
    # the torchrun path: every rank of an initialised group calls calibrate_spmd; rank 0 gets the profile
    from ringctx.planning.calibrate import spmd_calibration_job

    settings = CalibrationSettings.make("tiny", quick=True)
    results = rank_pool(2).run(spmd_calibration_job, settings)
    assert results[1] is None
    hw = results[0].profile
    assert set(hw.ring_sizes) == {1, 2} and hw.ring_sizes[2].bandwidth_bytes_per_s > 0
    assert results[0].samples["ring_fit"]["2"]["cases"] >= 1
    assert hw.tp_bandwidth_bytes_per_s > 0 and results[0].samples["tp_link"]["group_size"] == 2
    HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict())))


def test_tp_size_adds_its_group_to_the_measured_sizes():
    from ringctx.planning.calibrate import CalibrationSettings

    settings = CalibrationSettings.make("tiny", cp_sizes=(2,), tp_size=3, quick=True)
    assert settings.cp_sizes == (2, 3) and settings.tp_size == 3
    with pytest.raises(ValueError, match="--tp must be at least 2"):
        CalibrationSettings.make("tiny", cp_sizes=(2,), tp_size=1)
