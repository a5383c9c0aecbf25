"""EngineBackend: the engine side of `ringctx serve` (the `Backend` of ringctx/serve/backend.py).

    HTTP handlers (app.py) ──▶ EngineBackend ──▶ Scheduler thread ──▶ Engine ──▶ every rank
                                 documents: records in the store, KV caches in the decode ranks'
                                 memory while they fit the KV budget (least recently used leave first)

What it adds to the Engine:
- Documents by id: an ingest is tokenized and checked at once (413 before any prefill when it
  could never fit the KV budget or the token limit), then prefilled a chunk at a time by the
  scheduler, saved in the store (atomic, checksummed), and kept in memory while it fits.
- Requests: a chat or completion on a document prefills only its own messages on top of the
  document's cached rows, exactly as Engine.ask; one without a document whose tokens begin with a
  ready document's tokens reuses that document too; any other prompt is prefilled for itself.
  Requests decode together, one step for all (the Scheduler's batch: --max-batch, within
  --max-step-tokens per step), each answer what it is alone; a cancelled one frees its rows at once.
- Limits and faults: a bounded queue (Overloaded), and a lost rank ends every request with
  RankLost and turns the backend unhealthy (the server then exits non-zero).

Every Engine call runs on the scheduler's thread; the handlers only tokenize and read records.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import torch

from ..engine import Engine
from ..runtime.document import chat_frame
from ..runtime.memory_check import available_memory
from ..engine.scheduler import Done, Scheduler, SchedulerStopped, Text
from ..planning.work import WorkProgress, prefill_chunk_flops
from ..units import fmt_bytes
from . import backend as api
from .store import DocumentRecord, DocumentStore, new_document_id, now

KV_BUDGET_SHARE = 0.5
"""Of the memory free once the model is loaded (times the planner's usable fraction), the share the
documents' KV caches may keep: the rest stays free for an ingest in flight (its shards live on
every rank until the hand-off) and for answers' rows."""

ANSWER_ROWS_SHARE = 0.25
"""KV rows the questions decoding together may hold (prompts and max_tokens), as a share of the
documents' KV budget: beyond it new questions wait in the queue (see Scheduler's max_rows)."""

QUESTION_ROOM_TOKENS = 256
"""KV rows a document keeps free for a question and its answer (they grow past it as needed)."""


def is_server_rank() -> bool:
    """Whether this process serves HTTP: rank 0 of a torchrun launch, or the only process."""
    return int(os.environ.get("RANK", "0")) == 0


