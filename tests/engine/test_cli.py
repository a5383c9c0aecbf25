"""`ringctx prefill` and `ringctx info` through click's runner."""

import json

import pytest
from click.testing import CliRunner

from ringctx.cli import main


def test_prefill_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    trace = tmp_path / "t.json"
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "500", "--chunk-tokens", "128",
                                       "--dtype", "float32", "--json", str(out), "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "time to first token" in result.output and "tokens/s" in result.output
    data = json.loads(out.read_text())
    for key in ("tokens", "world_size", "ttft_s", "tokens_per_s", "chunks", "bytes_sent_per_rank",
                "peak_rss_bytes_per_rank"):
        assert key in data
    assert data["tokens"] == 500 and data["world_size"] == 1
    assert [c["tokens"] for c in data["chunks"]] == [128, 128, 128, 116]
    assert {"tokens", "cached", "strategy", "reason", "seconds"} <= set(data["chunks"][0])
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize("args,message", [
    (["--tokens", "0"], "must be >= 1"),
    (["--tokens", "-5"], "must be >= 1"),
    (["--tokens", "3", "--nproc", "4"], "4 ranks for 3 tokens"),
    (["--model", "llama9-1t"], "neither a model preset"),
    (["--hardware", "no-such-profile", "--tokens", "10"], "no-such-profile"),
])
def test_prefill_bad_input(args, message):
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", *args] if "--model" not in args else ["prefill", *args])
    assert result.exit_code != 0
    assert message in result.output, result.output


def test_info_json():
    result = CliRunner().invoke(main, ["info", "--json"])
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert "gloo" in report["distributed_backends"] and report["versions"]["torch"]
    kernels = report["cpu_kernels"]  # the variant in use and each kernel's state, or why none runs
    assert set(kernels) == {"variant", "vector_floats", "why", "variants_this_cpu_runs", "kernels"}
    assert kernels["variant"] in kernels["variants_this_cpu_runs"] + [None] and kernels["why"]
    assert all(state == "in use" or state.startswith("not in use: ") for state in kernels["kernels"].values())
    assert report["dtype_auto"]["dtype"] in ("bfloat16", "float32") and report["dtype_auto"]["why"]
