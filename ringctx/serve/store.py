"""The server's document store: one record and one KV directory per document, in --store DIR.

    DIR/doc-<24 hex>.json     the record: name, status, tokens, the ingest's chunks, the error
    DIR/doc-<24 hex>.kv/      the KV cache, as Engine.save_document writes it (one slice per decode
                              rank, checksummed, renamed into place only when complete)
    DIR/doc-<24 hex>.ingest/  while the document is ingesting (and until its KV cache is saved): the
                              ingest's checkpoint, every rank's rows of each chunk as it completed
                              (runtime/checkpoint.py)

Ids are made here, never taken from a client, and are the only names the server puts in a path.
Records are written atomically (a temporary file, fsync, rename). A record still "ingesting"
when the store is opened belongs to a server that stopped in the middle of the ingest: with its
checkpoint it stays "ingesting" and the server resumes it (`resumable`); without one (the server
stopped before the first chunk's files) it is marked failed. A half-written KV directory
(`.partial`) is removed, so that nothing partial is ever loaded. JSON only: no pickle on disk.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

from ..files import write_json_atomically
from ..runtime.checkpoint import HEADER as CHECKPOINT_HEADER, SUFFIX as CHECKPOINT_SUFFIX, TOKENS as CHECKPOINT_TOKENS
from .backend import DocumentInfo

ID_PATTERN = re.compile(r"^doc-[0-9a-f]{24}$")
RECORD_FORMAT = "ringctx-serve-document/1"


def new_document_id() -> str:
    return f"doc-{secrets.token_hex(12)}"


STORED_FIELDS = ("id", "name", "created", "status", "tokens", "chunks_total", "chunk_strategies", "chunk_seconds",
                 "chunk_tokens", "seconds", "error", "kv_dtype", "bytes_on_disk", "text_chars", "text_sha256")
"""The fields of a DocumentInfo a record file holds, in the file's order (the rest are live numbers).
A record written before `chunk_tokens` existed has none: its rate is unknown."""


class DocumentStore:
    """Records and KV directories of the server's documents in one directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def kv_path(self, doc_id: str) -> Path:
        return self.root / f"{_checked(doc_id)}.kv"

    def checkpoint_path(self, doc_id: str) -> Path:
        return self.root / f"{_checked(doc_id)}{CHECKPOINT_SUFFIX}"

    def resumable(self, doc_id: str) -> tuple | None:
        """(token ids, the ingest's extra: the chat frame) of an ingest whose checkpoint can resume
        it, or None (read once, by the documents at start-up; `open` only sees that its files are there)."""
        from safetensors.torch import load_file

        path = self.checkpoint_path(doc_id)
        try:
            header = json.loads((path / CHECKPOINT_HEADER).read_text())
            token_ids = load_file(str(path / CHECKPOINT_TOKENS))["token_ids"].long()
        except Exception:  # noqa: BLE001 - a checkpoint that cannot be read resumes nothing
            return None
        if token_ids.numel() != header.get("tokens"):
            return None
        return token_ids, dict(header.get("extra") or {})

    def remove_checkpoint(self, doc_id: str) -> None:
        shutil.rmtree(self.checkpoint_path(doc_id), ignore_errors=True)

    def _record_path(self, doc_id: str) -> Path:
        return self.root / f"{_checked(doc_id)}.json"

    def open(self) -> list[DocumentInfo]:
        """Every record, oldest first, after settling what a stopped server left behind."""
        for partial in self.root.glob("doc-*.kv.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        records = []
        for path in sorted(self.root.glob("doc-*.json")):
            try:
                record = _read_record(path)
            except (OSError, ValueError, TypeError) as exc:
                record = DocumentInfo(id=path.stem, name="", created=int(path.stat().st_mtime), status="failed",
                                        error=f"its record could not be read ({exc})")
                if not ID_PATTERN.match(record.id):
                    continue
            if record.status == "ingesting" and not all((self.checkpoint_path(record.id) / name).is_file()
                                                        for name in (CHECKPOINT_HEADER, CHECKPOINT_TOKENS)):
                record.status, record.error = "failed", ("the server stopped during the ingest, before its first "
                                                         "chunk was kept; add the document again")
                self.write(record)
                self.remove_checkpoint(record.id)
            elif record.status == "ready" and not self.kv_path(record.id).is_dir():
                record.status, record.error = "failed", "its KV cache is missing from the store"
                self.write(record)
            records.append(record)
        return sorted(records, key=lambda r: (r.created, r.id))

    def write(self, record: DocumentInfo) -> None:
        """Write the record atomically."""
        write_json_atomically(self._record_path(record.id),
                              {"format": RECORD_FORMAT, **{name: getattr(record, name) for name in STORED_FIELDS}},
                              indent=1)

    def delete(self, doc_id: str) -> None:
        """Remove the document's record and KV directory (the record last: a crash leaves it failed)."""
        shutil.rmtree(self.kv_path(doc_id), ignore_errors=True)
        shutil.rmtree(self.root / f"{_checked(doc_id)}.kv.partial", ignore_errors=True)
        self.remove_checkpoint(doc_id)
        try:
            self._record_path(doc_id).unlink()
        except FileNotFoundError:
            pass

    def kv_bytes(self, doc_id: str) -> int:
        path = self.kv_path(doc_id)
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _checked(doc_id: str) -> str:
    if not ID_PATTERN.match(doc_id):
        raise ValueError(f"not a document id: {doc_id!r}")
    return doc_id


def _read_record(path: Path) -> DocumentInfo:
    data = json.loads(path.read_text())
    if data.pop("format", None) != RECORD_FORMAT:
        raise ValueError(f"not a {RECORD_FORMAT} record")
    record = DocumentInfo(**{k: v for k, v in data.items() if k in STORED_FIELDS})
    if record.id != path.stem or not ID_PATTERN.match(record.id):
        raise ValueError("its id does not match its file name")
    return record


def now() -> int:
    return int(time.time())
