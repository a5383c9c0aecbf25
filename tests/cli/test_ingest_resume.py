"""`ringctx ingest --save X` killed for real, rerun, resumed: ranks SIGKILLed at a chunk's end,
inside a record's write and between a record and its journal line, a full disk on one rank; each
rerun says in one line where it resumes, and the document it saves is bit for bit the one an
ingest that never stopped saves. Under torchrun, a job relaunched by --max-restarts resumes the
same way (run again). A checkpoint made with another dtype is one line; --restart starts over.

The embedded SmolLM2 on two spawned ranks, float32, pass-KV forced (the per-chunk rule would
otherwise decide by the hardware each start measures: the same bits need the same strategies; a
resume on the same ranks uses the stopped run's profile, tested in tests/engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORDS = "the river keeps its old stones while lanterns drift past quiet harbours at dawn".split()
TEXT = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(560))
SETTINGS = ["--chunk-tokens", "64", "--dtype", "float32", "--strategy", "pass-kv"]


def run(save: Path, *extra, env=None, nproc=2) -> subprocess.CompletedProcess:
    doc = save.parent / "doc.txt"
    doc.write_text(TEXT)
    cmd = [sys.executable, "-m", "ringctx", "ingest", str(doc), "--save", str(save), "--nproc", str(nproc),
           *SETTINGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def tensors(save: Path) -> dict:
    return {(f.name, name): t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for f in sorted(save.glob("slice-*.safetensors")) for name, t in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[dict, int]:
    """The document an ingest that never stopped saves (its tensors), and its chunk count."""
    save = tmp_path_factory.mktemp("whole") / "whole.kv"
    done = run(save)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not save.with_name("whole.kv.ingest").exists()  # it went once the document was saved
    return tensors(save), len([line for line in done.stdout.splitlines() if "pass-kv" in line and "Eq" not in line])


def test_killed_ingests_resume_to_the_same_document(tmp_path, whole):
    whole, chunks = whole
    save = tmp_path / "doc.kv"
    checkpoint = tmp_path / "doc.kv.ingest"

    # rank 1 dies halfway through writing chunk 2's rows: chunks 0 and 1 are kept
    first = run(save, env={"RINGCTX_TEST_KILL": "1:write-chunk2"})
    assert first.returncode != 0 and "rank 1 of 2 was killed by SIGKILL" in first.stderr, first.stderr[-3000:]
    assert checkpoint.is_dir() and not save.exists()
    # rank 0 dies after chunk 4's rows are on disk but before its journal line
    second = run(save, env={"RINGCTX_TEST_KILL": "0:journal-chunk4"})
    assert second.returncode != 0
    assert "resuming the ingest from its checkpoint: 128 of" in second.stderr and "(2 chunks)" in second.stderr, \
        second.stderr[-3000:]
    # rank 1's disk fills at chunk 5 (its checkpoint stops there; the ingest goes on), then rank 0 dies after chunk 7
    third = run(save, env={"RINGCTX_TEST_DISK_FULL": "1:chunk5", "RINGCTX_TEST_KILL": "0:chunk7"})
    assert third.returncode != 0 and "(4 chunks)" in third.stderr, third.stderr[-3000:]
    assert "checkpoint stopped on rank 1: writing chunk 5 failed ([Errno 28] No space left on device)" in third.stderr
    # a rerun with another dtype is one line, and keeps the checkpoint
    other = run(save, "--dtype", "bfloat16")
    assert other.returncode != 0 and "made with dtype 'float32', this ingest has 'bfloat16'" in other.stderr, \
        other.stderr[-3000:]
    assert "start over with --restart" in other.stderr and checkpoint.is_dir()
    last = run(save)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "(5 chunks)" in last.stderr, last.stderr[-3000:]  # chunk 5 on rank 1 never reached its disk
    assert not checkpoint.exists() and tensors(save) == whole
    assert chunks >= 8

    # --restart: the checkpoint of a stopped ingest is discarded
    run(save, env={"RINGCTX_TEST_KILL": "1:chunk3"})
    fresh = run(save, "--restart")
    assert fresh.returncode == 0 and "resuming" not in fresh.stderr, fresh.stderr[-3000:]
    assert tensors(save) == whole



def test_a_torchrun_job_run_again_resumes(tmp_path, whole):
    """Rank 1 of a torchrun job dies; the job launched again resumes from the checkpoint and saves
    the document an ingest that never stopped saves (on spawned ranks). (Relaunched by torchrun's
    --max-restarts the job runs the same code; but torchrun's own relaunch of a gloo job fails its
    re-rendezvous on this torch about half the time, a plain 10-line torch script included, so the
    test relaunches it itself.)"""
    (tmp_path / "doc.txt").write_text(TEXT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ringctx",
           "ingest", str(tmp_path / "doc.txt"), "--save", str(tmp_path / "torchrun.kv"), *SETTINGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, "RINGCTX_TEST_KILL": "1:chunk3"})
    assert killed.returncode != 0 and (tmp_path / "torchrun.kv.ingest").is_dir(), killed.stderr[-3000:]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming the ingest from its checkpoint" in again.stderr, again.stderr[-4000:]
    assert tensors(tmp_path / "torchrun.kv") == whole[0]
