"""`ringctx prefill` and `ringctx info` through click's runner."""

import dataclasses
import importlib
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


def test_prefill_json_alone_prints_json_instead_of_tables(tmp_path):
    """`--json` with no file: the same report, alone on stdout (pipeable), no tables."""
    out = tmp_path / "r.json"
    args = ["prefill", "--model", "tiny", "--tokens", "300", "--chunk-tokens", "128", "--nproc", "1",
            "--follow-up", "0", "--decode", "0", "--dtype", "float32"]
    printed = CliRunner().invoke(main, [*args, "--json"])
    assert printed.exit_code == 0, printed.output
    report = json.loads(printed.stdout)
    assert report["tokens"] == 300 and [c["tokens"] for c in report["chunks"]] == [128, 128, 44]
    assert "time to first token" not in printed.stdout
    written = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert written.exit_code == 0 and "time to first token" in written.stdout
    assert json.loads(out.read_text()).keys() == report.keys()


def test_prefill_by_default_runs_a_ring_and_a_follow_up_on_its_cache(tmp_path, monkeypatch):
    """No --nproc: 2 ranks on a CPU with 2+ cores (one per GPU); the prompt goes pass-KV, the
    48-token follow-up on its cache goes pass-Q, and the table says so with the bytes moved."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    out = tmp_path / "r.json"
    # the built-in profile: a measured one's GEMM rate and bandwidth move the rule's thresholds with
    # the machine's load (the follow-up took pass-KV on a busy machine)
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "768", "--chunk-tokens", "256",
                                       "--dtype", "float32", "--device", "cpu", "--hardware", "cpu",
                                       "--json", str(out)])
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
    (["--decode", "-2"], "must be >= 0, got -2"),
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
    assert set(report["compute_dtypes"]) == {"prefill", "decode"} and all(report["compute_dtypes"].values())
    # the families and attention kinds this build runs
    assert {"llama", "mistral", "ministral", "qwen2"} <= set(report["model_families"]["hugging_face_model_types"])
    assert {"sliding window", "aligned chunks", "sink logits"} <= set(report["attention_kinds"])


def test_info_shows_dtype_autos_choice_its_numbers_and_how_to_measure_again(monkeypatch, tmp_path):
    """`info` shows the cached choice (measuring only when there is none), whether it is settled,
    its numbers, conditions, cache file and the command that measures afresh, which it runs with
    --measure-dtype. The measuring is faked: no timing here."""
    from ringctx.kernels import build
    from ringctx.planning import machine_speed

    build.library()  # from the usual cache directory; the choice goes to the test's own
    monkeypatch.setenv("RINGCTX_CACHE_DIR", str(tmp_path))
    rounds = [[10.0, 10.4, 9.8, 10.2], [8.0, 9.6, 9.2, 8.6]]  # bf16/float32 0.80-0.92: within the noise
    noisy = machine_speed.Measurement("2026-12-07T14:00:00Z", {"float32": rounds[0], "bfloat16": rounds[1]},
                                      0.02, 0.3, 2, 2, "test CPU", "avx512")
    clear = dataclasses.replace(noisy, rounds_ms={"float32": rounds[0], "bfloat16": [5.0, 5.1, 4.9, 5.2]})
    left = [noisy, clear]
    monkeypatch.setattr(machine_speed, "measure_dtype", lambda: left.pop(0))
    first = CliRunner().invoke(main, ["info", "--json"])
    assert first.exit_code == 0, first.output
    dtype_auto = json.loads(first.stdout)["dtype_auto"]
    assert (dtype_auto["dtype"], dtype_auto["status"]) == ("bfloat16", "provisional")
    assert "within the noise" in dtype_auto["status_why"] and dtype_auto["margin"] == 0.9
    assert dtype_auto["step_ms"] == {"float32": 10.1, "bfloat16": 8.9}
    assert dtype_auto["step_ms_interquartile"]["float32"] == [9.95, 10.25]
    assert dtype_auto["ratio_interval_75%"] == [0.8, 0.9388] and dtype_auto["ratio"] == pytest.approx(0.8831, abs=1e-4)
    assert dtype_auto["measurements"] == [{"at": "2026-12-07T14:00:00Z", "rounds": 4, "others_cpu_share": 0.02,
                                           "load_average": 0.3, "cores": 2, "under_load": False,
                                           "decided_by": True, "kernels": "avx512", "threads": 2}]
    assert dtype_auto["next"] == "measured again by the next engine start (measurement 2 of 4 kept)"
    assert dtype_auto["measure_afresh"] == "ringctx info --measure-dtype"
    assert dtype_auto["cache_file"] == str(machine_speed.choice_path()) and dtype_auto["cache_file"].startswith(
        str(tmp_path))
    from rich.console import Console

    monkeypatch.setattr(importlib.import_module("ringctx.cli.main"), "console", Console(width=250))
    shown = CliRunner().invoke(main, ["info"])  # the table: the cached choice, not measured again
    assert shown.exit_code == 0 and len(left) == 1
    text = " ".join(shown.stdout.split())
    for words in ("status: provisional", "within the noise", "ringctx info --measure-dtype", "under_load: False",
                  "ratio_interval_75%: 0.8, 0.9388", f"cache_file: {dtype_auto['cache_file']}"):
        assert words in text, words
    measured = CliRunner().invoke(main, ["info", "--json", "--measure-dtype"])
    assert measured.exit_code == 0 and not left
    dtype_auto = json.loads(measured.stdout)["dtype_auto"]
    assert (dtype_auto["dtype"], dtype_auto["status"], len(dtype_auto["measurements"])) == (
        "bfloat16", "settled", 1)
    assert dtype_auto["next"].startswith("kept: it is settled")


def _lines_at_80_columns(monkeypatch, args):
    """`ringctx prefill ARGS` as an 80-column terminal shows it: (exit code, stdout lines, JSON)."""
    from rich.console import Console

    cli = importlib.import_module("ringctx.cli.main")  # the module: ringctx.cli.main is also the click group

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(cli, "console", Console(width=80))
    result = CliRunner().invoke(main, ["prefill", *args])
    return result, result.stdout.splitlines()


def test_prefill_table_reads_at_80_columns_with_one_short_reason_per_chunk(tmp_path, monkeypatch):
    """The default run's table code (a ring of 2 ranks, chunks, a follow-up, the peak's rows) at 80
    columns: no line is wider, every chunk's short reason sits whole on its row (no wrapped cell),
    the rule's formula is printed once, and --json keeps the full reasons."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    out = tmp_path / "r.json"
    result, lines = _lines_at_80_columns(monkeypatch, ["--model", "tiny", "--tokens", "768", "--chunk-tokens", "256",
                                                       "--dtype", "float32", "--device", "cpu", "--hardware", "cpu",
                                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    chunks = data["chunks"] + data["follow_up"]["chunks"]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    for c in chunks:
        assert 0 < len(c["short_reason"]) < 60 and len(c["reason"]) > len(c["short_reason"])
        row = [line for line in lines if c["short_reason"] in line]
        assert len(row) >= 1 and c["strategy"] in row[0], (c["short_reason"], "\n".join(lines))
    assert chunks[0]["short_reason"].startswith("Eq.2: T=256 >= ")
    assert chunks[-1]["short_reason"].startswith("Alg.5: m=") and chunks[-1]["short_reason"].endswith("-> pass-Q")
    formula = chunks[0]["formula"]
    assert formula.startswith("alg5: pass-KV if T >= N*C*NKV*e/(2*NH*BW)")
    assert sum(line.startswith("alg5: pass-KV if") for line in lines) == 1  # once, below the table
    assert "Eq. 2, N*C*NKV*e/(2*NH*BW) with N=2" in chunks[0]["reason"]  # the full text, as before


def test_the_default_runs_reasons_fit_80_columns():
    """The chunks of the default `ringctx prefill` (SmolLM2-135M, 12,288 tokens in chunks of 4,096 on
    2 ranks, a 48-token follow-up), as the strategy rule explains them for the built-in CPU profile
    in either dtype, rendered by the same table code at 80 columns: no reason cell wraps."""
    from rich.console import Console

    from ringctx.cli.main import DEFAULT_FOLLOW_UP_TOKENS, DEFAULT_PREFILL_TOKENS, stats_tables
    from ringctx.runtime.prefill import ChunkStats, PrefillStats
    from ringctx.planning.strategy import choose_strategy

    def stats(tokens, cached, chunk, dtype):
        s = PrefillStats(tokens=tokens, cached=cached, world_size=2, chunk_tokens=chunk, ttft_s=61.234,
                         bytes_sent_per_rank=[123456789, 123456789], kv_shard_bytes_per_rank=[1 << 30, 1 << 30],
                         decode_slice_rows_per_rank=[6168, 6168], handoff_bytes_per_rank=[0, 0],
                         handoff_cross_host_bytes_per_rank=[0, 0], peak_rss_bytes_per_rank=[1 << 31, 1 << 31],
                         handoff_peak_rss_bytes_per_rank=[1 << 31, 1 << 31], decode_ranks=2)
        for i, start in enumerate(range(0, tokens, chunk)):
            t = min(chunk, tokens - start)
            choice = choose_strategy(t, cached + start, "smollm2-135m", 2, "cpu", dtype=dtype)
            s.chunks.append(ChunkStats(i, t, cached + start, choice.strategy, choice.reason, 123.45,
                                       choice.short_reason, choice.formula))
        return s

    for dtype in ("bfloat16", "float32"):
        prompt = stats(DEFAULT_PREFILL_TOKENS, 0, 4096, dtype)
        follow = stats(DEFAULT_FOLLOW_UP_TOKENS, DEFAULT_PREFILL_TOKENS, 4096, dtype)
        console = Console(width=80, record=True)
        for renderable in stats_tables(prompt, "ringctx prefill: smollm2-135m, 12,288 tokens", follow):
            console.print(renderable)
        lines = console.export_text().splitlines()
        assert [c.strategy for c in prompt.chunks + follow.chunks] == ["pass-kv"] * 3 + ["pass-q"]
        for c in prompt.chunks + follow.chunks:
            assert any(c.short_reason in line and c.strategy in line for line in lines), "\n".join(lines)
        assert all(len(line) <= 80 for line in lines)


def test_prefill_reports_its_share_of_the_measured_peak_and_the_dtypes(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "300", "--chunk-tokens", "100",
                                       "--nproc", "1", "--follow-up", "0", "--decode", "4", "--dtype", "float32",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    e = data["efficiency"]
    assert e["compute_dtype"] == "float32" and e["gemm_flops_per_s"]["float32"] == e["peak_flops_per_s"] > 0
    assert e["prefill_flops"] > 0 and e["prefill_seconds"] == pytest.approx(sum(c["seconds"] for c in data["chunks"]))
    assert e["prefill_share_of_peak"] == pytest.approx(e["prefill_flops"] / e["prefill_seconds"] / e["peak_flops_per_s"])
    assert e["decode_ms_per_token"] > 0 and e["decode_floor_ms"] > 0 and e["read_bandwidth_bytes_per_s"] > 0
    assert e["decode_share_of_floor"] == pytest.approx(e["decode_floor_ms"] / e["decode_ms_per_token"])
    assert set(data["compute_dtypes"]) == {"prefill", "decode"}
    for text in ("of peak", "peak: float32 GEMM", "decode step / memory floor", "prefill computes in float32"):
        assert text in result.output, text


def test_prefill_header_warns_of_a_long_predicted_run(monkeypatch):
    cli = importlib.import_module("ringctx.cli.main")  # the module: ringctx.cli.main is also the click group

    monkeypatch.setattr(cli, "PREDICTION_NOTICE_S", 0.0)  # any run counts as long
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "200", "--nproc", "1",
                                       "--follow-up", "0", "--decode", "0", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "predicted: about" in result.output and "`ringctx plan` sizes a cluster for it" in result.output
    assert cli._duration(90) == "about 2 min" and cli._duration(5 * 3600) == "about 5.0 h"
    assert cli._duration(3 * 86400) == "about 3.0 days"


def test_the_progress_bar_counts_work_not_chunks():
    """After 1 of 3 equal-length chunks the bar is at chunk 0's share of the FLOPs (under a third:
    later chunks attend to more), and its ETA is the FLOPs left at chunk 0's rate."""
    import io

    from rich.console import Console

    from ringctx.cli.progress import prefill_progress, work_bar
    from ringctx.runtime.prefill import ChunkStats
    from ringctx.model.presets import get_preset
    from ringctx.planning.work import prefill_chunk_flops

    cfg = get_preset("smollm2-135m")
    work = prefill_chunk_flops([12288], 4096, cfg)
    with prefill_progress(Console(file=io.StringIO())) as progress:
        on_chunk = work_bar(progress, cfg, 4096, 12288)
        on_chunk(1, 3, ChunkStats(0, 4096, 0, "pass-kv", "", 10.0))
        (task,) = progress.tasks
        assert task.completed == work[0] and task.total == sum(work) and task.completed / task.total < 0.2
        assert task.fields["chunks"] == "1/3"
        assert task.fields["work"].eta_s() == pytest.approx(10.0 * (work[1] + work[2]) / work[0])
        on_chunk(2, 3, ChunkStats(1, 4096, 4096, "pass-kv", "", 18.0))
        assert task.fields["work"].eta_s() == pytest.approx(18.0 * work[2] / work[1])


def test_an_uncalibrated_profile_predicts_from_the_gemm_rate_measured_here():
    """The built-in CPU profile holds placeholder peaks: the header's prediction takes this host's
    measured GEMM rate instead (shared by the ranks), so twice the rate predicts less time; a
    calibrated profile keeps its own numbers."""
    import dataclasses
    import types

    import torch

    from ringctx.model.presets import get_preset
    from ringctx.planning.hardware import load_profile

    cli = importlib.import_module("ringctx.cli.main")
    cpu = load_profile("cpu")
    assert not cpu.calibrated
    engine = types.SimpleNamespace(hardware=cpu, model=types.SimpleNamespace(dtype=torch.float32,
                                                                            full_config=get_preset("smollm2-135m")),
                                   cp_size=2, tp_size=1, chunk_tokens=4096, rule="alg5", kv_dtype="model",
                                   decode_ranks=1, weights="model")

    def predicted(rate, hardware=cpu):
        engine.hardware = hardware
        return cli._predicted_seconds(engine, 65536, {"gemm_flops_per_s": {"float32": rate}})

    slow, fast = predicted(1e11), predicted(2e11)
    assert 1.5 < slow / fast <= 2.0 + 1e-9  # compute-bound, plus the ring's fixed costs
    assert predicted(1e11) != cli._predicted_seconds(engine, 65536)  # the placeholder peaks differ
    calibrated = dataclasses.replace(cpu, calibrated=True)
    assert predicted(1e11, calibrated) == predicted(2e11, calibrated) == cli._predicted_seconds(engine, 65536)


PREFILL_TINY = ["prefill", "--model", "tiny", "--chunk-tokens", "2048", "--nproc", "1", "--follow-up", "0",
                "--decode", "0", "--dtype", "float32", "--hardware", "cpu"]


def test_prefill_runs_past_the_trained_context_and_says_so_in_its_header():
    past = CliRunner().invoke(main, [*PREFILL_TINY, "--tokens", "4100"])
    assert past.exit_code == 0, past.output
    header = next(line for line in past.stderr.splitlines() if line.startswith("prefill of"))
    assert "4,100 tokens pass the trained context of tiny, 4,096 tokens" in " ".join(past.stderr.split())
    assert "warning" not in past.stderr  # the header says it, once
    within = CliRunner().invoke(main, [*PREFILL_TINY, "--tokens", "300"])
    assert within.exit_code == 0 and "trained context" not in within.stderr and header


def test_rope_scaling_stretches_the_prefills_model():
    result = CliRunner().invoke(main, [*PREFILL_TINY, "--tokens", "4100", "--rope-scaling", "yarn:2"])
    assert result.exit_code == 0, result.output
    assert "trained context" not in result.stderr


@pytest.mark.parametrize("value, says", [("yarn:0", "the factor must be a number above 1"),
                                         ("foo:2", "unknown type 'foo'"), ("yarn:", "yarn needs a factor")])
@pytest.mark.parametrize("command", ["prefill", "ingest", "serve", "plan"])
def test_bad_rope_scaling_values_are_one_line(command, value, says, tmp_path):
    args = {"prefill": [], "ingest": [str(tmp_path / "doc.txt"), "--save", str(tmp_path / "kv")],
            "serve": [], "plan": ["--tokens", "10"]}[command]
    result = CliRunner().invoke(main, [command, *args, "--rope-scaling", value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--rope-scaling': rope scaling {value!r}: {says}" in " ".join(result.output.split())


def test_ingest_past_the_trained_context_is_one_line_naming_the_ways_out(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 9000)
    result = CliRunner().invoke(main, ["ingest", str(doc), "--save", str(tmp_path / "kv"), "--nproc", "1",
                                       "--dtype", "float32"])
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    for words in ("pass the trained context of smollm2-135m, 8,192 tokens", "--rope-scaling yarn:2",
                  "--allow-long-context"):
        assert words in message, message
    assert not (tmp_path / "kv").exists()


def test_the_long_context_warning_is_one_line(capsys):
    import warnings

    from rich.console import Console

    from ringctx.cli.options import warnings_as_lines
    from ringctx.model.context import ContextGuard
    from ringctx.model.presets import get_preset

    with warnings_as_lines(Console(stderr=True)):
        guard = ContextGuard(get_preset("tiny"), allow=True)
        guard.check(5000, max_new_tokens=10)
        guard.check(6000)
    err = capsys.readouterr().err
    assert err.count("ringctx: warning: 5,010 tokens (5,000 new + 10 to generate) pass the trained context of "
                     "tiny, 4,096 tokens") == 1 and len(err.strip().splitlines()) == 1
    assert warnings.showwarning.__name__ != "show"  # put back on leaving
