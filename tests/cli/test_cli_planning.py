"""`ringctx plan` and `ringctx calibrate` through click's CliRunner (no process groups started)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ringctx.cli.planning import DOES_NOT_FIT_EXIT, calibrate, plan
from ringctx.planning.hardware import load_profile
from ringctx.planning.mesh_proposal import propose_mesh
from ringctx.planning.prefill_plan import decode_problem, plan_prefill

TEN_M = ["--model", "llama3-8b", "--cp", "32", "--hardware", "h200", "--tokens", "10000000"]


def run(cmd, args):
    return CliRunner().invoke(cmd, args, catch_exceptions=False)


def test_plan_table_single_prefill():
    result = run(plan, ["--model", "llama3-8b", "--cp", "4", "--hardware", "h100-rdma", "--tokens", "100000",
                        "--cached", "900000", "--chunk-tokens", "0"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("ringctx plan", "pass-KV", "pass-Q", "reason:", "alg5:", "TTFT", "prefill memory per rank",
                 "KV-cache shard", "decode memory per device", "4 of 8 on one host", "bfloat16 (model)",
                 "KV slice (250,064 tokens)", "fits: yes", "UNCALIBRATED"):
        assert text in out, text


def test_plan_table_chunked():
    result = run(plan, ["--cp", "2", "--hardware", "cpu", "--tokens", "8192", "--chunk-tokens", "2048",
                        "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "4 chunks" in result.output and "chunk 0:" in result.output


def test_plan_json_matches_the_planner():
    args = ["--model", "smollm2-135m", "--cp", "2", "--hardware", "cpu", "--tokens", "5000", "--cached", "100",
            "--chunk-tokens", "2048", "--dtype", "float32", "--rule", "cost", "--json"]
    result = run(plan, args)
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    expected = plan_prefill("smollm2-135m", 2, "cpu", 5000, cached=100, chunk_tokens=2048, dtype="float32",
                            rule="cost")
    assert d["ttft_ms"] == pytest.approx(expected.ttft_ms) and d["rule"] == "cost"
    assert [e["strategy"] for e in d["entries"]] == [e.strategy for e in expected.entries]
    for e in d["entries"]:
        assert e["strategy"] in ("pass-kv", "pass-q") and set(e["predicted_ms"]) == {"pass-kv", "pass-q"}
        assert e["reason"].startswith("cost: ")
    assert {"weights_bytes", "kv_cache_bytes", "activation_bytes", "fits"} <= set(d["memory"])
    assert "handoff_ms" in d and d["hardware_calibrated"] is False


def test_plan_counts_int8_weights_codes_on_a_cpu():
    args = ["--model", "smollm2-135m", "--hardware", "cpu", "--tokens", "4096", "--json"]
    model_w, int8_w = (json.loads(run(plan, args + extra).output) for extra in ([], ["--weights", "int8"]))
    assert int8_w["weights"] == "int8" and model_w["weights"] == "model"
    assert int8_w["memory"]["weights_bytes"] - model_w["memory"]["weights_bytes"] == 107_827_200
    assert int8_w["decode"]["weights_bytes"] - model_w["decode"]["weights_bytes"] == 107_827_200
    assert "int8 weights" in run(plan, args[:-1] + ["--weights", "int8"]).output


def test_plan_reads_a_model_directory_config(tmp_path):
    from ringctx.model.config_hf import hf_config_dict
    from ringctx.model.presets import get_preset

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(get_preset("smollm2-135m"))))
    result = run(plan, ["--model", str(tmp_path), "--hardware", "cpu", "--tokens", "1000", "--json",
                        "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["model"] == tmp_path.name


def test_plan_ten_million_tokens_fp8_over_eight_h200s_fits():
    result = run(plan, [*TEN_M, "--decode-ranks", "8", "--kv-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("KV cache fp8", "decode memory per device", "8 of 8 on one host",
                 "KV slice (1,250,032 tokens)", "84.482 GB", "16.061 GB", "workspace (one decode step)", "0.194 GB",
                 "101 GB",
                 "127 GB of 141 GB", "fits: yes"):
        assert text in out, text
    assert "NO" not in out


def test_plan_ten_million_tokens_on_one_decode_rank_is_refused():
    result = CliRunner().invoke(plan, [*TEN_M, "--decode-ranks", "1", "--kv-dtype", "fp8"])
    assert result.exit_code == DOES_NOT_FIT_EXIT == 3
    assert result.stdout == ""  # no tables: the one line is the answer
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: the decode does not fit: 10,000,000 tokens")
    assert "693.2 GB per device" in lines[0] and "126.9 GB usable" in lines[0]
    assert lines[0].endswith("the smallest setting that fits is --decode-ranks 7 --kv-dtype fp8")


def test_plan_ten_million_bf16_tokens_are_refused_by_default():
    # the default: all 8 GPUs of the decode host, the cache in the activation dtype (163.8 GB each)
    result = CliRunner().invoke(plan, TEN_M)
    assert result.exit_code == DOES_NOT_FIT_EXIT
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "over 8 decode ranks" in lines[0] and "KV slice 163.8 GB" in lines[0]
    assert lines[0].endswith("--decode-ranks 7 --kv-dtype fp8")


def test_plan_json_when_the_decode_does_not_fit():
    result = CliRunner().invoke(plan, [*TEN_M, "--decode-ranks", "1", "--kv-dtype", "fp8", "--json"])
    assert result.exit_code == DOES_NOT_FIT_EXIT
    d = json.loads(result.stdout)  # the whole JSON on stdout, the reason on stderr
    assert d["fits"] is False and d["memory"]["fits"] is True and d["decode"]["fits"] is False
    assert d["decode"]["decode_ranks"] == 1 and d["kv_dtype"] == "fp8"
    assert d["decode"]["smallest_fitting"] == {"decode_ranks": 7, "kv_dtype": "fp8"}
    assert result.stderr.strip() == f"Error: {d['suggestion']}"
    expected = plan_prefill("llama3-8b", 32, "h200", 10_000_000, decode_ranks=1, kv_dtype="fp8")
    assert d["suggestion"] == decode_problem(expected)


def test_plan_json_decode_numbers():
    result = run(plan, [*TEN_M, "--decode-ranks", "8", "--kv-dtype", "fp8", "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["fits"] is True and d["suggestion"] is None
    dec = d["decode"]
    assert dec["kv_slice_bytes"] == 84_482_162_688 and dec["weights_bytes"] == 16_060_522_496
    assert dec["total_bytes"] == 100_736_904_320 and dec["fits"] is True and dec["smallest_fitting"] is None


def test_plan_help_names_the_decode_options():
    out = run(plan, ["--help"]).output
    assert "--decode-ranks" in out and "--kv-dtype" in out and "fp8" in out
    assert "devices_per_host" in out and "3  the decode side does not fit" in out


@pytest.mark.parametrize("args, message", [
    (["--decode-ranks", "0"], "decode_ranks must be an integer from 1 to 8 (the 8 devices of one 'h200' host"),
    (["--decode-ranks", "9"], "got 9; pass 1 to 8"),
    (["--kv-dtype", "fp4"], "unknown kv_dtype 'fp4'; use one of model, bfloat16, float16, float32, fp8, int8"),
])
def test_plan_decode_input_errors_are_one_line(args, message):
    result = CliRunner().invoke(plan, ["--model", "llama3-8b", "--cp", "8", "--hardware", "h200", "--tokens", "1000",
                                       *args])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5", "--tokens", "10"], "unknown model 'gpt-5'"),
    (["--tokens", "0"], "tokens must be an integer >= 1, got 0"),
    (["--tokens", "-5"], "tokens must be an integer >= 1, got -5"),
    (["--tokens", "10", "--cp", "0"], "cp_size must be an integer >= 1"),
    (["--tokens", "10", "--hardware", "a100"], "unknown hardware profile 'a100'"),
    (["--tokens", "10", "--tp", "2"], "tp_size=2 does not divide the 9 query heads"),
    (["--tokens", "10", "--dtype", "int4"], "unknown dtype 'int4'"),
    (["--tokens", "10", "--dtype", "float16", "--weights", "int8"], "no peak_flops for dtype 'float16'"),
    (["--tokens", "10", "--hardware", "h200", "--dtype", "float16", "--weights", "int8"],
     "int8 weights need a bfloat16 or float32 model"),
])
def test_plan_errors_are_one_line(args, message):
    result = CliRunner().invoke(plan, ["--hardware", "cpu", *args] if "--hardware" not in args else args)
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output


def test_plan_malformed_profile(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", ')
    result = CliRunner().invoke(plan, ["--hardware", str(bad), "--tokens", "10"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "not valid JSON" in lines[0] and str(bad) in lines[0]
    data = load_profile("cpu").to_dict()
    data["bandwidth_bytes_per_s"] = -1
    bad.write_text(json.dumps(data))
    result = CliRunner().invoke(plan, ["--hardware", str(bad), "--tokens", "10"])
    assert result.exit_code != 0 and "'bandwidth_bytes_per_s' must be > 0" in result.output


def test_calibrate_quick_single_rank_writes_a_profile(tmp_path):
    # --nproc 1: compute only, no process group (the live-group part is tested in test_calibrate)
    out = tmp_path / "hw.json"
    result = run(calibrate, ["--quick", "--nproc", "1", "--model", "tiny", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["path"] == str(out) and d["profile"]["calibrated"] is True
    hw = load_profile(str(out))
    assert set(hw.ring_sizes) == {1} and hw.linear_flops_per_s["bfloat16"] > 0
    planned = run(plan, ["--model", "tiny", "--hardware", str(out), "--tokens", "512", "--json"])
    assert planned.exit_code == 0 and json.loads(planned.output)["hardware_calibrated"] is True


@pytest.mark.parametrize("args, message", [
    (["--nproc", "two"], "--nproc must be ring sizes"),
    (["--nproc", "0"], "--nproc must be ring sizes"),
    (["--model", "nope"], "unknown model 'nope'"),
    (["--dtype", "fp8"], "float8 attention is not measurable"),
    (["--out", "/no/such/dir/x.json"], "does not exist"),
])
def test_calibrate_errors(args, message):
    result = CliRunner().invoke(calibrate, ["--quick", *args])
    assert result.exit_code != 0 and message in result.output, result.output


# ----------------------------------------------------------------------------- the mesh: --hosts


PAPER_1M = ["--model", "llama3-405b", "--hardware", "h100-rdma", "--tokens", "1000000", "--weight-dtype", "float8",
            "--kv-dtype", "fp8"]


def test_plan_proposes_the_mesh_for_the_hosts():
    result = run(plan, [*PAPER_1M, "--hosts", "16", "--gpus-per-host", "8"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("mesh: 16 hosts x 8 GPUs", "CP 128 x TP 1", "CP 64 x TP 2", "CP 32 x TP 4", "CP 16 x TP 8",
                 "<- proposed", "TP 8 is the smallest that fits", "CP 16 x TP 8", "TTFT", "of which TP all-reduces"):
        assert text in out, text
    # the chosen mesh's plan follows, as `--cp 16 --tp 8` prints it
    forced = run(plan, [*PAPER_1M, "--cp", "16", "--tp", "8"]).output
    assert out.endswith(forced)
    # --gpus-per-host defaults to the profile's devices_per_host (8)
    assert run(plan, [*PAPER_1M, "--hosts", "16", "--json"]).output == \
        run(plan, [*PAPER_1M, "--hosts", "16", "--gpus-per-host", "8", "--json"]).output


def test_plan_mesh_json_carries_the_proposal_and_alternatives():
    result = run(plan, [*PAPER_1M, "--hosts", "16", "--chunk-tokens", "0", "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    mesh = d["mesh"]
    assert mesh["chosen"] == {"cp_size": 16, "tp_size": 8} and mesh["hosts"] == 16 and mesh["gpus_per_host"] == 8
    assert [(o["cp_size"], o["tp_size"], o["fits"]) for o in mesh["options"]] == [
        (128, 1, False), (64, 2, False), (32, 4, False), (16, 8, True)]
    expected = propose_mesh("llama3-405b", 16, 8, "h100-rdma", 1_000_000, weight_dtype="float8", kv_dtype="fp8")
    for got, want in zip(mesh["options"], expected.options):
        assert got["ttft_ms"] == pytest.approx(want.ttft_ms) and got["memory_bytes"] == want.memory_bytes
    # the rest is the chosen mesh's plan
    assert d["cp_size"] == 16 and d["tp_size"] == 8 and d["ttft_ms"] == pytest.approx(expected.chosen.ttft_ms)


def test_plan_hosts_with_a_forced_tp():
    # TP 4 is planned as forced although its GPUs (and its decode host: status 3) do not fit
    result = CliRunner().invoke(plan, [*PAPER_1M, "--hosts", "16", "--tp", "4", "--json"])
    assert result.exit_code == DOES_NOT_FIT_EXIT
    d = json.loads(result.stdout)
    assert d["mesh"]["forced"] is True and d["mesh"]["chosen"] == {"cp_size": 32, "tp_size": 4}
    assert d["cp_size"] == 32 and d["memory"]["fits"] is False


def test_plan_hosts_when_no_mesh_fits():
    # bf16 weights: 101.5 GB per GPU even at TP 8; the table is printed, then one line, status 3
    result = CliRunner().invoke(plan, ["--model", "llama3-405b", "--hardware", "h100-rdma", "--tokens", "1000000",
                                       "--hosts", "16"])
    assert result.exit_code == DOES_NOT_FIT_EXIT
    assert "CP 16 x TP 8" in result.stdout and "proposed" not in result.stdout
    assert result.stderr.startswith("Error: no mesh of 16 hosts x 8 GPUs fits llama3-405b")
    assert len(result.stderr.strip().splitlines()) == 1
    d = json.loads(CliRunner().invoke(plan, ["--model", "llama3-405b", "--hardware", "h100-rdma", "--tokens",
                                             "1000000", "--hosts", "16", "--json"]).stdout)
    assert d["fits"] is False and d["mesh"]["chosen"] is None and d["suggestion"].startswith("no mesh of 16 hosts")


def test_readme_plan_still_works():
    args = ["--model", "llama3-405b", "--cp", "16", "--tp", "8", "--weight-dtype", "float8", "--hardware", "h100-rdma",
            "--tokens", "1000000", "--chunk-tokens", "131072", "--kv-dtype", "fp8"]
    result = run(plan, args)
    assert result.exit_code == 0, result.output
    assert "8 chunks" in result.output and "of which TP all-reduces" in result.output
    assert "mesh:" not in result.output  # a forced mesh: no proposal
    d = json.loads(run(plan, [*args, "--json"]).output)
    assert "mesh" not in d and d["cp_size"] == 16 and d["tp_size"] == 8 and d["fits"] is True


def test_plan_paper_follow_up_question_picks_pass_q():
    # the paper's CP4 x TP8 run at 128K context: pass-Q below a 5% miss rate, pass-KV at 10% and 20%
    def strategy(tokens):
        result = run(plan, ["--model", "llama3-405b", "--cp", "4", "--tp", "8", "--hardware", "h100-rdma",
                            "--weight-dtype", "float8", "--tokens", str(tokens), "--cached", str(128_000 - tokens),
                            "--json"])
        assert result.exit_code == 0, result.output
        (entry,) = json.loads(result.output)["entries"]
        return entry["strategy"], entry["reason"]

    q, reason = strategy(3200)
    assert q == "pass-q" and "heads per TP rank (TP 8): NH=16, NKV=1" in reason
    assert strategy(12_800)[0] == strategy(25_600)[0] == "pass-kv"


@pytest.mark.parametrize("args, message", [
    (["--hosts", "2", "--cp", "4"], "--hosts and --cp both set the CP size"),
    (["--hosts", "2", "--tp", "3"], "--tp 3 does not divide the 8 GPUs of one host"),
    (["--hosts", "2", "--gpus-per-host", "4", "--tp", "8"],
     "--tp 8 is more than the 4 GPUs of one host (--gpus-per-host)"),
    (["--cp", "4", "--tp", "16"], "--tp 16 is more than the 8 GPUs of one host (devices_per_host of profile 'h200'"),
    (["--cp", "4", "--gpus-per-host", "6", "--tp", "4"], "--tp 4 does not divide the 6 GPUs of one host"),
    (["--hosts", "0"], "Invalid value for '--hosts'"),
    (["--hosts", "2", "--gpus-per-host", "0"], "Invalid value for '--gpus-per-host'"),
])
def test_plan_bad_mesh_combinations_are_usage_errors(args, message):
    result = CliRunner().invoke(plan, ["--model", "llama3-8b", "--hardware", "h200", "--tokens", "1000", *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0], result.output


def test_plan_reasons_are_short_with_the_formula_once(monkeypatch):
    """Chunk 0's and each switch's short reason below the table, the rule with its constants once;
    a terminal of 120+ columns also gets each chunk's short reason in the table; --json keeps the
    full reasons."""
    from rich.console import Console

    import ringctx.cli.planning as cli_planning

    args = ["--cp", "2", "--hardware", "cpu", "--tokens", "8192", "--chunk-tokens", "2048", "--dtype", "float32"]
    for width in (80, 130):
        monkeypatch.setattr(cli_planning, "console", Console(width=width))
        lines = run(plan, args).output.splitlines()
        assert "chunk 0: Eq.2: T=2048 >= 159 -> pass-KV" in lines
        assert sum(line.startswith("alg5: pass-KV if T >= N*C*NKV*e/(2*NH*BW) = 159") for line in lines) == 1
        in_table = [line for line in lines if line.startswith("│") and "Eq.2: T=2048 >= 159 -> pass-KV" in line]
        assert len(in_table) == (4 if width == 130 else 0)
    d = json.loads(run(plan, [*args, "--json"]).output)
    choice = d["entries"][0]["choice"]
    assert choice["short_reason"] == "Eq.2: T=2048 >= 159 -> pass-KV" and "Eq. 2, N*C*NKV*e/(2*NH*BW)" in choice["reason"]


def test_plan_warns_past_the_trained_context_and_rope_scaling_moves_it():
    args = ["--model", "tiny", "--cp", "1", "--hardware", "cpu", "--tokens", "5000", "--cached", "100"]
    past = run(plan, args)
    assert past.exit_code == 0, past.output
    warning = [line for line in past.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "5,100 tokens pass the trained context of tiny, 4,096 tokens" in warning[0]
    assert "warning" not in run(plan, [*args, "--rope-scaling", "yarn:2"]).stderr
    d = json.loads(run(plan, [*args, "--json"]).stdout)  # with --json: in the JSON, stdout stays JSON
    assert "4,096" in d["context_warning"]
    assert "context_warning" not in json.loads(run(plan, [*args[:-4], "--tokens", "4096", "--json"]).stdout)
