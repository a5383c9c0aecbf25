"""`ringctx plan` and `ringctx calibrate` through click's CliRunner (no process groups started)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ringctx.cli_planning import DOES_NOT_FIT_EXIT, calibrate, plan
from ringctx.parallel.hardware import load_profile
from ringctx.parallel.planner import decode_problem, plan_prefill

TEN_M = ["--model", "llama3-8b", "--cp", "32", "--hardware", "h200", "--tokens", "10000000"]


def run(cmd, args):
    return CliRunner().invoke(cmd, args, catch_exceptions=False)


def test_plan_table_single_prefill():
    result = run(plan, ["--model", "llama3-8b", "--cp", "4", "--hardware", "h100-rdma", "--tokens", "100000",
                        "--cached", "900000"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("ringctx plan", "pass-KV ms", "pass-Q ms", "reason:", "alg5:", "TTFT", "prefill memory per rank",
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


def test_plan_reads_a_model_directory_config(tmp_path):
    from ringctx.config import get_preset

    (tmp_path / "config.json").write_text(json.dumps(get_preset("smollm2-135m").to_hf_config()))
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
    (["--model", "llama3-405b", "--tp", "16"], "tp_size=16 is more than the 8 devices of one 'h200' host"),
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
