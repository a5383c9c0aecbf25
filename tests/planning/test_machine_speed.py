"""ringctx.planning.machine_speed: the read bandwidth behind the decode floor, and what dtype="auto"
picks: the decision rule on synthetic rounds, and when a cached choice is measured again (the
measuring is monkeypatched: no test here depends on timing)."""

from __future__ import annotations

import datetime
import json
import math

import pytest

from ringctx.kernels import build
from ringctx.planning import machine_speed
from ringctx.planning.machine_speed import BF16_MARGIN, MAX_MEASUREMENTS, Measurement, decide_dtype, preferred_dtype

LONG_AGO = "2026-01-01T00:00:00Z"


def test_read_bandwidth_is_a_plausible_number():
    bw = machine_speed.read_bandwidth(nbytes=64 * 2 ** 20, repeats=3)
    assert math.isfinite(bw) and 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s


def measurement(ratios, *, others=0.01, load=0.1, at=LONG_AGO, float32_ms=10.0) -> Measurement:
    """A measurement whose paired rounds have these bf16/float32 ratios (float32 at float32_ms)."""
    return Measurement(at, {"float32": [float32_ms] * len(ratios), "bfloat16": [r * float32_ms for r in ratios]},
                       others, load, 2, 2, "test CPU", "avx512")


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    """A cache directory of the test's own for the choice; the kernels' library (whose name keys
    the choice's file) is loaded first from the usual one, where it is built once per machine."""
    build.library()
    monkeypatch.setenv("RINGCTX_CACHE_DIR", str(tmp_path))
    return tmp_path


def fake_measuring(monkeypatch, *measurements):
    """measure_dtype returns these in turn (and fails the test when called once more)."""
    left = list(measurements)
    calls = []

    def measure():
        if not left:
            pytest.fail("measured once more than expected")
        calls.append(left[0])
        return left.pop(0)

    monkeypatch.setattr(machine_speed, "measure_dtype", measure)
    return calls


@pytest.mark.parametrize("ratios,dtype,side", [
    ([0.52, 0.55, 0.58, 0.60, 0.54, 0.57, 0.61], "bfloat16", "below"),
    ([0.97, 1.01, 1.04, 0.99, 1.00, 0.98, 1.02], "float32", "at or above"),
    ([0.90] * 7, "float32", "at or above"),  # a tie goes to the more exact float32
])
def test_a_clear_ratio_on_an_idle_machine_is_settled(ratios, dtype, side):
    choice = decide_dtype([measurement(ratios)])
    assert (choice.dtype, choice.status) == (dtype, "settled")
    assert f"lies {side} the margin {BF16_MARGIN}" in choice.status_why and "7 paired rounds" in choice.status_why
    assert choice.ratio == pytest.approx(sorted(ratios)[3])
    assert choice.ratio_interval == pytest.approx(sorted(ratios)[1:6:4])  # the 2nd lowest and 2nd highest of 7
    assert choice.step_ms == {"float32": 10.0, "bfloat16": pytest.approx(10 * sorted(ratios)[3], abs=1e-3)}
    assert "ms in bf16" in choice.why and "avx512 CPU kernels" in choice.why and "test CPU" in choice.measured


def test_ratios_straddling_the_margin_are_within_the_noise():
    choice = decide_dtype([measurement([0.80, 0.82, 0.84, 0.86, 0.88, 0.91, 0.95])])
    assert (choice.dtype, choice.status) == ("bfloat16", "provisional")  # the median says bf16, not surely
    assert "within the noise" in choice.status_why and "0.82-0.91" in choice.status_why


def test_a_measurement_under_load_is_provisional_however_clear():
    by_proc_stat = decide_dtype([measurement([0.55] * 7, others=0.5)])
    assert (by_proc_stat.dtype, by_proc_stat.status) == ("bfloat16", "provisional")
    assert "under load" in by_proc_stat.status_why and "others took 50% of 2 cores" in by_proc_stat.status_why
    # where /proc/stat cannot be read, the load average per core decides
    assert measurement([0.55] * 7, others=None, load=1.5).loaded
    assert decide_dtype([measurement([0.55] * 7, others=None, load=0.5)]).status == "settled"


def test_too_few_rounds_are_provisional():
    choice = decide_dtype([measurement([0.5, 0.5])])
    assert choice.status == "provisional" and "too few" in choice.status_why and choice.ratio_interval is None


