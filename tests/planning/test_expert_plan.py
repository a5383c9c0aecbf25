"""Expert parallelism in the planner (planning/expert_plan.py, `ringctx plan --ep`): weights per rank
less (EP-1)/EP of the experts, the bytes EP and TP send per token by their formulas, and the pick:
neither when the model fits, else the option that fits and sends less (TP for Qwen3-30B-A3B's 8
experts a token, EP for a top-1 model or where TP would span hosts), none when neither fits."""

import dataclasses
import json

from click.testing import CliRunner

from ringctx.cli.planning import plan
from ringctx.model.presets import get_preset
from ringctx.planning.expert_plan import compare_expert_parallelism, ep_bytes_per_token, tp_bytes_per_token
from ringctx.planning.hardware import load_profile
from ringctx.planning.memory import expert_params, weight_bytes_per_rank
from ringctx.planning.prefill_plan import plan_prefill

QWEN = get_preset("qwen3-30b-a3b")


def test_ep_divides_the_experts_weights_only():
    experts = sum(3 * QWEN.dim * e.expert_ffn_dim * e.n_experts for e in QWEN.layer_experts)
    assert expert_params(QWEN) == experts and 0.9 < experts / QWEN.n_params < 1
    for ep in (1, 2, 4):
        for tp in (1, 2):
            want = -(-(QWEN.n_params - experts * (ep - 1) // ep) * 2 // tp)
            assert weight_bytes_per_rank(QWEN, tp, "bfloat16", ep_size=ep) == want
    assert expert_params(get_preset("tiny")) == 0
    planned = plan_prefill(QWEN, 2, "h200", 10_000, ep_size=2)
    assert planned.memory.weights_bytes == planned.decode.weights_bytes == weight_bytes_per_rank(
        QWEN, 1, "bfloat16", ep_size=2)


def test_bytes_per_token_follow_their_formulas():
    # EP 2: 48 layers x 2 (dispatch, combine) x 8 rows x 2048 x 2 bytes x 1/2; TP 2: 48 x 2 all-reduces x 2048 x 2 x 1
    assert ep_bytes_per_token(QWEN, 2, "bfloat16") == 48 * 2 * 8 * 2048 * 2 // 2 == 4 * tp_bytes_per_token(QWEN, 2, "bfloat16")
    assert tp_bytes_per_token(QWEN, 2, "bfloat16") == 48 * 2 * 2048 * 2
    assert ep_bytes_per_token(QWEN, 1, "bfloat16") == tp_bytes_per_token(QWEN, 1, "bfloat16") == 0


def test_the_pick_and_its_reason():
    h100 = load_profile("h100-rdma")
    fits = compare_expert_parallelism(QWEN, h100, 2, dtype="bfloat16", weight_dtype="bfloat16")
    assert fits.chosen.name == "neither" and "fits on every rank" in fits.reason
    big = compare_expert_parallelism(QWEN, h100, 2, dtype="float32", weight_dtype="float32")
    assert big.chosen.name == "TP 2" and "EP 2 sends" in big.reason
    top1 = dataclasses.replace(QWEN, layer_experts=tuple(dataclasses.replace(e, experts_per_token=1)
                                                          for e in QWEN.layer_experts))
    assert compare_expert_parallelism(top1, h100, 2, dtype="float32", weight_dtype="float32").chosen.name == "EP 2"
    across = compare_expert_parallelism(QWEN, h100, 16, dtype="float32", weight_dtype="float32")
    assert across.chosen.name == "EP 16" and "on one host" in across.reason
    none = compare_expert_parallelism(QWEN, h100, 2, dtype="float32", weight_dtype="float32", other_bytes=60e9)
    assert none.chosen is None and "neither fits" in none.reason


def test_plan_ep_shows_ep_against_tp():
    args = ["--model", "qwen3-30b-a3b", "--tokens", "40000", "--hardware", "h100-rdma", "--cp", "2"]
    result = CliRunner().invoke(plan, args + ["--ep", "2", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "EP against TP" in result.output and "picks TP 2" in result.output and "EP 2" in result.output
    data = json.loads(CliRunner().invoke(plan, args + ["--ep", "2", "--json"]).output)
    assert data["experts"]["chosen"] == "neither" and len(data["experts"]["options"]) == 3
    one = json.loads(CliRunner().invoke(plan, args + ["--json"]).output)
    assert data["memory"]["weights_bytes"] < one["memory"]["weights_bytes"]
    bad = CliRunner().invoke(plan, args + ["--ep", "3"])
    assert bad.exit_code == 1 and "does not divide the 128 experts" in bad.output
    dense = CliRunner().invoke(plan, ["--model", "tiny", "--tokens", "100", "--hardware", "cpu", "--cp", "2",
                                      "--ep", "2"])
    assert dense.exit_code == 1 and "dense model" in dense.output
