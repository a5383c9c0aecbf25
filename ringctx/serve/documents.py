"""The server's documents: records in the store, KV caches in the decode ranks' memory within a budget.

    ServedDocuments     every document by id: its record (store.py keeps it on disk), its token
                        ids (prefix reuse), an ingest's live numbers; the Engine's Document of each
                        one in memory, least recently used first, within the KV budget
    StoredDocument      a question's document as the scheduler asks for it when the question joins
                        (engine/work_items.DocumentSource): loaded back from the store if it left memory

A document's life: `add` (the record, "ingesting") -> `chunk_done` per chunk -> `ingested` (the
hand-off: it answers from memory at once, and its slices are written to the store in the
background) -> `saved` (complete on disk: the store lists it "ready"; its ingest's checkpoint
goes). A server that stops before `saved` leaves the record "ingesting" with its checkpoint: the
next server on the store resumes the ingest (`resumable_ingests`, `resumed`) from its last chunk.
When the budget is spent the least recently used documents leave memory (`make_room`) and come
back from the store when a question needs them (`resident`). Engine calls run on the scheduler's thread: those of `ingested`,
`make_room` and `resident` are made there (they are called there), `saved` and `delete` hand theirs
to the scheduler as work items.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from ..engine.scheduler import SchedulerStopped
from ..engine.work_items import DropDocument, FinishSave
from ..planning.work import WorkProgress, prefill_chunk_flops
from ..planning.memory import document_kv_bytes
from ..runtime.efficiency import document_state_bytes, kv_layer_row_bytes
from ..units import fmt_bytes
from .backend import DocumentInfo
from .store import DocumentStore

QUESTION_ROOM_TOKENS = 256
"""KV rows a document keeps free for a question and its answer (they grow past it as needed)."""

class ServedDocuments:
    """Every document of the server, and which of them the decode ranks keep in memory.

    Args:
        store: the DocumentStore (opened here: what a stopped server left behind is settled).
        engine: the Engine; used only on the scheduler's thread.
        scheduler: the Scheduler that runs the engine (saves are completed and documents dropped
            through it from other threads).
        bytes_per_token: KV bytes one token takes over all decode ranks.
        kv_budget_bytes: KV bytes the decode ranks keep in memory in all.
        log: where one-line notices go.
    """

    def __init__(self, store: DocumentStore, engine, scheduler, *, bytes_per_token: int, kv_budget_bytes: int,
                 log=None):
        self.store, self.engine, self.scheduler = store, engine, scheduler
        self.bytes_per_token, self.kv_budget_bytes = bytes_per_token, kv_budget_bytes
        self.layer_row_bytes = kv_layer_row_bytes(engine)  # a layer's own head shape counts at its width
        self.state_bytes = document_state_bytes(engine)  # a hybrid's linear-attention states, whatever the length
        self.log = log or (lambda line: None)
        self.lock = threading.Lock()  # everything below (the scheduler's thread writes too)
        self._records: dict[str, DocumentInfo] = {}
        self._in_memory: dict[str, object] = {}  # id -> the Engine's Document, least recently used first
        self._tokens: dict[str, torch.Tensor] = {}  # id -> its token ids (prefix matching, sizes)
        self._progress: dict[str, dict] = {}  # id -> the ingest's live numbers
        self._ingests: dict[str, object] = {}  # id -> PrefillTicket
        self._saving: dict[str, object] = {}  # id -> the Engine's SaveJob of a document not yet complete on disk
        self.implicit = None  # the prefix cache (engine/prefix_cache.py): its entries make room for documents
        self._resumable: dict[str, dict] = {}  # id -> an ingest a stopped server left: its tokens and frame
        for record in self.store.open():
            self._records[record.id] = record
            if record.status == "ingesting":
                found = self.store.resumable(record.id)
                if found is None:  # its checkpoint went since the store was opened
                    record.status, record.error = "failed", "its ingest's checkpoint cannot be read; add it again"
                    self.store.write(record)
                    continue
                self._tokens[record.id], self._resumable[record.id] = found
                record.chunk_strategies, record.chunk_seconds, record.chunk_tokens = [], [], []
        self._reload_tokens()

    # ------------------------------------------------------------------ reading
    def get(self, doc_id: str) -> DocumentInfo | None:
        """The record (the stored status), or None."""
        with self.lock:
            return self._records.get(doc_id)

    def tokens(self, doc_id: str) -> torch.Tensor | None:
        """A document's token ids (None when unknown)."""
        with self.lock:
            return self._tokens.get(doc_id)

    def bytes_in_memory(self) -> int:
        """KV bytes the documents in memory hold over every decode rank."""
        with self.lock:
            return sum(self.kv_bytes(self._records[d].tokens) for d in self._in_memory if d in self._records)

    def ready(self) -> list[tuple[DocumentInfo, torch.Tensor | None]]:
        """(record, token ids or None when unknown) of every ready document, in the order they came."""
        with self.lock:
            return [(r, self._tokens.get(r.id)) for r in self._records.values() if r.status == "ready"]

    def info(self, doc_id: str) -> DocumentInfo | None:
        """What the documents API shows of one document, or None."""
        with self.lock:
            record = self._records.get(doc_id)
            return None if record is None else self._info(record)

    def infos(self) -> list[DocumentInfo]:
        """What the documents API shows of every document, oldest first."""
        with self.lock:
            return [self._info(r) for r in sorted(self._records.values(), key=lambda r: (r.created, r.id))]

    def _info(self, record: DocumentInfo) -> DocumentInfo:
        """The API's view of a record (caller holds the lock)."""
        in_memory = record.id in self._in_memory
        status = record.status
        if status == "ready" and not in_memory:
            status = "on_disk"
        info = dataclasses.replace(record, status=status, chunks_done=len(record.chunk_strategies),
                                   chunk_strategies=list(record.chunk_strategies),
                                   chunk_seconds=list(record.chunk_seconds), chunk_tokens=list(record.chunk_tokens),
                                   tokens_per_s=_rate(record.chunk_tokens, record.chunk_seconds), eta_s=None,
                                   kv_bytes_per_rank=[], decode_ranks=[])
        progress = self._progress.get(record.id)
        if record.status == "ingesting" and progress is not None:
            info.seconds = round(time.monotonic() - progress["started"], 3)
            eta = progress["work"].eta_s(time.monotonic() - progress["last"])
            if eta is not None:
                info.eta_s = round(eta, 1)
        if in_memory:
            info.kv_bytes_per_rank = self.rank_bytes(record.tokens)
            info.decode_ranks = self._decode_global_ranks()
        return info

    def counts(self) -> tuple[dict[str, int], list[int]]:
        """(documents by the status the API shows, KV bytes each decode rank holds for them)."""
        with self.lock:
            by_status: dict[str, int] = {}
            for record in self._records.values():
                status = "on_disk" if record.status == "ready" and record.id not in self._in_memory else record.status
                by_status[status] = by_status.get(status, 0) + 1
            per_rank = [0] * self.engine.decode_ranks
            for doc_id in self._in_memory:
                if doc_id in self._records:
                    for r, b in enumerate(self.rank_bytes(self._records[doc_id].tokens)):
                        per_rank[r] += b
            return by_status, per_rank

    # ------------------------------------------------------------------ an ingest
    def add(self, record: DocumentInfo, token_ids: torch.Tensor, chunk_tokens: int) -> None:
        """A new document whose ingest starts now: its record is written, "ingesting"."""
        self.store.write(record)
        with self.lock:
            self._records[record.id] = record
            self._tokens[record.id] = token_ids
            started = time.monotonic()
            self._progress[record.id] = {"started": started, "last": started,
                                         "work": _ingest_progress(self.engine, record.tokens, chunk_tokens)}

    def resumable_ingests(self, chunk_tokens: int) -> list[tuple[DocumentInfo, torch.Tensor, dict]]:
        """(record, token ids, the ingest's frame) of every ingest a stopped server left, oldest
        first: the service submits them again at start-up (each resumes from its checkpoint)."""
        with self.lock:
            out = [(self._records[d], self._tokens[d], extra) for d, extra in self._resumable.items()]
            self._resumable.clear()
        for record, _, _ in out:
            started = time.monotonic()
            with self.lock:
                self._progress[record.id] = {"started": started, "last": started,
                                             "work": _ingest_progress(self.engine, record.tokens, chunk_tokens)}
        return sorted(out, key=lambda item: (item[0].created, item[0].id))

    def resumed(self, doc_id: str, job) -> None:
        """Scheduler thread: a stopped ingest restarted from its checkpoint (`job.resume`): its
        record counts the chunks it had done, its ETA the work left."""
        done = list(job.run.stats.chunks)  # the chunks restored (a resliced one restores none)
        with self.lock:
            record = self._records.get(doc_id)
            if record is None:
                return
            record.chunk_strategies = [c.strategy for c in done]
            record.chunk_seconds = [round(c.seconds, 4) for c in done]
            record.chunk_tokens = [c.tokens for c in done]
            record.chunks_total = job.total_chunks
            # the chunks of this run (a resliced one's start after the tokens done before it)
            work = WorkProgress(prefill_chunk_flops([job.run.T], job.run.config.chunk_tokens,
                                                    self.engine.model.full_config, job.run.cached_len))
            for c in done:
                work.chunk_done(c.seconds)
            self._progress[doc_id]["work"] = work
        self.log(f"ringctx serve: {doc_id}: {job.resume.describe(record.tokens)}")

    def ingest_failed(self, doc_id: str, error: BaseException, resuming: bool) -> None:
        """Scheduler thread: an ingest ended with `error` (not a stop). A fresh one is failed on disk
        and its checkpoint goes; a resumed one (its checkpoint made by another model, say) is failed
        for this server only: the record stays "ingesting" on disk with its checkpoint, which a
        server with what made it resumes."""
        with self.lock:
            record = self._records.get(doc_id)
            self._ingests.pop(doc_id, None)
            self._progress.pop(doc_id, None)
            if record is None:
                return
            record.status, record.error = "failed", str(error)
        if resuming:
            self.log(f"ringctx serve: {doc_id} does not resume: {error}")
            return
        self.store.write(record)
        self.store.remove_checkpoint(doc_id)

    def ingesting(self, doc_id: str, ticket) -> None:
        """The scheduler's PrefillTicket of the document's ingest (a delete or a stop cancels it)."""
        self._ingests[doc_id] = ticket

    def chunk_done(self, doc_id: str, stats) -> bool:
        """Scheduler thread: one chunk of an ingest has run; whether the document is still there."""
        with self.lock:
            record = self._records.get(doc_id)
            if record is None:
                return False
            record.chunk_strategies.append(stats.strategy)
            record.chunk_seconds.append(round(stats.seconds, 4))
            record.chunk_tokens.append(stats.tokens)
            record.seconds = round(time.monotonic() - self._progress[doc_id]["started"], 3)
            # wall time between chunks: decode steps the scheduler runs between them slow the rest alike
            progress, now = self._progress[doc_id], time.monotonic()
            progress["work"].chunk_done(now - progress["last"])
            progress["last"] = now
            return True

    def ingested(self, doc_id: str, result) -> None:
        """Scheduler thread: the ingest's hand-off is done. The document answers from memory at once;
        its slices are written to the store in the background (a save of a long document takes
        seconds and must not pause the answers in flight) and `saved` completes it."""
        document = result.document
        record = self._records.get(doc_id)
        if record is None:  # deleted meanwhile
            self.engine.drop_document(document)
            return
        self.make_room(self.kv_bytes(record.tokens))
        job = self.engine.start_save(document, self.store.kv_path(doc_id))
        with self.lock:
            record.status, record.seconds = "ready", round(time.monotonic() - self._progress[doc_id]["started"], 3)
            self._progress.pop(doc_id, None)
            self._ingests.pop(doc_id, None)
            self._in_memory[doc_id] = document
            self._saving[doc_id] = job

        def when_written():
            job.wait_written()
            try:
                self.saved(doc_id)
            except SchedulerStopped:
                pass

        threading.Thread(target=when_written, name=f"ringctx-save-{doc_id}", daemon=True).start()

    def saved(self, doc_id: str, timeout: float | None = None) -> None:
        """Complete a document's save (every decode rank has, or is about to have, written its
        slice: the scheduler runs the FinishSave between two steps); only now does the store list it
        as ready. SchedulerStopped or TimeoutError: the scheduler did not get to it."""
        with self.lock:
            job = self._saving.pop(doc_id, None)
        if job is None:  # completed already (a drain got there first)
            return
        try:
            self.scheduler.run(FinishSave(job), timeout)
        except ValueError as exc:  # disk full, say (or deleted meanwhile): nothing is kept half-saved
            with self.lock:
                record, document = self._records.get(doc_id), self._in_memory.pop(doc_id, None)
                if record is not None:
                    record.status, record.error = "failed", f"could not save it: {exc}"
            if document is not None:
                self.scheduler.run(DropDocument(document))
            if record is None:
                self.store.delete(doc_id)
                return
            self.store.write(record)
            self.store.remove_checkpoint(doc_id)  # failed for good: its disk space back
            self.log(f"ringctx serve: {doc_id} could not be saved: {exc}")
            return
        with self.lock:
            record = self._records.get(doc_id)
            if record is not None:
                record.bytes_on_disk = self.store.kv_bytes(doc_id)
        if record is None:  # deleted while it was being written
            self.store.delete(doc_id)
        else:
            self.store.write(record)
            self.store.remove_checkpoint(doc_id)  # the saved KV cache holds every row now

    def unsaved(self) -> list[str]:
        """Documents that answer from memory but are not complete on disk yet."""
        return list(self._saving)

    def stop_ingests(self) -> None:
        """The server stops: every ingest in flight is cancelled, never half-kept: its record stays
        "ingesting" with its checkpoint, and the next server on this store resumes it."""
        for doc_id, ticket in list(self._ingests.items()):
            ticket.cancel()
            with self.lock:
                record = self._records.get(doc_id)
            if record is not None and record.status == "ingesting":
                self.log(f"ringctx serve: {doc_id} stopped after {len(record.chunk_strategies)} of "
                         f"{record.chunks_total} chunks; it resumes when a server starts on this store")

    def delete(self, doc_id: str, drop: bool = True) -> None:
        """Forget a document: its ingest is cancelled, its KV cache dropped from memory (when `drop`:
        the engine still runs) and its files deleted."""
        ticket = self._ingests.pop(doc_id, None)
        if ticket is not None:
            ticket.cancel()
        with self.lock:
            self._records.pop(doc_id, None)
            self._tokens.pop(doc_id, None)
            self._progress.pop(doc_id, None)
            document = self._in_memory.pop(doc_id, None)
        if document is not None and drop:
            try:
                self.scheduler.run(DropDocument(document))
            except SchedulerStopped:
                pass
        self.store.delete(doc_id)

    # ------------------------------------------------------------------ memory
    def kv_bytes(self, tokens: int) -> int:
        """KV bytes a document of `tokens` tokens keeps (its windowed and chunked layers only what
        later tokens see: documents are ingested with drop_unseen), its linear-attention states included."""
        return document_kv_bytes(self.engine.model.full_config, self.layer_row_bytes, tokens, self.state_bytes)

    def rank_bytes(self, tokens: int) -> list[int]:
        """KV bytes each decode rank holds for a document of `tokens` tokens (balanced slices)."""
        n, total = self.engine.decode_ranks, self.kv_bytes(tokens)
        return [(total * (r + 1)) // n - (total * r) // n for r in range(n)]

    def _decode_global_ranks(self) -> list[int]:
        e = self.engine
        return [(e.decode_rank + i) * e.tp_size + t for i in range(e.decode_ranks) for t in range(e.tp_size)]

    def make_room(self, need: int) -> None:
        """Scheduler thread: make `need` more bytes fit: the prefix cache's entries leave memory
        first (documents come first), then the least recently used documents."""
        if self.implicit is not None:
            self.implicit.shrink(max(0, self.kv_budget_bytes - self.bytes_in_memory() - need))
        while True:
            with self.lock:
                held = sum(self.kv_bytes(self._records[d].tokens) for d in self._in_memory if d in self._records)
                victims = [d for d in self._in_memory if d not in self._saving]  # memory is its only copy yet
                if held + need <= self.kv_budget_bytes or not victims:
                    return
                victim = victims[0]
                document = self._in_memory.pop(victim)
            self.engine.drop_document(document)
            self.log(f"ringctx serve: {victim} left memory (KV budget {fmt_bytes(self.kv_budget_bytes)}); "
                     "it stays on disk")

    def resident(self, doc_id: str):
        """Scheduler thread: the Engine's Document of a ready document, loaded from the store if needed."""
        with self.lock:
            document = self._in_memory.pop(doc_id, None)
            record = self._records.get(doc_id)
            if document is not None:
                self._in_memory[doc_id] = document  # now the most recently used
                return document
        if record is None or record.status != "ready":
            raise ValueError(f"document {doc_id} is no longer available")
        self.make_room(self.kv_bytes(record.tokens))
        try:
            document = self.engine.load_document(self.store.kv_path(doc_id), decode_room=QUESTION_ROOM_TOKENS)
        except (ValueError, OSError) as exc:
            with self.lock:
                record.status, record.error = "failed", f"its saved KV cache does not load: {exc}"
            self.store.write(record)
            raise ValueError(f"document {doc_id} failed to load from the store: {exc}") from None
        with self.lock:
            if doc_id in self._records:
                self._in_memory[doc_id] = document
        return document

    def _reload_tokens(self) -> None:
        """The token ids of every saved document (for prefix reuse), read from the store's files."""
        from safetensors.torch import load_file

        for record in list(self._records.values()):
            if record.status != "ready":
                continue
            try:
                self._tokens[record.id] = load_file(str(self.store.kv_path(record.id) / "tokens.safetensors"))[
                    "token_ids"].long()
            except Exception as exc:  # noqa: BLE001 - a damaged store entry fails alone
                record.status, record.error = "failed", f"its tokens could not be read: {exc}"
                self.store.write(record)


class StoredDocument:
    """A question's document by id (engine/work_items.DocumentSource): brought into memory, if it
    left, when the question joins."""

    def __init__(self, documents: ServedDocuments, doc_id: str):
        self.documents, self.doc_id = documents, doc_id

    def document(self, engine):
        return self.documents.resident(self.doc_id)


def _ingest_progress(engine, tokens: int, chunk_tokens: int) -> WorkProgress:
    """The ETA of an ingest of `tokens` tokens: the cost model's work per chunk (chunk k attends to
    all before it), at the rate its timed chunks ran (`WorkProgress`, as the CLI's progress bar)."""
    return WorkProgress(prefill_chunk_flops([tokens], chunk_tokens, engine.model.full_config))


def _rate(chunk_tokens: list[int], chunk_seconds: list[float]) -> float | None:
    """Tokens per second of the chunks done (their own seconds, not time spent waiting behind answers)."""
    seconds = sum(chunk_seconds[:len(chunk_tokens)])
    return round(sum(chunk_tokens) / seconds, 1) if chunk_tokens and seconds > 0 else None
