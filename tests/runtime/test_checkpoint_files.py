"""An ingest checkpoint's files (runtime/checkpoint.py): the journal keeps only whole records, a
resume cuts what one rank wrote past the others, a record that fails its checksum is one line,
and a full disk (injected, and a real tmpfs where this machine lets the tests mount one) stops the
checkpoint with one line while the ingest goes on, keeping what was complete. The store of
`ringctx serve` keeps an ingesting document whose checkpoint can resume it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from ringctx.engine import Engine
from ringctx.runtime.checkpoint import (TEST_DISK_FULL_ENV, ChunkWriter, chunk_records, decide_resume, read_journal,
                                        read_record)
from tests.helpers import random_prompt

DOCUMENT = random_prompt(200, seed=9).tolist()


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", dtype="float32", chunk_tokens=32) as engine:
        yield engine


def ingest(engine, checkpoint, **kwargs):
    job = engine.start_ingest(DOCUMENT, checkpoint=checkpoint, **kwargs)
    while not job.done:
        job.step()
    return job.resume, job.finish()


def stopped(engine, checkpoint, chunks):
    job = engine.start_ingest(DOCUMENT, checkpoint=checkpoint)
    for _ in range(chunks):
        job.step()
    job.cancel()


def journal(checkpoint):
    return os.path.join(checkpoint, "run-000", "rank-00000-tp-000.jsonl")


def test_a_torn_journal_line_or_blob_is_not_a_record_and_a_resume_cuts_it_off(engine, tmp_path):
    checkpoint = str(tmp_path / "doc.ingest")
    _, whole = ingest(engine, str(tmp_path / "whole.ingest"))
    stopped(engine, checkpoint, 4)
    records = read_journal(journal(checkpoint))
    assert [r["chunk"] for r in chunk_records(records)] == [0, 1, 2, 3]
    data = os.path.join(checkpoint, "run-000", "rank-00000-tp-000.kv")
    end = records[-1]["offset"] + records[-1]["bytes"]
    assert os.path.getsize(data) == end
    # a crash while writing chunk 4: half its blob, and half its journal line
    with open(data, "ab") as f:
        f.write(b"\x00" * 1000)
    with open(journal(checkpoint), "ab") as f:
        f.write(json.dumps({**records[-1], "chunk": 4})[:40].encode())
    assert len(read_journal(journal(checkpoint))) == 4
    plan, result = ingest(engine, checkpoint, keep_checkpoint=True)
    assert (plan.mode, plan.chunks) == ("exact", 4)
    assert torch.equal(result.logits, whole.logits)
    records = read_journal(journal(checkpoint))
    assert [r["chunk"] for r in records] == list(range(7))  # the torn bytes were cut, then chunks 4..6 appended
    assert records[4]["offset"] == end


def test_a_record_that_fails_its_checksum_is_one_line(engine, tmp_path):
    checkpoint = str(tmp_path / "doc.ingest")
    stopped(engine, checkpoint, 3)
    record = read_journal(journal(checkpoint))[1]
    data = os.path.join(checkpoint, "run-000", "rank-00000-tp-000.kv")
    with open(data, "r+b") as f:
        f.seek(record["offset"] + record["bytes"] - 10)
        f.write(b"\xff\xff")
    with pytest.raises(ValueError, match=r"the record of chunk 1 fails its checksum.*start over with --restart"):
        engine.start_ingest(DOCUMENT, checkpoint=checkpoint)
    with pytest.raises(ValueError, match="fails its checksum"):
        read_record(os.path.join(checkpoint, "run-000"), "rank-00000-tp-000", record)
    plan, _ = ingest(engine, checkpoint, restart=True)
    assert plan.mode == "fresh"


def test_a_full_disk_stops_the_checkpoint_with_one_line_and_the_ingest_goes_on(engine, tmp_path, monkeypatch, capfd):
    checkpoint = str(tmp_path / "doc.ingest")
    _, whole = ingest(engine, str(tmp_path / "whole.ingest"))
    monkeypatch.setenv(TEST_DISK_FULL_ENV, "0:chunk3")
    _, result = ingest(engine, checkpoint, keep_checkpoint=True)
    monkeypatch.delenv(TEST_DISK_FULL_ENV)
    assert torch.equal(result.logits, whole.logits)
    err = capfd.readouterr().err
    assert "checkpoint stopped on rank 0: writing chunk 3 failed ([Errno 28] No space left on device)" in err
    assert [r["chunk"] for r in read_journal(journal(checkpoint))] == [0, 1, 2]  # what was complete stays
    plan, again = ingest(engine, checkpoint)
    assert (plan.mode, plan.chunks) == ("exact", 3)
    assert torch.equal(again.logits, whole.logits)


def test_a_real_full_disk(engine, tmp_path, capfd):
    """A tmpfs with room for the checkpoint's first chunks (root only: mount)."""
    _, whole = ingest(engine, str(tmp_path / "probe.ingest"), keep_checkpoint=True)
    records = read_journal(journal(str(tmp_path / "probe.ingest")))
    disk = tmp_path / "disk"
    disk.mkdir()
    size = 64 * 1024 + int(2.5 * records[0]["bytes"])
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        checkpoint = str(disk / "doc.ingest")
        _, result = ingest(engine, checkpoint, keep_checkpoint=True)
        assert torch.equal(result.logits, whole.logits)
        assert "No space left on device" in capfd.readouterr().err
        done = chunk_records(read_journal(journal(checkpoint)))
        assert 1 <= len(done) < len(records)
        plan, again = ingest(engine, checkpoint)
        assert (plan.mode, plan.chunks) == ("exact", len(done)) and torch.equal(again.logits, whole.logits)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)  # lazily: a file a failure left open