class EngineBackend:
    """The Backend of `ringctx serve`, over an Engine whose ranks start once and stay up.

    Args:
        model, nproc, tp, decode_ranks, kv_dtype, dtype, weights, timeout_s: as Engine's ("auto" nproc: the
            layout that serves fastest here, see ringctx.engine.serving_nproc).
        store_dir: where documents are kept (records and KV caches); made if missing.
        kv_budget_bytes: bytes of KV cache the decode ranks keep in memory in all (None: see
            KV_BUDGET_SHARE); beyond it the least recently used documents leave memory.
        max_queue: answers that may wait for their turn; more are refused with Overloaded.
        max_document_tokens: the longest document accepted (None: what the KV budget holds).
        chunk_tokens: the chunk documents are ingested in (None: serving_chunk_tokens, short
            on CPUs so that an ingest pauses answers in flight briefly).
        max_batch: questions decoded together at most (each step runs every one of them).
        max_step_tokens: tokens one step may run: one per question decoding plus the prompt tokens
            it prefills (questions joining, an ingest's chunk); None: the Scheduler's default (one
            prefill chunk beside a full batch). It bounds the questions' prefill work between two
            tokens of an answer in flight.
        ingest_share: beside answers in flight, each step's slice of an ingest takes about this many
            decode steps (Scheduler's ingest_share): 1.0 keeps their inter-token time near 2x.
        join_share: beside answers in flight, the questions joining in one step take about this many
            decode steps, at least one question (Scheduler's join_share).
        log: where one-line notices go (layout, documents loaded), e.g. print.
    """

    def __init__(self, *, model: str = "smollm2-135m", nproc="auto", tp: int = 1, decode_ranks=None,
                 kv_dtype: str = "model", dtype="auto", weights: str = "model", store_dir: str = "ringctx-store",
                 kv_budget_bytes: int | None = None, max_queue: int = 64, timeout_s: float = 300.0,
                 max_document_tokens: int | None = None, chunk_tokens: int | None = None, max_batch: int = 16,
                 max_step_tokens: int | None = None, ingest_share: float = 1.0, join_share: float = 1.0,
                 log=None):
        from ..engine import serving_layout
        from ..planning.prefill_plan import serving_chunk_tokens

        self.log = log or (lambda line: None)
        nproc, note = serving_layout(nproc, None, tp)
        if note:
            self.log(f"ringctx serve: {note}")
        # Under torchrun every rank builds the Engine; rank 0 serves and leads, the others follow it.
        self.is_server_rank = is_server_rank()
        if self.is_server_rank:
            self.store = DocumentStore(store_dir)  # a bad path fails before any rank starts

        def build() -> Engine:
            built = Engine(model, nproc=nproc, tp=tp, decode_ranks=decode_ranks, kv_dtype=kv_dtype, dtype=dtype,
                           timeout_s=timeout_s, chunk_tokens=chunk_tokens, weights=weights)
            if self.is_server_rank and built.mode == "torchrun":
                built.lead()
            return built

        if not self.is_server_rank:
            self.engine = build()
            return
        # Rank 0's engine is built on the scheduler's thread, which runs all of its work (see Scheduler).
        self.scheduler = Scheduler(build, on_failure=self._lost, max_batch=max_batch, max_step_tokens=max_step_tokens,
                                   ingest_share=ingest_share, join_share=join_share)
        self.engine = engine = self.scheduler.engine
        # Ingests name their chunk (it travels with the prefill's start to every rank).
        self.chunk_tokens = chunk_tokens or serving_chunk_tokens(engine.model, engine.world_size)
        self.model_id = os.path.basename(str(model).rstrip("/")).removesuffix(".gguf")
        limit = engine.model.config.rope_scaling.position_limit if engine.model.config.rope_scaling else None
        self.max_context_tokens = int(limit or 2**31 - 1)
        self.max_queue = max_queue
        self.tokenizer = engine.model.tokenizer
        if self.tokenizer is None:
            self.scheduler.stop()
            engine.close()
            raise ValueError(f"model {model!r} has no tokenizer (a random-weight preset): serve a GGUF file or a "
                             "Hugging Face directory")
        self.prefix, self.suffix = chat_frame(self.tokenizer)
        self.bytes_per_token = _kv_bytes_per_token(engine)
        self.kv_budget_bytes = int(kv_budget_bytes if kv_budget_bytes is not None else _auto_kv_budget(engine))
        self.max_document_tokens = int(max_document_tokens or
                                       max(1, self.kv_budget_bytes // self.bytes_per_token - QUESTION_ROOM_TOKENS))
        self._lock = threading.Lock()  # records, memory accounting and counters (the scheduler's thread writes too)
        self._records: dict[str, DocumentRecord] = {}
        self._in_memory: dict[str, object] = {}  # id -> the Engine's Document, least recently used first
        self._tokens: dict[str, torch.Tensor] = {}  # id -> its token ids (prefix matching, sizes)
        self._progress: dict[str, dict] = {}  # id -> the ingest's live numbers
        self._ingests: dict[str, object] = {}  # id -> PrefillTicket
        self._saving: dict[str, object] = {}  # id -> the Engine's SaveJob of a document not yet complete on disk
        self._problem: str | None = None
        self._draining = False
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        self.document_chunks_prefilled = 0
        self.running = 0
        for record in self.store.open():
            self._records[record.id] = record
        answer_rows = max(1, int(self.kv_budget_bytes * ANSWER_ROWS_SHARE) // self.bytes_per_token)
        self.scheduler.max_rows = answer_rows  # nothing is submitted before this point
        self._reload_tokens()

    # ------------------------------------------------------------------ documents
    def add_document(self, text: str, name: str = "") -> api.DocumentInfo:
        self._check_serving()
        if not text.strip():
            raise api.BadRequest("the document is empty: give some text to ingest", param="text")
        rendered, suffix = self.engine.document_text(text)
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        n = len(ids)
        need = n * self.bytes_per_token
        if n > self.max_document_tokens or need > self.kv_budget_bytes:
            raise api.TooLarge(
                f"the document has {n:,} tokens ({fmt_bytes(need)} of KV cache) but this server keeps at most "
                f"{self.max_document_tokens:,} tokens ({fmt_bytes(self.kv_budget_bytes)} of KV over "
                f"{self.engine.decode_ranks} decode rank(s), --kv-budget); split it, or start the server with "
                f"more decode ranks, an 8-bit KV cache (--kv-dtype fp8) or a larger --kv-budget", param="text")
        if n + QUESTION_ROOM_TOKENS > self.max_context_tokens:
            raise api.TooLarge(f"the document has {n:,} tokens; the model runs at most {self.max_context_tokens:,}",
                               param="text")
        record = DocumentRecord(id=new_document_id(), name=name or "untitled", created=now(), tokens=n,
                                chunks_total=-(-n // self.chunk_tokens), kv_dtype=self.engine.kv_dtype,
                                text_chars=len(rendered), text_sha256=_sha256(rendered))
        self.store.write(record)
        ids_tensor = torch.tensor(ids, dtype=torch.long)
        with self._lock:
            self._records[record.id] = record
            self._tokens[record.id] = ids_tensor
            started = time.monotonic()
            self._progress[record.id] = {"started": started, "last": started,
                                         "work": _ingest_progress(self.engine, n, self.chunk_tokens)}

        def start():
            job = self.engine.start_prefill(ids_tensor, as_document=True, decode_room=QUESTION_ROOM_TOKENS,
                                            chunk_tokens=self.chunk_tokens)
            job.frame = (suffix, {"chat": True})
            return job

        try:
            self._ingests[record.id] = self.scheduler.submit_prefill(
                start, on_chunk=lambda job, stats: self._chunk_done(record.id, stats),
                on_done=lambda result: self._ingested(record.id, result))
        except SchedulerStopped as exc:
            raise api.Unavailable(str(exc)) from None
        return self.document(record.id)

    def _chunk_done(self, doc_id: str, stats) -> None:
        """Scheduler thread: one chunk of an ingest has run."""
        with self._lock:
            record = self._records.get(doc_id)
            if record is None:
                return
            record.chunk_strategies.append(stats.strategy)
            record.chunk_seconds.append(round(stats.seconds, 4))
            record.chunk_tokens.append(stats.tokens)
            record.seconds = round(time.monotonic() - self._progress[doc_id]["started"], 3)
            # wall time between chunks: decode steps the scheduler runs between them slow the rest alike
            progress, now = self._progress[doc_id], time.monotonic()
            progress["work"].chunk_done(now - progress["last"])
            progress["last"] = now
            self.prefill_tokens += stats.tokens
            self.prefill_seconds += stats.seconds
            self.document_chunks_prefilled += 1

    def _ingested(self, doc_id: str, result) -> None:
        """Scheduler thread: the ingest's hand-off is done. The document answers from memory at once;
        its slices are written to the store in the background (a save of a long document takes
        seconds and must not pause the answers in flight) and `_saved` completes it."""
        document = result.document
        record = self._records.get(doc_id)
        if record is None:  # deleted meanwhile
            self.engine.drop_document(document)
            return
        self._make_room(self._kv_bytes(record.tokens))
        job = self.engine.start_save(document, self.store.kv_path(doc_id))
        with self._lock:
            record.status, record.seconds = "ready", round(time.monotonic() - self._progress[doc_id]["started"], 3)
            self._progress.pop(doc_id, None)
            self._ingests.pop(doc_id, None)
            self._in_memory[doc_id] = document
            self._saving[doc_id] = job

        def when_written():
            job.wait_written()
            try:
                self.scheduler.call(lambda: self._saved(doc_id))
            except SchedulerStopped:
                pass

        threading.Thread(target=when_written, name=f"ringctx-save-{doc_id}", daemon=True).start()

    def _saved(self, doc_id: str) -> None:
        """Scheduler thread: complete a document's save (every decode rank has, or is about to have,
        written its slice); only now does the store list it as ready."""
        with self._lock:
            job = self._saving.pop(doc_id, None)
        if job is None:  # completed already (a drain got there first)
            return
        try:
            job.finish()
        except ValueError as exc:  # disk full, say (or deleted meanwhile): nothing is kept half-saved
            with self._lock:
                record, document = self._records.get(doc_id), self._in_memory.pop(doc_id, None)
                if record is not None:
                    record.status, record.error = "failed", f"could not save it: {exc}"
            if document is not None:
                self.engine.drop_document(document)
            if record is None:
                self.store.delete(doc_id)
                return
            self.store.write(record)
            self.log(f"ringctx serve: {doc_id} could not be saved: {exc}")
            return
        with self._lock:
            record = self._records.get(doc_id)
            if record is not None:
                record.bytes_on_disk = self.store.kv_bytes(doc_id)
        if record is None:  # deleted while it was being written
            self.store.delete(doc_id)
        else:
            self.store.write(record)

    def document(self, doc_id: str) -> api.DocumentInfo:
        with self._lock:
            record = self._records.get(doc_id)
            if record is None:
                raise api.NotFound(f"no document {doc_id!r}: list them with GET /v1/documents", param="document")
            return self._info(record)

    def documents(self) -> list[api.DocumentInfo]:
        with self._lock:
            return [self._info(r) for r in sorted(self._records.values(), key=lambda r: (r.created, r.id))]

    def delete_document(self, doc_id: str) -> api.DocumentInfo:
        info = self.document(doc_id)
        ticket = self._ingests.pop(doc_id, None)
        if ticket is not None:
            ticket.cancel()
        with self._lock:
            self._records.pop(doc_id, None)
            self._tokens.pop(doc_id, None)
            self._progress.pop(doc_id, None)
            document = self._in_memory.pop(doc_id, None)
        if document is not None and self._problem is None:
            try:
                self.scheduler.call(lambda: self.engine.drop_document(document))
            except SchedulerStopped:
                pass
        self.store.delete(doc_id)
        return info

    def _info(self, record: DocumentRecord) -> api.DocumentInfo:
        """The API's view of a record (caller holds the lock)."""
        in_memory = record.id in self._in_memory
        status = record.status
        if status == "ready" and not in_memory:
            status = "on_disk"
        info = api.DocumentInfo(id=record.id, name=record.name, status=status, created=record.created,
                                tokens=record.tokens, chunks_done=len(record.chunk_strategies),
                                chunks_total=record.chunks_total, chunk_strategies=list(record.chunk_strategies),
                                chunk_seconds=list(record.chunk_seconds), chunk_tokens=list(record.chunk_tokens),
                                seconds=record.seconds, tokens_per_s=_rate(record.chunk_tokens, record.chunk_seconds),
                                bytes_on_disk=record.bytes_on_disk, error=record.error)
        progress = self._progress.get(record.id)
        if record.status == "ingesting" and progress is not None:
            info.seconds = round(time.monotonic() - progress["started"], 3)
            eta = progress["work"].eta_s(time.monotonic() - progress["last"])
            if eta is not None:
                info.eta_s = round(eta, 1)
        if in_memory:
            info.kv_bytes_per_rank = self._rank_bytes(record.tokens)
            info.decode_ranks = self._decode_global_ranks()
        return info

    # ------------------------------------------------------------------ memory
    def _kv_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def _rank_bytes(self, tokens: int) -> list[int]:
        """KV bytes each decode rank holds for a document of `tokens` tokens (balanced slices)."""
        n = self.engine.decode_ranks
        return [((tokens * (r + 1)) // n - (tokens * r) // n) * self.bytes_per_token for r in range(n)]

    def _decode_global_ranks(self) -> list[int]:
        e = self.engine
        return [(e.decode_rank + i) * e.tp_size + t for i in range(e.decode_ranks) for t in range(e.tp_size)]

    def _make_room(self, need: int) -> None:
        """Scheduler thread: drop the least recently used documents until `need` more bytes fit."""
        while True:
            with self._lock:
                held = sum(self._kv_bytes(self._records[d].tokens) for d in self._in_memory if d in self._records)
                victims = [d for d in self._in_memory if d not in self._saving]  # memory is its only copy yet
                if held + need <= self.kv_budget_bytes or not victims:
                    return
                victim = victims[0]
                document = self._in_memory.pop(victim)
            self.engine.drop_document(document)
            self.log(f"ringctx serve: {victim} left memory (KV budget {fmt_bytes(self.kv_budget_bytes)}); it stays on disk")

    def _resident(self, doc_id: str):
        """Scheduler thread: the Engine's Document of a ready document, loaded from the store if needed."""
        with self._lock:
            document = self._in_memory.pop(doc_id, None)
            record = self._records.get(doc_id)
            if document is not None:
                self._in_memory[doc_id] = document  # now the most recently used
                return document
        if record is None or record.status != "ready":
            raise ValueError(f"document {doc_id} is no longer available")
        self._make_room(self._kv_bytes(record.tokens))
        try:
            document = self.engine.load_document(self.store.kv_path(doc_id), decode_room=QUESTION_ROOM_TOKENS)
        except (ValueError, OSError) as exc:
            with self._lock:
                record.status, record.error = "failed", f"its saved KV cache does not load: {exc}"
            self.store.write(record)
            raise ValueError(f"document {doc_id} failed to load from the store: {exc}") from None
        with self._lock:
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

    # ------------------------------------------------------------------ answers
    def generate(self, request: api.GenerateRequest) -> "_Answer":
        self._check_serving()
        s = request.sampling
        if s.max_tokens < 1:
            raise api.BadRequest("max_tokens must be at least 1", param="max_tokens")
        if not 0 < s.top_p <= 1:
            raise api.BadRequest("top_p must be in (0, 1]", param="top_p")
        if s.temperature < 0:
            raise api.BadRequest("temperature must be >= 0", param="temperature")
        doc_id, question = self._prompt(request)
        doc_tokens = self._records[doc_id].tokens if doc_id else 0
        total = doc_tokens + len(question) + s.max_tokens
        if total > self.max_context_tokens:
            raise api.BadRequest(f"{doc_tokens + len(question):,} prompt tokens and max_tokens={s.max_tokens} go past "
                                 f"the model's {self.max_context_tokens:,} tokens", param="max_tokens")
        if self.scheduler.queued_answers >= self.max_queue:
            raise api.Overloaded(f"{self.scheduler.queued_answers} requests are waiting (--max-queue "
                                 f"{self.max_queue}); try again shortly", retry_after_s=2.0)
        sampling = dict(max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                        stop=list(s.stop) or None)

        def start():
            if doc_id is not None:
                document = self._resident(doc_id)
                ids = question
            else:  # a prompt of its own: prefilled over every rank, then answered as a question on it
                document = self.engine.ingest(question[:-1].tolist(), decode_room=QUESTION_ROOM_TOKENS + s.max_tokens)
                ids = question[-1:]
                with self._lock:
                    self.prefill_tokens += len(question) - 1
                    self.prefill_seconds += document.stats.ttft_s if document.stats else 0.0
            return document, ids  # the batch's member keeps the document alive while it runs

        try:
            # the prompt's tokens count against the step's budget (a prompt of its own is ingested in its step)
            ticket = self.scheduler.submit_question(start, prompt_tokens=len(question), **sampling)
        except SchedulerStopped as exc:
            raise self._stopped_error(str(exc)) from None
        return _Answer(self, ticket, prompt_tokens=doc_tokens + len(question), cached_tokens=doc_tokens)

    def _prompt(self, request: api.GenerateRequest) -> tuple[str | None, torch.Tensor]:
        """(the document whose rows are the prefix, or None; the token ids to prefill after it)."""
        tok = self.tokenizer
        if request.document is not None:
            with self._lock:
                record = self._records.get(request.document)
            if record is None:
                raise api.NotFound(f"no document {request.document!r}: list them with GET /v1/documents",
                                   param="document")
            if record.status == "ingesting":
                raise api.BadRequest(f"document {record.id} is still being ingested "
                                     f"({len(record.chunk_strategies)} of {record.chunks_total} chunks); ask once its "
                                     f"status is ready", param="document")
            if record.status == "failed":
                raise api.BadRequest(f"document {record.id} failed: {record.error}", param="document")
            if request.messages is not None:
                text = self._continuation(list(request.messages))
            else:
                text = request.prompt or ""
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise api.BadRequest("the prompt is empty: ask something about the document", param="messages")
            return record.id, torch.tensor(ids, dtype=torch.long)
        if request.messages is not None:
            text = tok.apply_chat_template(list(request.messages), tokenize=False, add_generation_prompt=True)
        else:
            text = request.prompt or ""
        reuse = self._document_text_prefix(text)  # a resent document: its text is not tokenized again
        if reuse is not None:
            return reuse
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            raise api.BadRequest("the prompt has fewer than 2 tokens: give a longer prompt",
                                 param="messages" if request.messages is not None else "prompt")
        ids = torch.tensor(ids, dtype=torch.long)
        reuse = self._prefix_document(ids)
        return reuse if reuse is not None else (None, ids)

    def _continuation(self, messages: list[dict]) -> str:
        """What follows a document's rows for a chat request: the document opened the first user
        turn; its content, the rest of the conversation and the assistant's header come next."""
        if not messages or messages[0].get("role") != "user":
            raise api.BadRequest("a conversation about a document starts with a user message (the document "
                                 "opens that turn; put instructions in it rather than in a system message)",
                                 param="messages")
        marker = "\x00RINGCTX_DOCUMENT\x00"
        first = dict(messages[0], content=marker + str(messages[0].get("content") or ""))
        rendered = self.tokenizer.apply_chat_template([first, *messages[1:]], tokenize=False,
                                                      add_generation_prompt=True)
        return rendered.split(marker, 1)[1]

    def _document_text_prefix(self, text: str) -> tuple[str, torch.Tensor] | None:
        """(a ready document whose text begins the prompt's, the tokens of the prompt's text after
        it), for a client that resends the document, or None. The longest such document wins.

        Found by text, before the prompt is tokenized (an 8K-token document took 11 ms to tokenize
        again, most of what a resent question cost over one naming its document): the SHA-256 of the
        prompt's first characters against each document's rendered text, one pass over the prompt
        for all of them. Tokens alone would not tell: where the document ends the prompt's text goes
        on, and BPE merges across that boundary differently ("sun. \n\n" alone, "sun. \n\nWhat" in
        the prompt). So the rest of the prompt is tokenized on its own: the tokens Engine.ask puts
        after the document for that text."""
        with self._lock:
            candidates = sorted((r for r in self._records.values()
                                 if r.status == "ready" and r.text_sha256 and r.text_chars < len(text)),
                                key=lambda r: r.text_chars)
        digest, hashed, best = hashlib.sha256(), 0, None
        for record in candidates:
            digest.update(text[hashed:record.text_chars].encode("utf-8", "surrogatepass"))
            hashed = record.text_chars
            if digest.hexdigest() == record.text_sha256:
                best = record  # a longer one later wins
        if best is None:
            return None
        rest = self.tokenizer(text[best.text_chars:], add_special_tokens=False)["input_ids"]
        return (best.id, torch.tensor(rest, dtype=torch.long)) if rest else None

    def _prefix_document(self, ids: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(a ready document whose tokens begin the prompt's, the prompt's tokens after them), or None
        (a prompt sent as the document's tokens' text without its rendered frame, say). The longest
        such document wins."""
        with self._lock:
            candidates = [(self._records[d], t) for d, t in self._tokens.items()
                          if d in self._records and self._records[d].status == "ready"]
        for record, tokens in sorted(candidates, key=lambda c: -c[1].numel()):
            n = tokens.numel()
            if n < ids.numel() and torch.equal(ids[:n], tokens):
                return record.id, ids[n:]
        return None

    # ------------------------------------------------------------------ health and closing
    def stats(self) -> api.BackendStats:
        problem = self._problem or self._dead_rank()
        with self._lock:
            by_status: dict[str, int] = {}
            for record in self._records.values():
                status = "on_disk" if record.status == "ready" and record.id not in self._in_memory else record.status
                by_status[status] = by_status.get(status, 0) + 1
            per_rank = [0] * self.engine.decode_ranks
            for doc_id in self._in_memory:
                if doc_id in self._records:
                    for r, b in enumerate(self._rank_bytes(self._records[doc_id].tokens)):
                        per_rank[r] += b
            return api.BackendStats(
                healthy=problem is None, ranks=self.engine.world_size, queue_depth=self.scheduler.queued_answers,
                running=self.running, documents_by_status=by_status, kv_bytes_per_rank=per_rank,
                kv_budget_bytes=self.kv_budget_bytes, batch_size=len(self.scheduler.batched),
                max_batch=self.scheduler.max_batch, max_step_tokens=self.scheduler.max_step_tokens,
                step_tokens=self.scheduler.last_step_tokens, slice_layers=self.scheduler.last_slice_layers,
                ingest_share=self.scheduler.ingest_share, join_share=self.scheduler.join_share,
                step_joins=self.scheduler.last_step_joins, joins_held=self.scheduler.joins_held,
                answer_rows=self.scheduler.rows_reserved,
                max_answer_rows=self.scheduler.max_rows or 0, decode_steps=self.scheduler.steps,
                decoded_tokens=self.scheduler.decoded_tokens, decode_seconds=self.scheduler.decode_seconds,
                prefill_tokens=self.prefill_tokens,
                prefill_seconds=self.prefill_seconds, document_chunks_prefilled=self.document_chunks_prefilled,
                problem=problem)

    def _dead_rank(self) -> str | None:
        for rank, process in enumerate(self.engine.worker_processes, start=1):
            if not process.is_alive():
                return f"rank {rank} of {self.engine.world_size} has exited (code {process.exitcode})"
        return None

    def _lost(self, failure: BaseException) -> None:
        """Scheduler thread: the engine lost a rank."""
        self._problem = str(failure)
        self.log(f"ringctx serve: {failure}")

    def _check_serving(self) -> None:
        if self._problem is not None:
            raise api.RankLost(self._problem)
        if self._draining:
            raise api.Unavailable("the server is stopping")

    def _stopped_error(self, reason: str) -> api.BackendError:
        return api.RankLost(self._problem) if self._problem is not None else api.Unavailable(reason)

    def close(self, drain_s: float = 10.0) -> None:
        """Stop taking requests, let answers in flight finish for up to drain_s, then stop every rank."""
        self._draining = True
        deadline = time.monotonic() + drain_s
        scheduler = self.scheduler
        while time.monotonic() < deadline and (scheduler.running is not None or scheduler.answers
                                               or scheduler.questions or scheduler.batched):
            time.sleep(0.05)
        for doc_id in list(self._saving):  # a document answered from memory is completed on disk
            try:
                self.scheduler.call(lambda doc_id=doc_id: self._saved(doc_id),
                                    timeout=max(1.0, deadline - time.monotonic()))
            except (SchedulerStopped, TimeoutError) as exc:
                self.log(f"ringctx serve: {doc_id} was not saved before the stop ({exc}); add it again")
        for doc_id, ticket in list(self._ingests.items()):  # an ingest cut short is failed, never half-kept
            ticket.cancel()
            with self._lock:
                record = self._records.get(doc_id)
                if record is not None and record.status == "ingesting":
                    record.status, record.error = "failed", "the server stopped during the ingest; add it again"
                    self.store.write(record)
        self.scheduler.stop()
        self.engine.close()

    def follow(self) -> int:
        """Torchrun, every rank but 0: run rank 0's commands until it stops; the exit status (0, or 1
        when a rank was lost)."""
        import signal

        from ..engine import RankFailure

        # Rank 0 leads the stop (it drains, then tells every rank); torchrun signals every rank at once.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.engine.follow()
        except RankFailure as exc:
            print(f"ringctx serve: rank {self.engine.rank}: {exc}", flush=True)
            return 1
        return 0


class _Answer:
    """An answer as the HTTP layer sees it (backend.Answer): Pieces, then Finished."""

    def __init__(self, backend: EngineBackend, ticket, *, prompt_tokens: int, cached_tokens: int):
        self.backend, self.ticket = backend, ticket
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens

    def cancel(self) -> None:
        self.ticket.cancel()

    async def __aiter__(self):
        backend = self.backend
        with backend._lock:
            backend.running += 1
        try:
            async for event in self.ticket:
                if isinstance(event, Text):
                    yield api.Piece(event.text)
                elif isinstance(event, Done):
                    result = event.result
                    if result is None:  # cancelled
                        return
                    yield api.Finished(finish_reason="length" if result.finish_reason == "length" else "stop",
                                       prompt_tokens=self.prompt_tokens, completion_tokens=len(result.token_ids),
                                       cached_tokens=self.cached_tokens,
                                       time_to_first_token_s=result.time_to_first_token_s)
        except ValueError as exc:
            raise api.BadRequest(str(exc)) from None
        except SchedulerStopped as exc:
            raise backend._stopped_error(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a RankFailure from the engine
            from ..engine import RankFailure

            if isinstance(exc, RankFailure):
                raise api.RankLost(str(exc)) from None
            raise
        finally:
            with backend._lock:
                backend.running -= 1


def _kv_bytes_per_token(engine: Engine) -> int:
    """KV bytes one token of a document takes over all decode ranks (every KV head, every layer)."""
    from ..runtime.efficiency import kv_bytes_per_token

    return kv_bytes_per_token(engine)


def _auto_kv_budget(engine: Engine) -> int:
    """What the decode ranks may keep of documents: KV_BUDGET_SHARE of the memory free after loading."""
    from ..planning.memory import MEMORY_USABLE_FRACTION

    free, _ = available_memory(engine.model.device)
    per_device = free if engine.model.device.type == "cpu" else free * engine.decode_ranks
    return int(per_device * MEMORY_USABLE_FRACTION * KV_BUDGET_SHARE)


def _ingest_progress(engine: Engine, tokens: int, chunk_tokens: int) -> WorkProgress:
    """The ETA of an ingest of `tokens` tokens: the cost model's work per chunk (chunk k attends to
    all before it), at the rate its timed chunks ran (`WorkProgress`, as the CLI's progress bar)."""
    return WorkProgress(prefill_chunk_flops([tokens], chunk_tokens, engine.model.full_config))


def _rate(chunk_tokens: list[int], chunk_seconds: list[float]) -> float | None:
    """Tokens per second of the chunks done (their own seconds, not time spent waiting behind answers)."""
    seconds = sum(chunk_seconds[:len(chunk_tokens)])
    return round(sum(chunk_tokens) / seconds, 1) if chunk_tokens and seconds > 0 else None


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
