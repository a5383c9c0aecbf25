"""The planner counts a hybrid's linear-attention (Gated DeltaNet) layers for what they are: no KV
rows and no ring, their gated delta rule's FLOPs, their states in every memory figure, their two
exchanges and the summaries' way (all-gather or ring) by the link's numbers.

Expected values are computed here from the shapes and the formulas' definitions
(planning/linear_attention.py's docstring), never copied from a run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from ringctx.attention.gated_delta import BLOCK, ChunkForm, PieceSummary
from ringctx.model.config import LinearShape
from ringctx.model.presets import get_preset
from ringctx.planning.decode_plan import plan_decode
from ringctx.planning.hardware import load_profile
from ringctx.planning.linear_attention import (
    ALL_GATHER, RING, conv_tail_bytes, delta_rule_flops_per_token, state_bytes_per_rank, summary_bytes,
    summary_exchange,
)
from ringctx.planning.memory import document_kv_bytes, document_tokens_within, kv_row_bytes, layer_kv_row_bytes
from ringctx.planning.prefill_plan import kv_handoff_seconds, plan_prefill
from ringctx.planning.strategy import (
    choose_strategy, linear_flops, linear_params_per_layer, pass_kv_compute_threshold,
    predict_strategy_cost, ring_heads, threshold_flops, tokens_per_rank,
)
from ringctx.planning.work import chunk_flops

TINY, Q27 = "tiny-qwen3.5", "qwen3.6-27b"


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name, total, active, linear, full", [
    (Q27, 27e9, 27e9, 48, 16), ("qwen3.6-35b-a3b", 35e9, 3e9, 30, 10), ("qwen3-next-80b-a3b", 80e9, 3e9, 36, 12),
])
def test_hybrid_presets_have_their_names_sizes_and_3_to_1_pattern(name, total, active, linear, full):
    config = get_preset(name)
    assert abs(config.n_params - total) / total < 0.05 and abs(config.active_params - active) / active < 0.35
    assert len(config.linear_layers) == linear and len(config.attention_layers) == full
    assert config.attention_layers == [i for i in range(config.n_layers) if (i + 1) % 4 == 0]
    assert config.attn_output_gate and config.norm_plus_one and config.attention(3).rotary_dim == config.head_dim // 4


def test_tiny_preset_is_qwen35s_pattern_at_small_widths():
    config = get_preset(TINY)
    assert (config.n_layers, config.linear_layers, config.attention_layers) == (8, [0, 1, 2, 4, 5, 6], [3, 7])
    assert config.max_seq_len >= 1_000_000 and config.dim <= 128 and config.vocab_size <= 1024
    # its attention layers' KV of 1M tokens: a few hundred MB in float32
    assert kv_row_bytes(config, 1, "float32") * 1_000_000 < 1e9


# ----------------------------------------------------------------------------- FLOPs


def test_delta_rule_flops_are_the_chunked_forms_matmuls():
    """FlopCounterMode counts the matmuls of ChunkForm.build, its scan and a piece's summary; the
    two unit-triangular solves of each block (B^2 per right-hand column: Dv of u, Dk of w), which it
    does not count, are added from their definition."""
    shape = LinearShape(key_heads=2, value_heads=4, key_dim=32, value_dim=48, conv_width=4)
    T, H, Dk, Dv, B = 4 * BLOCK, shape.value_heads, shape.key_dim, shape.value_dim, BLOCK
    q, k = torch.randn(T, H, Dk), torch.randn(T, H, Dk)
    v, g, beta = torch.randn(T, H, Dv), -torch.rand(T, H), torch.rand(T, H)
    with FlopCounterMode(display=False) as one_device:
        form = ChunkForm.build(q, k, v, g, beta)
        form.scan(None)
    with FlopCounterMode(display=False) as summary:
        PieceSummary.of(form)
    solves = (T // B) * H * B * B * (Dk + Dv)
    conv = 2 * shape.conv_width * shape.channels * T
    assert T * delta_rule_flops_per_token(shape, over_ranks=False) == one_device.get_total_flops() + solves + conv
    assert T * delta_rule_flops_per_token(shape, over_ranks=True) == (
        one_device.get_total_flops() + summary.get_total_flops() + solves + conv)


def test_chunk_work_counts_attention_on_attention_layers_and_the_rule_on_linear_ones():
    config = get_preset(TINY)
    T, P = 4096, 10_000
    s = config.linear(0)
    Hv, Dk, Dv, K, C = s.value_heads, s.key_dim, s.value_dim, s.conv_width, 2 * s.key_heads * s.key_dim + \
        s.value_heads * s.value_dim
    rule = Hv * (BLOCK * (5 * Dk + 3 * Dv) + 6 * Dk * Dv) + 2 * K * C
    attention = 2 * (2 * T * (config.n_heads * config.head_dim) * (2 * P + T))  # 2 full layers, causal
    expected = config.n_layers * linear_flops(T, config, 1) + attention + 6 * T * rule
    assert chunk_flops(T, P, config) == expected


def test_matmul_weights_per_layer_count_the_gate_and_the_linear_projections():
    config = get_preset(TINY)
    d, NH, NKV, D, F = config.dim, config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim
    s = config.linear(0)
    C, V = 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim, s.value_heads * s.value_dim
    attention = d * (2 * NH + 2 * NKV) * D + NH * D * d   # q and its gate, k, v; o
    linear = d * (C + V + 2 * s.value_heads) + V * d      # q|k|v, z, b, a; out
    assert linear_params_per_layer(config) == (2 * attention + 6 * linear + 8 * 3 * d * F) // 8


# ----------------------------------------------------------------------------- memory


def test_linear_layers_keep_no_kv_rows_but_a_state():
    config = get_preset(Q27)
    row = 2 * 4 * 256 * 2  # K and V of 4 KV heads x 256, bf16
    assert layer_kv_row_bytes(config, 1, "bfloat16") == [row if (i + 1) % 4 == 0 else 0 for i in range(64)]
    state = 4 * 48 * 128 * 128 + 3 * (2 * 16 * 128 + 48 * 128) * 2  # recurrent float32 + conv inputs bf16
    assert state_bytes_per_rank(config, 1, 2) == 48 * state == config.linear_state_bytes(2)
    half = 4 * 24 * 128 * 128 + 3 * (2 * 8 * 128 + 24 * 128) * 2  # TP 2: 8 key / 24 value heads a rank
    assert state_bytes_per_rank(config, 2, 2) == 48 * half


def test_plan_memory_of_the_27b_at_1m_tokens():
    config = get_preset(Q27)
    plan = plan_prefill(Q27, 8, "h100-rdma", tokens=1_000_000, chunk_tokens=65536)
    rows = sum(tokens_per_rank(t, 8) for t in [65536] * 15 + [1_000_000 - 15 * 65536])
    assert plan.memory.kv_cache_bytes == rows * 16 * (2 * 4 * 256 * 2)
    assert plan.memory.state_bytes == config.linear_state_bytes(2)
    m = plan.memory
    assert m.total_bytes == m.weights_bytes + m.kv_cache_bytes + m.state_bytes + m.activation_bytes
    d = plan.decode
    assert d.state_bytes == config.linear_state_bytes(2)
    assert d.total_bytes == d.weights_bytes + d.kv_slice_bytes + d.state_bytes + d.workspace_bytes
    assert d.kv_slice_bytes == d.slice_tokens * 16 * (2 * 4 * 256 * 2)


def test_decode_memory_counts_the_states_whatever_the_context():
    short = plan_decode(TINY, "cpu", 10, 1, dtype="float32")
    long = plan_decode(TINY, "cpu", 100_000, 1, dtype="float32")
    assert short.state_bytes == long.state_bytes == get_preset(TINY).linear_state_bytes(4) > 0


def test_a_documents_bytes_are_its_attention_rows_and_its_states():
    config = get_preset(TINY)
    rows = layer_kv_row_bytes(config, 1, "float32")
    state = config.linear_state_bytes(4)
    assert document_kv_bytes(config, rows, 1000, state) == 1000 * 2 * (2 * 1 * 16 * 4) + state
    budget = 2 * (2 * 16 * 4) * 5000 + state
    assert document_tokens_within(config, rows, budget, state) == 5000
    assert document_tokens_within(config, rows, budget) > 5000  # without the states more tokens would fit


def test_the_hand_off_moves_the_attention_layers_rows_only():
    config, hw = get_preset(Q27), load_profile("h100-rdma")
    ring = hw.ring(8)
    row = 2 * 4 * 256 * 2
    expected = 16 * (ring.latency_s + 7 * 1000 * row / ring.bandwidth_bytes_per_s)
    assert kv_handoff_seconds(config, hw, 8, 1, "bfloat16", 1000) == pytest.approx(expected)


# ----------------------------------------------------------------------------- the ring rule


def test_the_ring_rule_sees_the_attention_layers_heads():
    config, hw = get_preset(Q27), load_profile("h100-rdma")
    assert ring_heads(config, 1) == (24, 4)
    choice = choose_strategy(8192, 100_000, config, 4, hw)
    assert (choice.n_heads, choice.n_kv_heads) == (24, 4)
    C, BW = threshold_flops(hw, "bfloat16", 4), hw.ring(4).bandwidth_bytes_per_s
    assert choice.compute_threshold_tokens == pytest.approx(pass_kv_compute_threshold(4, C, 24, 4, 2, BW))


# ----------------------------------------------------------------------------- the exchanges


def test_the_27b_on_8_gpus_relays_its_state_and_tiny_on_2_cpu_ranks_gathers():
    hw = load_profile("h100-rdma")
    shape = get_preset(Q27).linear(0)
    ring = hw.ring(8)
    rate = hw.linear_flops("float32")
    L, BW = ring.latency_s, ring.bandwidth_bytes_per_s
    summary, state = 48 * 128 * (128 + 128) * 4, 48 * 128 * 128 * 4
    conv = (3 * (2 * 16 * 128 + 48 * 128) + 1) * 4
    apply = 2 * 48 * 128 * 128 * 128 / rate
    x = summary_exchange(shape, 8, ring, rate)
    assert (x.summary_bytes, x.state_bytes, x.conv_bytes) == (summary, state, conv)
    assert x.all_gather_s == pytest.approx(7 * L + 14 * summary / BW + 16 * apply)
    assert x.ring_s == pytest.approx(14 * (L + state / BW + apply) + apply)
    assert x.conv_s == pytest.approx(7 * L + 14 * conv / BW)
    assert x.strategy == RING and x.seconds == pytest.approx(x.conv_s + x.ring_s)

    cpu = load_profile("cpu")
    tiny = summary_exchange(get_preset(TINY).linear(0), 2, cpu.ring(2), cpu.linear_flops("float32"))
    assert tiny.strategy == ALL_GATHER  # a 16 KB state: latency, not bandwidth, decides
    assert summary_exchange(shape, 1, ring, rate).seconds == 0.0


def test_with_one_collective_call_the_all_gather_wins_as_the_ring_grows():
    shape = get_preset(TINY).linear(0)
    link = SimpleNamespace(latency_s=100e-6, bandwidth_bytes_per_s=1.5e9, all2all_latency_s=500e-6,
                           all2all_bandwidth_bytes_per_s=1.5e9)
    S, St = summary_bytes(shape), shape.recurrent_bytes
    apply = 2 * 4 * 32 * 32 * 32 / 1e10
    picks = {}
    for W in range(2, 9):
        gather = 500e-6 + 2 * (W - 1) * S / 1.5e9 + 2 * W * apply
        relay = 2 * (W - 1) * (100e-6 + St / 1.5e9 + apply) + apply
        x = summary_exchange(shape, W, link, 1e10)
        assert (x.all_gather_s, x.ring_s) == (pytest.approx(gather), pytest.approx(relay))
        picks[W] = x.strategy
        assert picks[W] == (ALL_GATHER if gather <= relay else RING)
    assert picks[2] == RING and picks[8] == ALL_GATHER


def test_the_cost_model_prices_linear_layers_outside_the_ring():
    config, hw = get_preset(TINY), load_profile("cpu")
    T, P, N = 4096, 20_000, 2
    ring = hw.ring(N)
    costs = {s: predict_strategy_cost(s, T, P, config, N, hw, dtype="float32") for s in ("pass-kv", "pass-q")}
    kv, q = costs["pass-kv"], costs["pass-q"]
    assert (kv.n_layers, kv.linear_attention_layers, kv.all_layers) == (2, 6, 8)
    rate = hw.linear_flops("float32") * ring.compute_scale
    n = tokens_per_rank(T, N)
    exchange = summary_exchange(config.linear(0), N, ring, rate)
    rest = linear_flops(n, config, 1) / rate + hw.layer_overhead_s  # matmuls (float32 model) + fixed; TP 1
    expected = 6 * (n * delta_rule_flops_per_token(config.linear(0), over_ranks=True) / rate + exchange.seconds + rest)
    assert kv.linear_attention_s == pytest.approx(expected) and q.linear_attention_s == kv.linear_attention_s
    assert kv.total_s == pytest.approx(2 * kv.layer_s + kv.linear_attention_s)
    assert kv.state_exchange.conv_bytes == conv_tail_bytes(config.linear(0))
    # on one rank nothing is exchanged and the rule runs without summaries
    one = predict_strategy_cost("pass-kv", T, P, config, 1, hw, dtype="float32")
    rate1 = hw.linear_flops("float32") * hw.ring(1).compute_scale
    solo = T * delta_rule_flops_per_token(config.linear(0), over_ranks=False) / rate1
    rest1 = linear_flops(T, config, 1) / rate1 + hw.layer_overhead_s
    assert one.linear_attention_s == pytest.approx(6 * (solo + rest1))


# ----------------------------------------------------------------------------- plan


def test_plan_prints_the_linear_layers_and_the_summaries_way():
    from ringctx.cli.planning import plan

    runner = CliRunner()
    args = ["--model", Q27, "--tokens", "1000000", "--hardware", "h100-rdma", "--cp", "8"]
    shown = runner.invoke(plan, args, terminal_width=160)
    assert shown.exit_code == 0, shown.output
    for text in ("48 Gated DeltaNet 16/48 heads x 128 + 16 full", "linear-attention layers", "state exchanges",
                 "state summaries: ring", "linear-attention states"):
        assert text in shown.output, text
    data = json.loads(runner.invoke(plan, [*args, "--json"]).output)
    assert data["memory"]["state_bytes"] == get_preset(Q27).linear_state_bytes(2)
    assert 0 < data["state_exchange_ms"] < data["linear_attention_ms"] < data["ttft_ms"]


def test_the_decode_floor_reads_attention_rows_and_the_states():
    from ringctx.model import load_model
    from ringctx.planning.machine_speed import decode_bytes_per_token

    model = load_model(TINY, dtype=torch.float32, device="cpu")
    config = model.config
    context = 10_000
    kv = 2 * 2 * 1 * 16 * 4  # K and V, 2 attention layers of 1 KV head x 16, float32
    per_layer_rows = config.decode_kv_rows(context) / 2  # context + 1 in each attention layer
    expected = per_layer_rows * kv + 2 * config.linear_state_bytes(4)
    assert decode_bytes_per_token(model, context) - decode_bytes_per_token(model, 0) == pytest.approx(expected)
    assert per_layer_rows == context + 1


def test_the_default_chunk_counts_a_linear_layers_working_set():
    """qwen3.6-27b: a linear layer's float32 chunked form outweighs the MLP's 3 * ffn_dim a token,
    so the engine's GPU chunk (1 GiB of activations a rank) is sized by it."""
    from ringctx.planning.prefill_plan import chunk_tokens_for

    projections = (2 * 16 * 128 + 48 * 128 + 48 * 128 + 2 * 48) * 2   # q|k|v, z, b, a in bf16
    rule = 48 * (5 * 128 + 3 * 128 + BLOCK) * 4                       # float32 a value head
    assert projections + rule > 3 * 17408 * 2
    per_token = projections + rule + 4 * 5120 * 2
    assert chunk_tokens_for(get_preset(Q27), 8, "bfloat16", on_gpu=True) == (1 << 30) // per_token * 8


def test_the_memory_check_before_a_prefill_counts_the_states():
    from ringctx.runtime.memory_check import prefill_memory_need

    config = get_preset(TINY)
    need = prefill_memory_need(config, "float32", 2, 8192, 0, 4096, decode_room=256, local_ranks=2,
                               decode_here=True, decode_ranks=1)
    row = 2 * (2 * 1 * 16 * 4)  # 2 attention layers' K and V of one token, float32
    states = config.linear_state_bytes(4)
    assert need["shard"] == 2 * tokens_per_rank(4096, 2) * row
    assert need["per_rank"] == need["shard"] + states + need["activations"] + 16 * 8192
    assert need["decode_cache"] == row * (8192 + 256) + states
    assert need["total"] == 2 * need["per_rank"] + need["decode_cache"]