def test_the_median_interval_is_the_sign_tests():
    assert machine_speed.median_interval([3.0, 1.0]) is None  # [min, max] of 2 holds the median with 50%
    assert machine_speed.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # 75%
    assert machine_speed.median_interval(list(range(7))) == (1, 5)  # 87.5%; (2, 4) would be 55%
    assert machine_speed.median_interval(list(range(14))) == (4, 9)  # 82%


def test_idle_rounds_set_aside_those_under_load():
    """The issue's case: measured beside a test suite, bf16 looked 0.97x float32; idle, 0.55x."""
    loaded, idle = measurement([0.97] * 7, others=0.6), measurement([0.55] * 7)
    choice = decide_dtype([loaded, idle])
    assert (choice.dtype, choice.status, choice.ratio) == ("bfloat16", "settled", pytest.approx(0.55))
    assert choice.measurements == [loaded, idle] and choice.decided_by() == [idle]


def test_rounds_accumulate_so_the_answer_converges():
    first = measurement([0.80, 0.82, 0.84, 0.86, 0.88, 0.91, 0.95])
    second = measurement([0.80, 0.81, 0.83, 0.84, 0.85, 0.86, 0.87])
    assert decide_dtype([first]).status == "provisional"
    both = decide_dtype([first, second])  # 14 pairs: the 5th to the 10th, 0.83-0.86
    assert (both.dtype, both.status, both.ratio_interval) == ("bfloat16", "settled", [0.83, 0.86])


def test_gpus_get_bf16_without_measuring(monkeypatch):
    fake_measuring(monkeypatch)
    assert machine_speed.auto_dtype("cuda:0").dtype == "bfloat16"
    assert preferred_dtype("cuda") == "bfloat16"


def test_a_settled_choice_is_measured_once_then_read_back(monkeypatch, cache_dir):
    calls = fake_measuring(monkeypatch, measurement([0.55] * 7))
    first = machine_speed.auto_dtype("cpu")
    assert (first.dtype, first.status, len(calls)) == ("bfloat16", "settled", 1)
    assert machine_speed.choice_path().parent == cache_dir
    assert machine_speed.auto_dtype("cpu") == first == machine_speed.read_dtype_choice()  # not measured again
    assert preferred_dtype("cpu") == "bfloat16" and len(calls) == 1


def test_a_provisional_choice_is_measured_again_at_the_next_start_until_the_bound(monkeypatch, cache_dir):
    """Noisy rounds each time: measured at each start (the fake measurements are long past the
    five minutes' wait) until MAX_MEASUREMENTS are kept, then a day after the last, replacing the oldest."""
    noisy = [measurement([0.70, 0.80, 0.95, 1.00, 0.85, 0.92, 0.75]) for _ in range(MAX_MEASUREMENTS)]
    now = datetime.datetime.now(datetime.timezone.utc)
    late = measurement([0.7, 0.8, 0.95, 1.0, 0.85, 0.92, 0.76], at=now.strftime("%Y-%m-%dT%H:%M:%SZ"))
    calls = fake_measuring(monkeypatch, *noisy, late)
    for n in range(1, MAX_MEASUREMENTS + 1):
        choice = machine_speed.auto_dtype("cpu")
        assert choice.status == "provisional" and len(choice.measurements) == len(calls) == n  # joined the kept
    monkeypatch.setattr(machine_speed.time, "time", lambda: now.timestamp())
    due, words = machine_speed.next_measurement(choice)
    assert due and words.endswith("(still provisional after 4: the oldest dropped)")  # LONG_AGO: over a day
    again = machine_speed.auto_dtype("cpu")
    assert len(calls) == MAX_MEASUREMENTS + 1 and again.measurements == [*noisy[1:], late]
    due, words = machine_speed.next_measurement(again)
    tomorrow = (now + datetime.timedelta(days=1)).strftime("%Y-%m-%d %H:%M:%S")
    assert not due and f"from {tomorrow} UTC" in words and machine_speed.auto_dtype("cpu") == again


