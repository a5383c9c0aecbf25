"""`ringctx prefill` and `ringctx info` through click's runner."""

import json

import pytest
from click.testing import CliRunner

from ringctx.cli import main


def test_prefill_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    trace = tmp_path / "t.json"
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "500", "--chunk-tokens", "128",
                                       "--nproc", "1", "--follow-up", "0", "--dtype", "float32", "--json", str(out),
                                       "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "time to first token" in result.output and "tokens/s" in result.output
    data = json.loads(out.read_text())
    for key in ("tokens", "world_size", "ttft_s", "tokens_per_s", "chunks", "bytes_sent_per_rank",
                "peak_rss_bytes_per_rank"):
        assert key in data
    assert data["tokens"] == 500 and data["world_size"] == 1
    assert [c["tokens"] for c in data["chunks"]] == [128, 128, 128, 116]
    assert {"tokens", "cached", "strategy", "reason", "seconds"} <= set(data["chunks"][0])
    assert json.loads(trace.read_text())["traceEvents"] and data["follow_up"] is None


def test_prefill_by_default_runs_a_ring_and_a_follow_up_on_its_cache(tmp_path, monkeypatch):
    """No --nproc: 2 ranks on a CPU with 2+ cores (one per GPU); the prompt goes pass-KV, the
    48-token follow-up on its cache goes pass-Q, and the table says so with the bytes moved."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "768", "--chunk-tokens", "256",
                                       "--dtype", "float32", "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and [c["strategy"] for c in data["chunks"]] == ["pass-kv"] * 3
    follow = data["follow_up"]
    assert follow["tokens"] == 48 and follow["cached"] == 768
    assert [c["strategy"] for c in follow["chunks"]] == ["pass-q"] and "pass-Q because" in follow["chunks"][0]["reason"]
    assert min(follow["bytes_sent_per_rank"]) > 0
    assert "follow-up: 48 tokens on 768 cached" in result.output and "+0" in result.output


@pytest.mark.parametrize("args,message", [
    (["--tokens", "0"], "must be >= 1"),
    (["--tokens", "-5"], "must be >= 1"),
    (["--tokens", "3", "--nproc", "4"], "4 ranks for 3 tokens"),
    (["--nproc", "many"], "'many' is neither a number of ranks nor 'auto'"),
    (["--nproc", "0"], "must be >= 1, got 0"),
    (["--follow-up", "-1"], "must be >= 0, got -1"),
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
