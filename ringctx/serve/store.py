"""The server's document store: one record and one KV directory per document, in --store DIR.

    DIR/doc-<24 hex>.json     the record: name, status, tokens, the ingest's chunks, the error
    DIR/doc-<24 hex>.kv/      the KV cache, as Engine.save_document writes it (one slice per decode
                              rank, checksummed, renamed into place only when complete)

Ids are made here, never taken from a client, and are the only names the server puts in a path.
Records are written atomically (a temporary file, fsync, rename). A record still "ingesting"
when the store is opened belongs to a server that stopped in the middle of the ingest: it is
marked failed, and a half-written KV directory (`.partial`) is removed, so that nothing partial
is ever loaded. JSON only: no pickle on disk.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ID_PATTERN = re.compile(r"^doc-[0-9a-f]{24}$")
RECORD_FORMAT = "ringctx-serve-document/1"


def new_document_id() -> str:
    return f"doc-{secrets.token_hex(12)}"


@dataclass
class DocumentRecord:
    """What the store keeps of one document besides its KV cache."""

    id: str
    name: str
    created: int
    status: str = "ingesting"
    """"ingesting", "ready" (saved; the server says whether it is in memory) or "failed"."""
    tokens: int = 0
    chunks_total: int = 0
    chunk_strategies: list[str] = field(default_factory=list)
    chunk_seconds: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    """New tokens of each chunk done (a record written before this field has none: its rate is unknown)."""
    seconds: float = 0.0
    error: str | None = None
    kv_dtype: str = ""
    bytes_on_disk: int = 0
    text_chars: int = 0
    """Characters of the text its tokens were made from (the chat frame included)."""
    text_sha256: str = ""
    """SHA-256 of that text (UTF-8): how a prompt that resends the document is recognised."""


class DocumentStore:
    """Records and KV directories of the server's documents in one directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def kv_path(self, doc_id: str) -> Path:
        return self.root / f"{_checked(doc_id)}.kv"

    def _record_path(self, doc_id: str) -> Path:
        return self.root / f"{_checked(doc_id)}.json"

    def open(self) -> list[DocumentRecord]:
        """Every record, oldest first, after settling what a stopped server left behind."""
        for partial in self.root.glob("doc-*.kv.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        records = []
        for path in sorted(self.root.glob("doc-*.json")):
            try:
                record = _read_record(path)
            except (OSError, ValueError, TypeError) as exc:
                record = DocumentRecord(id=path.stem, name="", created=int(path.stat().st_mtime), status="failed",
                                        error=f"its record could not be read ({exc})")
                if not ID_PATTERN.match(record.id):
                    continue
            if record.status == "ingesting":
                record.status, record.error = "failed", "the server stopped during the ingest; add the document again"
                self.write(record)
            elif record.status == "ready" and not self.kv_path(record.id).is_dir():
                record.status, record.error = "failed", "its KV cache is missing from the store"
                self.write(record)
            records.append(record)
        return sorted(records, key=lambda r: (r.created, r.id))

    def write(self, record: DocumentRecord) -> None:
        """Write the record atomically."""
        data = json.dumps({"format": RECORD_FORMAT, **asdict(record)}, indent=1).encode()
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".record-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._record_path(record.id))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def delete(self, doc_id: str) -> None:
        """Remove the document's record and KV directory (the record last: a crash leaves it failed)."""
        shutil.rmtree(self.kv_path(doc_id), ignore_errors=True)
        shutil.rmtree(self.root / f"{_checked(doc_id)}.kv.partial", ignore_errors=True)
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


def _read_record(path: Path) -> DocumentRecord:
    data = json.loads(path.read_text())
    if data.pop("format", None) != RECORD_FORMAT:
        raise ValueError(f"not a {RECORD_FORMAT} record")
    known = {f for f in DocumentRecord.__dataclass_fields__}
    record = DocumentRecord(**{k: v for k, v in data.items() if k in known})
    if record.id != path.stem or not ID_PATTERN.match(record.id):
        raise ValueError("its id does not match its file name")
    return record


def now() -> int:
    return int(time.time())
