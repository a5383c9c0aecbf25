"""EngineConfig: one dataclass for every setting an engine runs with, shared by Engine, the CLI and
`plan`; durations written in the unit that reads; the calibrated profile's home."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from ringctx.cli.options import ENGINE_OPTIONS, engine_options
from ringctx.cli.planning import plan, render_calibration
from ringctx.planning.calibrate import Calibration
from ringctx.planning.engine_config import COMMAND_LINE, EngineConfig, field_help, field_names
from ringctx.planning.hardware import (PROFILE_PATH_ENV, RingCalibration, calibrated_profile_path,
                                       default_profile_name, load_profile, save_profile, shown_source)
from ringctx.units import fmt_duration


def test_every_field_has_its_help_and_a_round_trip():
    assert set(field_help()) == set(field_names())
    assert all(len(text) > 20 for text in field_help().values())
    config = EngineConfig(model="tiny", nproc=2, chunk_tokens=777, kv_dtype="fp8", hardware="h200")
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    lines = config.describe().splitlines()
    assert len(lines) == len(field_names())
    width = max(map(len, field_names()))
    assert f"* {'chunk_tokens':<{width}} = 777" in lines and f"  {'rule':<{width}} = 'alg5'" in lines


def test_unknown_and_bad_settings_are_named():
    with pytest.raises(TypeError, match="unknown engine setting chunk_size; the settings are: model, nproc"):
        EngineConfig().replace(chunk_size=10)
    with pytest.raises(ValueError, match="unknown engine setting"):
        EngineConfig.from_dict({"model": "tiny", "colour": "red"})
    for bad, message in (({"strategy": "ring"}, "unknown strategy 'ring'"), ({"nproc": 0}, "nproc must be"),
                         ({"chunk_tokens": 0}, "chunk_tokens must be >= 1"), ({"timeout_s": -1}, "timeout_s"),
                         ({"kv_dtype": "int4"}, "int4"), ({"rule": "alg7"}, "unknown rule 'alg7'"),
                         ({"attn_backend": "cudnn"}, "unknown attn_backend")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad).check()
    EngineConfig().check()
    COMMAND_LINE.check()


def test_engine_options_hand_the_command_one_config():
    """Every engine option of the CLI lands in the config, defaults from COMMAND_LINE."""
    import click

    seen = {}

    @click.command()
    @engine_options
    def show(config):
        seen["config"] = config

    result = CliRunner().invoke(show, ["--chunk-tokens", "300", "--kv-dtype", "int8", "--timeout", "12"])
    assert result.exit_code == 0, result.output
    assert seen["config"] == COMMAND_LINE.replace(chunk_tokens=300, kv_dtype="int8", timeout_s=12.0)
    assert set(ENGINE_OPTIONS) <= set(field_names())
    help_text = CliRunner().invoke(show, ["--help"]).output
    assert "the engine's default for the model and ranks" in " ".join(help_text.split())


def test_engine_built_from_a_config_or_keywords_is_the_same(tmp_path):
    from ringctx import Engine
    from ringctx.runtime.documents import describe_document

    config = EngineConfig(model="tiny", dtype="float32", chunk_tokens=48, kv_dtype="int8")
    with Engine(config=config) as a, Engine("tiny", dtype="float32", chunk_tokens=48, kv_dtype="int8") as b:
        assert a.config == b.config == config
        assert a.chunk_tokens == b.chunk_tokens == 48 and a.kv_dtype == "int8"
        ids = torch.arange(3, 150)
        result_a, result_b = a.prefill(ids, as_document=True), b.prefill(ids, as_document=True)
        assert torch.equal(result_a.logits, result_b.logits)
        a.save_document(result_a.document, str(tmp_path / "doc"))
    assert describe_document(str(tmp_path / "doc"))["engine_config"] == config.to_dict()
    with Engine(config=config, chunk_tokens=64) as c:  # a keyword replaces the config's field
        assert c.chunk_tokens == 64 and c.config == config.replace(chunk_tokens=64)
        document = c.load_document(str(tmp_path / "doc"))
        assert "engine_config" not in document.metadata
    with pytest.raises(TypeError, match="unknown engine setting"):
        Engine("tiny", chunk_size=3)


def test_plan_takes_the_engines_chunk_for_the_same_model_and_ranks():
    """`plan` with no --chunk-tokens plans the chunks an engine of the same model, ranks and dtype runs."""
    from ringctx import Engine

    with Engine("tiny", dtype="float32") as engine:
        chunk = engine.chunk_tokens
    result = CliRunner().invoke(plan, ["--model", "tiny", "--hardware", "cpu", "--cp", "1", "--dtype", "float32",
                                       "--tokens", str(3 * chunk + 5), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert [e["new_tokens"] for e in d["entries"]] == [chunk, chunk, chunk, 5]
    assert d["as_run"]["chunks"].startswith(f"{chunk:,} tokens: the engine's default chunk")
    one = json.loads(CliRunner().invoke(plan, ["--model", "tiny", "--hardware", "cpu", "--tokens", "5000",
                                               "--chunk-tokens", "0", "--json"]).output)
    assert len(one["entries"]) == 1


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (4e-4, "400 us"), (0.0125, "12.5 ms"), (0.5, "500 ms"),
                                           (3.21, "3.21 s"), (119, "119 s"), (840, "14 min"), (19000, "5.28 h"),
                                           (646806.9, "7.49 days"), (86400 * 400, "400 days")])
def test_durations_read_in_their_unit(seconds, text):
    assert fmt_duration(seconds) == text


def test_a_week_long_plan_reads_in_days():
    result = CliRunner().invoke(plan, ["--hardware", "cpu", "--tokens", "1000000", "--kv-dtype", "fp8",
                                       "--dtype", "bfloat16"], terminal_width=80)
    assert result.exit_code == 0, result.output
    ttft = next(line for line in result.output.splitlines() if "TTFT" in line)
    assert "days" in ttft and "built-in" in result.output and "/ringctx/hardware/" not in result.output


def test_the_calibrated_profile_lives_in_the_users_config(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_PATH_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert calibrated_profile_path() == tmp_path / "config" / "ringctx" / "hardware.json"
    assert default_profile_name(on_gpu=False) == "cpu" and default_profile_name(on_gpu=True) == "h200"
    cpu = load_profile("cpu")
    assert shown_source(cpu) == "built-in"
    calibrated_profile_path().parent.mkdir(parents=True)
    mine = save_profile(dataclasses.replace(cpu, name="mine", calibrated=True), calibrated_profile_path())
    assert default_profile_name(on_gpu=False) == str(mine) and shown_source(load_profile(str(mine))) == str(mine)
    monkeypatch.setenv(PROFILE_PATH_ENV, str(tmp_path / "elsewhere.json"))
    assert calibrated_profile_path() == tmp_path / "elsewhere.json" and default_profile_name(False) == "cpu"


def test_calibration_tables_read_on_80_columns(capsys):
    from ringctx.cli import planning

    ring = RingCalibration(cp_size=2, threads_per_rank=1, compute_scale=0.98, latency_s=1.2e-4,
                           bandwidth_bytes_per_s=1.4e9, all2all_latency_s=2.5e-4, all2all_bandwidth_bytes_per_s=1.1e9,
                           comm_overlap=0.4, overhead_s={"pass-kv": 1.5e-3, "pass-q": 2.1e-3})
    one = dataclasses.replace(ring, cp_size=1)
    profile = dataclasses.replace(load_profile("cpu"), ring_sizes={1: one, 2: ring})
    old = planning.console
    planning.console = planning.Console(width=80, force_terminal=False)
    try:
        render_calibration(Calibration(profile=profile, samples={}, seconds=12.0), "/tmp/hardware.json")
    finally:
        planning.console = old
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    for header in ("SendRecv GB/s", "All2All us", "compute x", "pass-KV +ms"):
        assert header in out


def test_hardware_choices_resolve_before_anything_is_measured(tmp_path, monkeypatch):
    from ringctx.planning.hardware import AUTO, MEASURED, resolve_hardware

    monkeypatch.setenv(PROFILE_PATH_ENV, str(tmp_path / "hardware.json"))
    assert resolve_hardware(None, on_gpu=False) == "cpu" and resolve_hardware(None, on_gpu=True) == "h200"
    assert resolve_hardware(AUTO, on_gpu=False) == MEASURED and resolve_hardware(AUTO, on_gpu=True) == "h200"
    assert resolve_hardware(MEASURED, on_gpu=False) == MEASURED and resolve_hardware(MEASURED, on_gpu=True) == "h200"
    assert resolve_hardware("h100-tcp", on_gpu=False) == "h100-tcp"
    save_profile(dataclasses.replace(load_profile("cpu"), name="mine", calibrated=True), tmp_path / "hardware.json")
    assert resolve_hardware(AUTO, on_gpu=False) == str(tmp_path / "hardware.json") == resolve_hardware(None, False)


def test_measured_hardware_is_what_every_rank_decides_with(tmp_path, monkeypatch):
    """hardware="measured": the ranks measure together, every rank holds the same profile (the same
    choices on every rank), the rule's constants are the measured ones, plan finds it afterwards."""
    from ringctx import Engine
    from ringctx.planning.hardware import MEASURED, measured_profile_path
    from ringctx.planning.strategy import choose_strategy

    monkeypatch.setenv(PROFILE_PATH_ENV, str(tmp_path / "hardware.json"))
    with Engine("tiny", nproc=2, hardware="measured", dtype="float32") as engine:
        hw = engine.hardware
        assert hw.name == MEASURED and not hw.calibrated and hw.bandwidth_bytes_per_s != load_profile("cpu").bandwidth_bytes_per_s
        assert hw.peak_flops["float32"] > 0 and "measured at start-up on 2 ranks" in hw.description
        # the attention kernel's own rate, not the GEMMs' (one block of up to 1,024 rows)
        (point,) = hw.attention_throughput["float32"]
        assert point.block_tokens == min(1024, engine.chunk_tokens) and 0 < point.flops_per_s == hw.attention_flops_per_s("float32", 4096)
        result = engine.prefill(torch.arange(300) % 250, chunk_tokens=100)
        for chunk in result.stats.chunks:
            want = choose_strategy(chunk.tokens, chunk.cached, engine.model.full_config, 2, hw, "alg5", dtype="float32")
            assert chunk.strategy == want.strategy
    saved = load_profile(str(measured_profile_path(2)))
    assert saved.peak_flops == hw.peak_flops and saved.bandwidth_bytes_per_s == hw.bandwidth_bytes_per_s
    planned = CliRunner().invoke(plan, ["--model", "tiny", "--tokens", "1000", "--dtype", "float32", "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.output)["as_run"]["hardware"].startswith("measured here by an engine on 2 CP ranks")
