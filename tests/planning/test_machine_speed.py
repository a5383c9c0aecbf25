"""ringctx.planning.machine_speed: the read bandwidth behind the decode floor, and what dtype="auto" picks."""

from __future__ import annotations

import math

import pytest

from ringctx.planning import machine_speed
from ringctx.planning.machine_speed import preferred_dtype


def test_read_bandwidth_is_a_plausible_number():
    bw = machine_speed.read_bandwidth(nbytes=64 * 2 ** 20, repeats=3)
    assert math.isfinite(bw) and 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s


@pytest.mark.parametrize("bf16_ms,float32_ms,want", [(5.0, 10.0, "bfloat16"), (8.9, 10.0, "bfloat16"),
                                                    (9.0, 10.0, "float32"), (12.0, 10.0, "float32")])
def test_bf16_must_be_clearly_faster_to_be_chosen(bf16_ms, float32_ms, want):
    dtype, ratio = machine_speed.faster_dtype({"bfloat16": bf16_ms, "float32": float32_ms})
    assert dtype == want and ratio == pytest.approx(bf16_ms / float32_ms)


def test_gpus_get_bf16_without_measuring(monkeypatch):
    monkeypatch.setattr(machine_speed, "measure_dtype_choice", lambda: pytest.fail("measured on a GPU"))
    assert machine_speed.auto_dtype("cuda:0").dtype == "bfloat16"
    assert preferred_dtype("cuda") == "bfloat16"


def test_the_cpu_choice_is_measured_once_then_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGCTX_CACHE_DIR", str(tmp_path))
    first = machine_speed.auto_dtype("cpu")
    assert first.dtype in ("bfloat16", "float32")
    assert set(first.step_ms) == {"bfloat16", "float32"} and all(t > 0 for t in first.step_ms.values())
    assert first.dtype == machine_speed.faster_dtype(first.step_ms)[0]
    assert "ms in bf16" in first.why and machine_speed.cpu_model() in first.measured
    monkeypatch.setattr(machine_speed, "measure_dtype_choice", lambda: pytest.fail("measured twice"))
    assert machine_speed.auto_dtype("cpu") == first
    assert preferred_dtype("cpu") == first.dtype


def test_a_damaged_cache_file_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGCTX_CACHE_DIR", str(tmp_path))
    fake = machine_speed.DtypeChoice("float32", "measured", {"float32": 1.0, "bfloat16": 1.0}, "today")
    monkeypatch.setattr(machine_speed, "measure_dtype_choice", lambda: fake)
    machine_speed._choice_path().write_text("{not json")
    assert machine_speed.auto_dtype("cpu") == fake
    assert machine_speed.auto_dtype("cpu") == fake  # and the rewritten file reads back