def test_the_leader_decides_from_the_files_alone(engine, tmp_path):
    from ringctx.runtime.checkpoint import ingest_header, run_settings

    checkpoint = str(tmp_path / "doc.ingest")
    stopped(engine, checkpoint, 2)
    ids = torch.tensor(DOCUMENT)
    header = ingest_header(engine.model, ids, "model", False, {"question_suffix": "", "chat": False})
    config = engine.state.prefill_config()
    settings = run_settings(engine.model, config, 1)
    plan, problem = decide_resume(checkpoint, header, settings, restart=False)
    assert problem is None and (plan.mode, plan.chunks, plan.done_tokens) == ("exact", 2, 64)
    plan, problem = decide_resume(checkpoint, header, {**settings, "chunk_tokens": 50}, restart=False)
    assert problem is None and (plan.mode, plan.done_tokens, plan.run[-7:]) == ("reslice", 64, "run-001")
    plan, problem = decide_resume(checkpoint, {**header, "kv_dtype": "int8"}, settings, restart=False)
    assert "made with KV dtype 'model', this ingest has 'int8'" in problem
    assert decide_resume(checkpoint, header, settings, restart=True)[0].mode == "fresh"
    assert decide_resume(str(tmp_path / "none"), header, settings, restart=False)[0].mode == "fresh"


def test_a_writer_that_cannot_open_its_files_stops_alone(tmp_path, capfd):
    writer = ChunkWriter(str(tmp_path / "missing-run"), "rank-00000-tp-000", 0, keep=[])
    writer.append({"kind": "chunk", "chunk": 0, "rows": 1}, {"positions": torch.zeros(1, dtype=torch.long)})
    assert "could not open its files" in writer.close() and "checkpoint stopped" in capfd.readouterr().err


def test_the_store_keeps_a_resumable_ingest_and_fails_one_without_a_checkpoint(engine, tmp_path):
    from ringctx.serve.backend import DocumentInfo
    from ringctx.serve.store import DocumentStore, new_document_id

    store = DocumentStore(tmp_path)
    with_checkpoint, without = (DocumentInfo(id=new_document_id(), name=n, created=1, status="ingesting", tokens=200)
                                for n in ("a", "b"))
    for record in (with_checkpoint, without):
        store.write(record)
    stopped(engine, str(store.checkpoint_path(with_checkpoint.id)), 2)
    listed = {r.id: r for r in DocumentStore(tmp_path).open()}
    assert listed[with_checkpoint.id].status == "ingesting"
    assert listed[without.id].status == "failed" and "before its first chunk" in listed[without.id].error
    token_ids, extra = store.resumable(with_checkpoint.id)
    assert token_ids.tolist() == DOCUMENT and extra == {"question_suffix": "", "chat": False}
    store.delete(with_checkpoint.id)
    assert not store.checkpoint_path(with_checkpoint.id).exists()