def test_the_issues_case_a_probe_beside_a_test_suite_no_longer_fixes_float32(monkeypatch, cache_dir):
    """Issue 53: measured beside a test suite, bf16 took 0.97x float32 and float32 was cached for
    good. Now that choice is provisional, and the next start, on an idle machine, gives bf16."""
    calls = fake_measuring(monkeypatch, measurement([0.97, 0.95, 1.0, 0.96, 0.99, 0.98, 0.97], others=0.6),
                           measurement([0.55, 0.52, 0.6, 0.58, 0.54, 0.57, 0.56]))
    busy = machine_speed.auto_dtype("cpu")
    assert (busy.dtype, busy.status) == ("float32", "provisional") and "under load" in busy.status_why
    idle = machine_speed.auto_dtype("cpu")  # the next engine start
    assert (idle.dtype, idle.status, len(calls)) == ("bfloat16", "settled", 2)
    assert machine_speed.auto_dtype("cpu") == idle  # and it stays


def test_the_ranks_of_one_launch_measure_a_provisional_choice_once(monkeypatch, cache_dir):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    calls = fake_measuring(monkeypatch, measurement([0.55] * 7, others=0.5, at=now))
    first = machine_speed.auto_dtype("cpu")  # the first rank measures under load: provisional
    assert first.status == "provisional" and machine_speed.auto_dtype("cpu") == first and len(calls) == 1
    due, words = machine_speed.next_measurement(first)
    assert not due and "measured again by the first engine start from" in words and "measurement 2 of 4" in words
    assert machine_speed.next_measurement(first, now=machine_speed.time.time() + 301)[0]


def test_an_old_cache_file_loads_as_provisional_and_is_measured_again_once(monkeypatch, cache_dir):
    old = {"dtype": "float32", "why": "a decode step took 292.00 ms in bf16 and 300.00 ms in float32 (0.97x)",
           "step_ms": {"float32": 300.0, "bfloat16": 292.0}, "measured": "2026-12-06, AMD EPYC, avx512, 2 threads"}
    machine_speed.choice_path().write_text(json.dumps(old))
    read = machine_speed.read_dtype_choice()
    assert (read.dtype, read.status, read.measurements) == ("float32", "provisional", [])
    assert "older ringctx" in read.status_why and machine_speed.next_measurement(read)[0]
    fake_measuring(monkeypatch, measurement([0.55] * 7))
    again = machine_speed.auto_dtype("cpu")
    assert (again.dtype, again.status, len(again.measurements)) == ("bfloat16", "settled", 1)
    assert machine_speed.auto_dtype("cpu") == again  # settled now: not measured a third time


def test_info_reads_the_cache_and_measure_now_starts_afresh(monkeypatch, cache_dir):
    calls = fake_measuring(monkeypatch, measurement([0.80, 0.82, 0.84, 0.86, 0.88, 0.91, 0.95]),
                           measurement([0.97] * 7))
    provisional = machine_speed.auto_dtype("cpu", measure="if missing")  # nothing cached: measured
    assert machine_speed.auto_dtype("cpu", measure="if missing") == provisional and len(calls) == 1
    fresh = machine_speed.auto_dtype("cpu", measure="now")
    assert (fresh.dtype, fresh.status, fresh.measurements) == ("float32", "settled", [calls[1]])
    with pytest.raises(ValueError, match="measure='sometimes'"):
        machine_speed.auto_dtype("cpu", measure="sometimes")


def test_a_damaged_cache_file_is_measured_again(monkeypatch, cache_dir):
    fake_measuring(monkeypatch, measurement([0.55] * 7))
    machine_speed.choice_path().write_text("{not json")
    choice = machine_speed.auto_dtype("cpu")
    assert choice.status == "settled" and machine_speed.auto_dtype("cpu") == choice  # the rewritten file reads back


def test_the_probe_measures_paired_rounds_and_the_cores_others_took():
    """One real, tiny measurement: its shape and conditions (no assertion on its speeds)."""
    m = machine_speed.measure_dtype(rounds=2, steps=1)
    assert set(m.rounds_ms) == {"float32", "bfloat16"} and all(len(v) == 2 for v in m.rounds_ms.values())
    assert all(t > 0 for v in m.rounds_ms.values() for t in v) and len(m.ratios) == 2
    assert m.others_cpu_share is None or 0 <= m.others_cpu_share <= 1
    assert m.cpus >= 1 and m.threads >= 1 and m.cpu == machine_speed.cpu_model() and m.at.endswith("Z")
    assert datetime.datetime.fromisoformat(m.at.replace("Z", "+00:00"))
