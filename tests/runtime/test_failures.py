"""Failures end with one clear message, never a hang or a wrong answer.

Lost ranks (spawn mode, torchrun), a rendezvous that never completes, Ctrl-C, ranks that loaded a
different model / dtype / ringctx version, prefills that would not fit in memory, and bad input
in spawn mode and under torchrun. Cross-host failures are in tests/multihost/.
Ranks are killed at a known point with the RINGCTX_TEST_KILL test hook (ringctx.runtime.failures).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ringctx.cli import main
from ringctx.engine import Engine
from ringctx.runtime.failures import RankFailure, process_state
from ringctx.runtime.memory_check import memory_problem, prefill_memory_need
from ringctx.parallel.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(ROOT / "scripts" / "launch_multihost.sh")
IDS = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
ENV = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def start(argv, **kwargs) -> subprocess.Popen:
    """A command in its own session (so that Ctrl-C can go to its whole process group), with
    SIGINT's default action as in a terminal: a test run started in the background by a shell
    without job control ignores SIGINT, and a Python child would inherit that and never see Ctrl-C."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True, preexec_fn=_default_sigint, **kwargs)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running after {timeout}s:\n{err[-3000:]}")
    return proc.returncode, err


def group_is_gone(pgid: int, wait: float = 10.0) -> bool:
    """No process of the process group `pgid` (ours) is left, zombies aside."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        alive = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid
                 and process_state(int(p)) != "dead"]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# ----------------------------------------------------------------------------- spawn mode: lost ranks


def test_a_rank_killed_mid_prefill_is_named_and_every_rank_ends(monkeypatch):
    monkeypatch.setenv("RINGCTX_TEST_KILL", "2:chunk2")  # rank 2 SIGKILLs itself after chunk 2 of 6
    engine = Engine("tiny", nproc=3, dtype="float32", timeout_s=240)
    workers = list(engine.worker_processes)
    start_time = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 2 of 3 was killed by SIGKILL during prefill") as info:
        engine.prefill(IDS, chunk_tokens=50)
    assert time.monotonic() - start_time < 120  # moments, not the 240 s timeout (loose: the machine may be loaded)
    assert info.value.lost_ranks == (2,)
    assert all(not p.is_alive() for p in workers)  # the survivor was ended too
    with pytest.raises(RankFailure, match="this engine is closed: rank 2 of 3 was killed"):
        engine.prefill(IDS[:10])
    engine.close()  # idempotent after a failure


def test_the_cli_reports_a_lost_rank_in_one_line_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGCTX_TEST_KILL", "1:chunk2")
    out = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--nproc", "2", "--tokens", "600",
                                       "--chunk-tokens", "100", "--dtype", "float32", "--json", str(out)])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == "Error: rank 1 of 2 was killed by SIGKILL during prefill"
    assert "Traceback" not in result.output and not out.exists()


def test_a_worker_that_dies_before_joining_fails_start_up_at_once(monkeypatch):
    monkeypatch.setenv("RINGCTX_TEST_KILL", "1:join")
    before = set(multiprocessing.active_children())
    start_time = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 2 was killed by SIGKILL during start-up"):
        Engine("tiny", nproc=2, dtype="float32", timeout_s=120)
    assert time.monotonic() - start_time < 30  # not the 120 s timeout
    assert set(multiprocessing.active_children()) <= before


def test_idle_engine_survives_its_timeout_and_a_stuck_rank_times_out(monkeypatch):
    """Spawned workers wait for commands without a timeout; a rank that stops answering in a
    collective ends the prefill at `timeout_s`, named. Also: memory refusals keep the engine usable."""
    monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", "96KiB")  # inherited by the workers
    engine = Engine("tiny", nproc=2, dtype="float32", timeout_s=3)
    with pytest.raises(ValueError, match=r"not enough memory for a prefill of 300 tokens on 2 rank\(s\)") as info:
        engine.prefill(IDS)
    message = str(info.value)
    assert "RINGCTX_MEMORY_LIMIT=96KiB" in message and "KV shard" in message
    assert "no setting of this host fits 300 tokens" in message  # bf16, fp8, ranks: none fits in 96 KiB
    assert "use --" not in message
    time.sleep(4)  # idle for longer than timeout_s
    small = engine.prefill(IDS[:12], decode_room=0)  # fits: the engine is still usable
    reference = Engine("tiny", dtype="float32").prefill(IDS[:12], decode_room=0)
    torch.testing.assert_close(small.logits, reference.logits, atol=2e-5, rtol=1e-5)
    worker = engine.worker_processes[0]
    os.kill(worker.pid, signal.SIGSTOP)  # alive but silent
    try:
        start_time = time.monotonic()
        with pytest.raises(RankFailure, match=rf"did not complete within the 3 s timeout: rank 1 \(pid {worker.pid}\) "
                                              r"is stopped"):
            engine.prefill(IDS[:12], decode_room=0)
        assert time.monotonic() - start_time < 60  # the 3 s timeout and the diagnosis, not a hang
        assert not worker.is_alive()
    finally:
        if worker.is_alive():
            worker.kill()


# ----------------------------------------------------------------------------- memory, one process


def test_memory_is_checked_against_what_is_available(monkeypatch, tmp_path):
    engine = Engine("tiny", dtype="float32")
    assert memory_problem(engine.model, 300, 0, 64, 1, 0, 0, 256) is None  # GiBs are available here
    monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", "64KiB")
    with pytest.raises(ValueError, match="not enough memory") as info:
        engine.prefill(IDS, chunk_tokens=64)
    assert "decode rank's KV cache" in str(info.value) and "use --dtype bfloat16" not in str(info.value)
    assert "no setting of this host fits 300 tokens (the longest prompt that fits here is about" in str(info.value)
    # Between what bf16 and float32 need: bf16 is suggested, and only because it fits.
    need = {dtype: prefill_memory_need(engine.model.config, dtype, 1, 300, 0, 64, decode_room=256, local_ranks=1,
                                       decode_here=True)["total"] for dtype in ("float32", "bfloat16")}
    monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", str(int((need["float32"] + need["bfloat16"]) / 2 / 0.9)))
    with pytest.raises(ValueError, match="not enough memory") as info:
        engine.prefill(IDS, chunk_tokens=64)
    assert "use --dtype bfloat16" in str(info.value)  # the fewest settings that fit: bf16 alone
    monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", "64KiB")
    monkeypatch.setenv("RINGCTX_MEMORY_CHECK", "0")
    assert engine.prefill(IDS, chunk_tokens=64).cache.length == 300
    monkeypatch.delenv("RINGCTX_MEMORY_CHECK")
    # The CLI: one line, non-zero exit, nothing written.
    out = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["prefill", "--model", "tiny", "--tokens", "300", "--dtype", "float32",
                                       "--json", str(out), "--save-logits", str(tmp_path / "l.st")])
    assert result.exit_code == 1 and "not enough memory" in result.output and "Traceback" not in result.output
    assert not out.exists() and not (tmp_path / "l.st").exists()
    monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", "lots")
    with pytest.raises(ValueError, match="RINGCTX_MEMORY_LIMIT='lots': not a size"):
        engine.prefill(IDS)


def _settings_in(message: str) -> dict:
    """The settings a memory refusal suggests, as memory_problem arguments."""
    import re

    if "no setting of this host" in message:  # the settings of the longest prompt that fits
        fix = message.split(", with ")[1].split(")")[0] if ", with " in message else ""
    else:
        fix = message.split("; use ")[-1]
    return dict(re.findall(r"--(dtype|kv-dtype|chunk-tokens|nproc) (\S+)", fix))


def test_the_memory_check_counts_what_a_dropping_prefill_holds():
    """A windowed model's prefill that drops unseen rows holds about its window per layer: the check
    asks for the planner's figure (prefill_kv_bytes_per_rank), much less than every row."""
    from ringctx.model.presets import get_preset
    from ringctx.planning.memory import prefill_kv_bytes_per_rank

    cfg = get_preset("tiny-llama4")  # 3 of 4 layers chunked (8,192): their rows stop growing
    args = dict(decode_room=256, local_ranks=2, decode_here=True, decode_ranks=1, kv_dtype="model")
    keep = prefill_memory_need(cfg, "bfloat16", 2, 131072, 0, 4096, **args)
    drop = prefill_memory_need(cfg, "bfloat16", 2, 131072, 0, 4096, drop_unseen=True, **args)
    assert drop["shard"] == prefill_kv_bytes_per_rank(cfg, 0, [4096] * 32, 2, 1, "bfloat16", drop_unseen=True)
    assert keep["shard"] == prefill_kv_bytes_per_rank(cfg, 0, [4096] * 32, 2, 1, "bfloat16")
    assert drop["shard"] < 0.4 * keep["shard"] and drop["decode_cache"] < 0.4 * keep["decode_cache"]



@pytest.mark.parametrize("cores", [1, 4])
def test_memory_refusals_suggest_only_settings_that_fit(monkeypatch, cores):
    # cores: more local ranks are among the settings tried only where the cores could run them
    """Over limits from far too small to nearly enough: whatever a refusal suggests (one setting,
    several together, more local ranks) fits when applied, by the same check; when nothing on
    this host fits it says so, and the longest prompt it names fits while a little more does not."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    models = {dtype: Engine("tiny", dtype=dtype).model for dtype in ("float32", "bfloat16")}
    tokens, chunk = 3000, 1024
    kinds = set()
    for limit_kib in (1, 100, 400, 1000, 1500, 1700, 1800, 2000, 2500, 3000, 4000, 6000):
        monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", f"{limit_kib}KiB")
        message = memory_problem(models["float32"], tokens, 0, chunk, 1, 0, 0, 256)
        if message is None:
            continue
        settings = _settings_in(message)
        n = int(settings.get("nproc", 1))
        assert n <= cores
        args = dict(local_ranks=n, local_decode=True, decode_ranks=n, kv_dtype=settings.get("kv-dtype", "model"))
        model = models[settings.get("dtype", "float32")]
        n_chunk = int(settings.get("chunk-tokens", chunk))
        if "no setting of this host fits 3,000 tokens" in message:
            kinds.add("none " + " ".join(sorted(settings)))
            if "not even a short prompt" in message:
                continue
            longest = int(message.split("about ")[-1].split(" tokens")[0].replace(",", ""))
            assert 0 < longest < tokens
            assert memory_problem(model, longest, 0, n_chunk, n, 0, 0, 256, **args) is None
            assert memory_problem(model, longest + 20, 0, n_chunk, n, 0, 0, 256, **args) is not None
        else:
            kinds.add(" ".join(sorted(settings)))
            assert memory_problem(model, tokens, 0, n_chunk, n, 0, 0, 256, **args) is None, (message, settings)
    assert any(kind.startswith("none") for kind in kinds) and len(kinds) >= 4, kinds  # the limits cover refusals of several kinds


def test_more_ranks_on_this_cpu_are_suggested_where_they_fit(monkeypatch):
    """One rank keeps its KV shard and the whole decode cache: 2 local ranks that split both fit
    where 1 does not (the 1M-token SmolLM2 case of a 24 GiB laptop), checked like the others."""
    from ringctx import load_model

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("RINGCTX_MEMORY_LIMIT", "22GiB")
    model = load_model("smollm2-135m", dtype=torch.bfloat16)
    message = memory_problem(model, 1_000_000, 0, 4096, 1, 0, 0, 256)
    assert message and message.endswith("; use --kv-dtype fp8 --nproc 2"), message
    assert memory_problem(model, 1_000_000, 0, 4096, 2, 0, 0, 256, local_ranks=2, local_decode=True, decode_ranks=2,
                          kv_dtype="fp8") is None


# ----------------------------------------------------------------------------- ranks that do not match


def _startup_job(rank, world, overrides):
    """In a RankPool rank: build an Engine as under torchrun (WORLD_SIZE set, group given); a
    "version" override stands in for another install of ringctx (ringctx/version.py's number)."""
    from ringctx import version as installed

    kwargs = dict(overrides.get(rank, {}))
    version = kwargs.pop("version", None)
    saved = installed.__version__, os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    if version:
        installed.__version__ = version
    try:
        engine = Engine(kwargs.pop("model", "tiny"), dtype=kwargs.pop("dtype", "float32"), timeout_s=60)
    except ValueError as exc:
        return str(exc)
    else:
        engine.close()
        return "started"
    finally:
        installed.__version__ = saved[0]
        if saved[1] is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved[1]


def _spmd_input_job(rank, world):
    """Bad or different input on one rank: every rank raises the same error; the engine survives."""
    os.environ["WORLD_SIZE"] = str(world)
    try:
        engine = Engine("tiny", dtype="float32", timeout_s=60)
        errors = []
        for ids in ([1, 2, 999] if rank == 1 else [1, 2, 3], [1, 2, 3 + rank]):
            try:
                engine.prefill(ids)
            except ValueError as exc:
                errors.append(str(exc))
        logits = engine.prefill(IDS[:50]).logits
        engine.close()
        return errors, logits
    finally:
        os.environ.pop("WORLD_SIZE", None)


@pytest.mark.parametrize("overrides,expected", [
    ({1: {"dtype": "bfloat16"}}, "dtype=bfloat16 on rank 1 but dtype=float32 on rank 0"),
    ({1: {"model": "smollm2-135m"}}, "model=smollm2-135m on rank 1 but model=tiny on rank 0"),
    ({1: {"version": "9.9.9"}}, "ringctx=9.9.9 on rank 1 but ringctx=0.1.0 on rank 0"),
], ids=["dtype", "model", "version"])
def test_ranks_with_another_model_dtype_or_version_are_refused_at_start_up(rank_pool, overrides, expected):
    import ringctx

    messages = rank_pool(2).run(_startup_job, overrides)
    assert messages[0] == messages[1]  # every rank refuses, with the same words
    assert messages[0].startswith("engine start-up: rank 1 does not match rank 0: "), messages[0]
    assert expected.replace("0.1.0", ringctx.__version__) in messages[0]
    assert "same model (--model), dtype (--dtype) and ringctx version" in messages[0]


def test_bad_or_different_input_on_one_rank_is_one_error_on_every_rank(rank_pool):
    results = rank_pool(2).run(_spmd_input_job)
    (errors0, logits0), (errors1, logits1) = results
    assert errors0 == errors1 and len(errors0) == 2
    assert "invalid input on rank 1: token id 999 is outside the vocabulary [0, 256)" in errors0[0]
    assert "ranks disagree" in errors0[1]
    reference = Engine("tiny", dtype="float32").prefill(IDS[:50]).logits
    torch.testing.assert_close(logits0, reference, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits1, reference, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- launches that never form


def test_a_rendezvous_that_never_completes_ends_with_a_clear_error(tmp_path):
    """One host of two starts: as host 0 of a c10d (--rdzv-endpoint) or static (--hosts) rendezvous,
    it gives up after --rdzv-timeout; as host 1, it gives up on a host 0 that never listens."""
    command = ["--rdzv-timeout", "4", "--", "prefill", "--model", "tiny", "--tokens", "100"]
    launches = {
        "did not complete within 4 s: not every host joined":
            [LAUNCH, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "2", *command],
        "failed (DistStoreError: Timed out":
            [LAUNCH, "--hosts", "127.0.0.1,127.0.0.2", "--port", str(free_port()), *command],
        "cannot reach the rendezvous at 127.0.0.1:":
            [LAUNCH, "--hosts", "127.0.0.1,127.0.0.2", "--node-rank", "1", "--port", str(free_port()), *command],
    }
    procs = {expected: start(argv, cwd=tmp_path) for expected, argv in launches.items()}  # all at once
    for expected, proc in procs.items():
        rc, err = finish(proc, 90)
        assert rc == 3, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("launch_multihost: error:")]
        assert len(lines) == 1 and expected in lines[0], err[-3000:]
        assert "check that TCP port" in lines[0] and "Traceback" not in err
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- Ctrl-C


def _interrupt_after_start(argv, marker: str, tmp_path) -> tuple[int, str, int]:
    proc = start(argv, cwd=tmp_path)
    seen = ""
    deadline = time.monotonic() + 120
    while marker not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.readline()
    assert marker in seen, seen[-3000:]
    time.sleep(1.0)  # in the middle of the prefill
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    rc, rest = finish(proc, 60)
    return rc, seen + rest, proc.pid


def test_ctrl_c_ends_every_spawned_rank_cleanly(tmp_path):
    argv = [sys.executable, "-m", "ringctx", "prefill", "--model", "tiny", "--nproc", "2", "--tokens", "400000",
            "--chunk-tokens", "4096", "--dtype", "float32", "--json", "out.json"]
    rc, err, pgid = _interrupt_after_start(argv, "prefill of 400,000 synthetic tokens", tmp_path)
    assert rc == 130, err[-3000:]
    assert "ringctx: interrupted; all local ranks stopped" in err and "Traceback" not in err, err[-3000:]
    assert group_is_gone(pgid), "a rank outlived Ctrl-C"
    assert not (tmp_path / "out.json").exists()


def test_ctrl_c_ends_every_torchrun_rank(tmp_path):
    argv = [LAUNCH, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "1", "--nproc-per-host", "2", "--",
            "prefill", "--model", "tiny", "--tokens", "400000", "--chunk-tokens", "4096", "--dtype", "float32"]
    rc, err, pgid = _interrupt_after_start(argv, "prefill of 400,000 synthetic tokens", tmp_path)
    assert rc != 0, err[-3000:]
    assert "interrupted" in err, err[-3000:]
    assert group_is_gone(pgid), "a rank outlived Ctrl-C"


# ----------------------------------------------------------------------------- bad input: spawn mode, torchrun


@pytest.mark.parametrize("args,message", [
    (["prefill", "--nproc", "2", "--model", "llama9-1t"], "neither a model preset"),
    (["prefill", "--nproc", "2", "--model", "tiny", "--dtype", "float13"], "unknown dtype 'float13'"),
    (["prefill", "--nproc", "2", "--model", "tiny", "--hardware", "BAD"], "BAD"),
    (["prefill", "--nproc", "2", "--model", "tiny", "--timeout", "0"], "timeout_s must be > 0"),
    (["ingest", "EMPTY", "--nproc", "2", "--save", "OUT"], "is empty"),
    (["ingest", "BINARY", "--nproc", "2", "--save", "OUT"], "not UTF-8"),
], ids=["model", "dtype", "hardware", "timeout", "empty-doc", "binary-doc"])
def test_bad_input_in_spawn_mode_fails_before_any_rank_starts(tmp_path, args, message):
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text('{"name": "x", "memory_bytes": "lots"')  # malformed JSON
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81")
    names = {"BAD": str(bad_profile), "EMPTY": str(tmp_path / "empty.txt"), "BINARY": str(tmp_path / "binary.txt"),
             "OUT": str(tmp_path / "out.kv")}
    args = [names.get(a, a) for a in args]
    before = set(multiprocessing.active_children())  # the session's rank pools
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0, result.output
    assert message.replace("BAD", str(bad_profile)) in result.output or message in result.output, result.output
    assert "Traceback" not in result.output
    assert set(multiprocessing.active_children()) <= before  # no rank was started
    assert not (tmp_path / "out.kv").exists()


def test_bad_input_under_torchrun_is_one_line_and_a_nonzero_exit(tmp_path):
    argv = [LAUNCH, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "1", "--nproc-per-host", "2", "--",
            "prefill", "--model", "tiny", "--tokens", "1", "--json", "out.json"]
    rc, err = finish(start(argv, cwd=tmp_path), 120)
    assert rc == 1, err[-3000:]  # the launcher's status: a rank failed
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "2 ranks for 1 tokens" in errors[0], err[-3000:]  # local rank 0 only
    assert "Traceback" not in err and "launch_multihost: error: rank 0 " in err, err[-3000:]
    assert not (tmp_path / "out.json").exists()


def test_kv_files_from_another_model_or_truncated_are_refused_by_ask(tmp_path):
    from ringctx.model import load_model
    from ringctx.model.kvfile import save_kv_cache

    engine = Engine("tiny", dtype="float32")
    result = engine.prefill(IDS[:40])
    other_model = load_model("tiny", dtype="float32", seed=1)  # same shapes, other weights
    path = tmp_path / "other.kv"
    save_kv_cache(path, result.cache, other_model, result.token_ids)
    truncated = tmp_path / "truncated.kv"
    truncated.write_bytes(path.read_bytes()[:300])
    runner = CliRunner()
    other = runner.invoke(main, ["ask", str(path), "Who?", "--model", "tiny"])
    assert other.exit_code == 1 and "was made with model 'tiny'" in other.output, other.output
    cut = runner.invoke(main, ["ask", str(truncated), "Who?", "--model", "tiny"])
    assert cut.exit_code == 1 and "truncated or corrupt" in cut.output, cut.output
    for r in (other, cut):
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
