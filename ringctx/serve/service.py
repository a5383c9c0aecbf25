"""EngineBackend: the engine side of `ringctx serve` (the `Backend` of ringctx/serve/backend.py).

    HTTP handlers (app.py) ──▶ EngineBackend ──▶ Scheduler thread ──▶ Engine ──▶ every rank
                                 documents (documents.py): records in the store, KV caches in the
                                 decode ranks' memory while they fit the KV budget (least recently
                                 used leave first); prompts (prompts.py): which document's rows a
                                 request follows, and its tokens after them

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
- The numbers of /metrics and /health (`stats`).

Every Engine call runs on the scheduler's thread, submitted as the work items of
engine/work_items.py; the handlers only tokenize and read records.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from ..engine import Engine, RankFailure
from ..engine.scheduler import Done, Scheduler, SchedulerStopped, Text
from ..engine.prefix_cache import CachedPrompt, PrefixCache, engine_seed
from ..engine.work_items import Prefill, Question
from ..model.context import ContextTooLong
from ..planning.engine_config import SERVING, EngineConfig
from ..units import fmt_bytes
from . import backend as api
from ..planning.memory import document_tokens_within
from ..runtime.efficiency import document_state_bytes, kv_bytes_per_token, kv_layer_row_bytes
from ..runtime.memory_check import auto_kv_budget
from .documents import QUESTION_ROOM_TOKENS, ServedDocuments, StoredDocument
from .prompts import PromptRenderer, text_sha256
from .store import DocumentStore, new_document_id, now

PREFIX_DISK_BUDGET_TIMES = 4
"""The prefix cache's disk budget, as a multiple of its memory budget (--prefix-cache-disk unset)."""

ANSWER_ROWS_SHARE = 0.25
"""KV rows the questions decoding together may hold (prompts and max_tokens), as a share of the
documents' KV budget: beyond it new questions wait in the queue (see Scheduler's max_rows)."""


def is_server_rank() -> bool:
    """Whether this process serves HTTP: rank 0 of a torchrun launch, or the only process."""
    return int(os.environ.get("RANK", "0")) == 0


class EngineBackend:
    """The Backend of `ringctx serve`, over an Engine whose ranks start once and stay up.

    Args:
        config: the engine's EngineConfig (default SERVING; "auto" nproc: the layout that serves
            fastest here, see ringctx.engine.serving_nproc); its chunk_tokens is the chunk
            documents are ingested in (unset: the engine's default) and a question's own long
            prompt is prefilled in (unset: serving_chunk_tokens).
        **settings: EngineConfig fields by name, replacing the config's (model=, nproc=, ...).
        store_dir: where documents are kept (records and KV caches); made if missing.
        kv_budget_bytes: bytes of KV cache the decode ranks keep in memory in all (None: see
            documents.KV_BUDGET_SHARE); beyond it the least recently used documents leave memory.
        max_queue: answers that may wait for their turn; more are refused with Overloaded.
        max_document_tokens: the longest document accepted (None: what the KV budget holds).
        max_batch: questions decoded together at most (each step runs every one of them).
        max_step_tokens: tokens one step may run: one per question decoding plus the prompt tokens
            it prefills (questions joining, an ingest's chunk); None: the Scheduler's default (one
            prefill chunk beside a full batch). It bounds the questions' prefill work between two
            tokens of an answer in flight.
        ingest_share: beside answers in flight, each step's slice of an ingest takes about this many
            decode steps (Scheduler's ingest_share): 1.0 keeps their inter-token time near 2x.
        join_share: beside answers in flight, the questions joining in one step take about this many
            decode steps, at least one question (Scheduler's join_share).
        prefix_cache_disk_bytes: bytes the prefix cache's entries may take in the store when they
            leave memory (None: PREFIX_DISK_BUDGET_TIMES its memory budget; 0: none are saved).
        log: where one-line notices go (layout, documents loaded), e.g. print.
    """

    def __init__(self, config: EngineConfig = SERVING, *, store_dir: str = "ringctx-store",
                 kv_budget_bytes: int | None = None, max_queue: int = 64, max_document_tokens: int | None = None,
                 max_batch: int = 16, max_step_tokens: int | None = None, ingest_share: float = 1.0,
                 join_share: float = 1.0, prefix_cache_disk_bytes: int | None = None, log=None, **settings):
        from ..engine import serving_layout
        from ..planning.prefill_plan import serving_chunk_tokens

        self.log = log or (lambda line: None)
        config = config.replace(**settings)
        nproc, note = serving_layout(config.nproc, config.device, config.tp * config.ep)  # EP: ep CP ranks at least
        config = config.replace(nproc=nproc)
        model, chunk_tokens = config.model, config.chunk_tokens
        if note:
            self.log(f"ringctx serve: {note}")
        # Under torchrun every rank builds the Engine; rank 0 serves and leads, the others follow it.
        self.is_server_rank = is_server_rank()
        if self.is_server_rank:
            self.store = DocumentStore(store_dir)  # a bad path fails before any rank starts

        def build() -> Engine:
            built = Engine(config=config)
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
        # Ingests name their chunk (it travels with the prefill's start to every rank): the engine's,
        # the fastest (the scheduler slices it, so no answer waits a whole chunk); a question's own
        # long prompt keeps short chunks (serving_chunk_tokens).
        self.chunk_tokens = engine.chunk_tokens
        self.prompt_chunk_tokens = chunk_tokens or serving_chunk_tokens(engine.model, engine.world_size)
        self.model_id = os.path.basename(str(model).rstrip("/")).removesuffix(".gguf")
        limit = engine.model.config.rope_scaling.position_limit if engine.model.config.rope_scaling else None
        self.position_limit = int(limit or 2**31 - 1)  # the first position the model's RoPE cannot compute
        # the engine's guard refuses past the trained context (ringctx.model.context) unless allowed
        self.max_context_tokens = (self.position_limit if config.allow_long_context
                                   else min(self.position_limit, engine.context.limit))
        self.max_queue = max_queue
        self.tokenizer = engine.model.tokenizer
        if self.tokenizer is None:
            self.scheduler.stop()
            engine.close()
            raise ValueError(f"model {model!r} has no tokenizer (a random-weight preset): serve a GGUF file or a "
                             "Hugging Face directory")
        self.bytes_per_token = kv_bytes_per_token(engine)
        self.kv_budget_bytes = int(kv_budget_bytes if kv_budget_bytes is not None else auto_kv_budget(engine))
        within = document_tokens_within(engine.model.full_config, kv_layer_row_bytes(engine), self.kv_budget_bytes,
                                        document_state_bytes(engine))  # a hybrid's states take their share
        self.max_document_tokens = int(max_document_tokens or max(1, within - QUESTION_ROOM_TOKENS))
        self._lock = threading.Lock()  # the counters below (the scheduler's thread writes too)
        self._problem: str | None = None
        self._draining = False
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        self.document_chunks_prefilled = 0
        self.running = 0
        self.docs = ServedDocuments(self.store, engine, self.scheduler, bytes_per_token=self.bytes_per_token,
                                    kv_budget_bytes=self.kv_budget_bytes, log=self.log)
        self.prompts = PromptRenderer(self.tokenizer, self.docs)
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache:
            share = int(self.kv_budget_bytes * config.prefix_cache_share)
            disk = share * PREFIX_DISK_BUDGET_TIMES if prefix_cache_disk_bytes is None else prefix_cache_disk_bytes
            self.prefix_cache = PrefixCache(
                engine, bytes_per_token=self.bytes_per_token, budget_bytes=share,
                min_tokens=config.prefix_cache_min_tokens, directory=self.store.root / "prefix-cache",
                disk_budget_bytes=disk, others_bytes=self.docs.bytes_in_memory, limit_bytes=self.kv_budget_bytes,
                log=self.log)
            self.docs.implicit = self.prefix_cache  # registered documents come first: entries make room for them
        answer_rows = max(1, int(self.kv_budget_bytes * ANSWER_ROWS_SHARE) // self.bytes_per_token)
        self.scheduler.max_rows = answer_rows  # nothing is submitted before this point
        self._resume_ingests()

    # ------------------------------------------------------------------ documents
    def add_document(self, text: str, name: str = "") -> api.DocumentInfo:
        self._check_serving()
        if not text.strip():
            raise api.BadRequest("the document is empty: give some text to ingest", param="text")
        rendered, suffix = self.engine.document_text(text)
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        n = len(ids)
        self._check_context(n, param="text")
        need = self.docs.kv_bytes(n)
        if n > self.max_document_tokens or need > self.kv_budget_bytes:
            raise api.TooLarge(
                f"the document has {n:,} tokens ({fmt_bytes(need)} of KV cache) but this server keeps at most "
                f"{self.max_document_tokens:,} tokens ({fmt_bytes(self.kv_budget_bytes)} of KV over "
                f"{self.engine.decode_ranks} decode rank(s), --kv-budget); split it, or start the server with "
                f"more decode ranks, an 8-bit KV cache (--kv-dtype fp8) or a larger --kv-budget", param="text")
        if n + QUESTION_ROOM_TOKENS > self.position_limit:
            raise api.TooLarge(f"the document has {n:,} tokens; the model runs at most {self.position_limit:,}",
                               param="text")
        record = api.DocumentInfo(id=new_document_id(), name=name or "untitled", status="ingesting", created=now(),
                                  tokens=n, chunks_total=-(-n // self.chunk_tokens), kv_dtype=self.engine.kv_dtype,
                                  text_chars=len(rendered), text_sha256=text_sha256(rendered))
        ids_tensor = torch.tensor(ids, dtype=torch.long)
        self.docs.add(record, ids_tensor, self.chunk_tokens)
        try:
            self._submit_ingest(record, ids_tensor, {"question_suffix": suffix, "chat": True})
        except SchedulerStopped as exc:
            raise api.Unavailable(str(exc)) from None
        return self.document(record.id)

    def _submit_ingest(self, record: api.DocumentInfo, token_ids: torch.Tensor, frame: dict,
                       resuming: bool = False) -> None:
        """Queue a document's ingest, which keeps a checkpoint in the store (runtime/checkpoint.py)
        until its KV cache is saved: a server stopped or killed meanwhile resumes it at its next start."""
        suffix = frame.get("question_suffix", "")
        ingest = Prefill(token_ids, as_document=True, drop_unseen=True, decode_room=QUESTION_ROOM_TOKENS,
                         chunk_tokens=self.chunk_tokens, frame=(suffix, {"chat": bool(frame.get("chat", True))}),
                         checkpoint=str(self.store.checkpoint_path(record.id)), checkpoint_extra=frame,
                         on_resume=lambda job: self.docs.resumed(record.id, job))
        self.docs.ingesting(record.id, self.scheduler.submit_prefill(
            ingest, on_chunk=lambda job, stats: self._chunk_done(record.id, stats),
            on_done=lambda result: self.docs.ingested(record.id, result),
            on_error=lambda error: self._ingest_failed(record.id, error, resuming)))

    def _ingest_failed(self, doc_id: str, error: BaseException, resuming: bool) -> None:
        # bad input (no memory for it, a checkpoint of another model) fails it; a stop or a lost
        # rank leaves it "ingesting" with its checkpoint, to resume at the next start
        if isinstance(error, ValueError):
            self.docs.ingest_failed(doc_id, error, resuming)

    def _resume_ingests(self) -> None:
        """Start-up: the ingests a stopped server left in the store continue from their checkpoints."""
        for record, token_ids, frame in self.docs.resumable_ingests(self.chunk_tokens):
            self.log(f"ringctx serve: {record.id} ({record.name}) was ingesting when the server stopped; resuming it")
            self._submit_ingest(record, token_ids, frame, resuming=True)

    def _chunk_done(self, doc_id: str, stats) -> None:
        """Scheduler thread: one chunk of an ingest has run."""
        if self.docs.chunk_done(doc_id, stats):
            with self._lock:
                self.prefill_tokens += stats.tokens
                self.prefill_seconds += stats.seconds
                self.document_chunks_prefilled += 1

    def document(self, doc_id: str) -> api.DocumentInfo:
        info = self.docs.info(doc_id)
        if info is None:
            raise api.NotFound(f"no document {doc_id!r}: list them with GET /v1/documents", param="document")
        return info

    def documents(self) -> list[api.DocumentInfo]:
        return self.docs.infos()

    def delete_document(self, doc_id: str) -> api.DocumentInfo:
        info = self.document(doc_id)
        self.docs.delete(doc_id, drop=self._problem is None)
        return info

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
        doc_id, question = self.prompts.prompt(request)
        doc_tokens = self.docs.get(doc_id).tokens if doc_id else 0
        self._check_context(len(question), cached=doc_tokens, max_new_tokens=s.max_tokens, param="max_tokens")
        total = doc_tokens + len(question) + s.max_tokens
        if total > self.max_context_tokens:
            raise api.BadRequest(f"{doc_tokens + len(question):,} prompt tokens and max_tokens={s.max_tokens} go past "
                                 f"the model's {self.max_context_tokens:,} tokens", param="max_tokens")
        if self.scheduler.queued_answers >= self.max_queue:
            raise api.Overloaded(f"{self.scheduler.queued_answers} requests are waiting (--max-queue "
                                 f"{self.max_queue}); try again shortly", retry_after_s=2.0)
        sampling = dict(max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                        stop=list(s.stop) or None)
        reuse = self._reuse(doc_id, doc_tokens, question, request.cache_salt)
        try:
            rest = reuse.prompt_ids[reuse.match.tokens:] if reuse.match is not None else None
            if rest is not None and len(rest) > self.prompt_chunk_tokens:  # a long rest: a chunk per step on a copy
                ticket = self.scheduler.submit_question_after(
                    Prefill(rest[:-1], chunk_tokens=self.prompt_chunk_tokens,
                            decode_room=QUESTION_ROOM_TOKENS + s.max_tokens, on_top=reuse.private_copy),
                    Question(rest[-1:], len(rest), sampling, keep=reuse.keep, on_leave=reuse.left),
                    ready=reuse.prefilled, on_chunk=lambda job, stats: self._prompt_chunk_done(stats))
            elif rest is not None:  # a cached prompt begins it: the rest is its question
                ticket = self.scheduler.submit_question(Question(rest, len(rest), sampling, source=reuse,
                                                                 keep=reuse.keep, on_leave=reuse.left))
            elif doc_id is not None:
                ticket = self.scheduler.submit_question(Question(question, len(question), sampling,
                                                                 source=StoredDocument(self.docs, doc_id),
                                                                 keep=reuse.keep, on_leave=reuse.left))
            else:  # a prompt of its own: prefilled over every rank (a slice per step), then its last token asked
                room = QUESTION_ROOM_TOKENS + s.max_tokens
                ticket = self.scheduler.submit_question_after(
                    Prefill(question[:-1], as_document=True, decode_room=room, chunk_tokens=self.prompt_chunk_tokens),
                    Question(question[-1:], len(question), sampling, keep=reuse.keep, on_leave=reuse.left),
                    ready=reuse.prefilled, on_chunk=lambda job, stats: self._prompt_chunk_done(stats))
        except SchedulerStopped as exc:
            raise self._stopped_error(str(exc)) from None
        return _Answer(self, ticket, prompt_tokens=doc_tokens + len(question), cached=reuse)

    def _check_context(self, new_tokens: int, *, cached: int = 0, max_new_tokens: int = 0, param: str) -> None:
        """The engine's context guard (one rule: ringctx.model.context) before anything is queued:
        ContextLengthExceeded (400, code context_length_exceeded), or one warning with --allow-long-context."""
        try:
            self.engine.check_context(new_tokens, cached_tokens=cached, max_new_tokens=max_new_tokens)
        except ContextTooLong as exc:
            raise api.ContextLengthExceeded(str(exc), param=param) from None

    def _reuse(self, doc_id: str | None, doc_tokens: int, question: torch.Tensor, salt: str | None) -> CachedPrompt:
        """What the request's prompt reuses: the longest cached prompt that begins it (when it is
        longer than its document of `doc_tokens` tokens, if it names one), and how its rows are kept
        afterwards."""
        cache = self.prefix_cache
        doc_ids = self.docs.tokens(doc_id) if doc_id is not None else None
        prompt_ids = question if doc_id is None else (torch.cat([doc_ids, question]) if doc_ids is not None else None)
        seed = engine_seed(self.engine, salt) if cache is not None else ""
        match = None
        if cache is not None and prompt_ids is not None and prompt_ids.numel() > cache.min_tokens:
            match = cache.lookup(prompt_ids, seed)
            if match is not None and match.tokens <= doc_tokens:
                match = None  # its document gives as much
        cached = match.tokens if match is not None else doc_tokens
        return CachedPrompt(cache, seed, match, prompt_ids, cached, room=QUESTION_ROOM_TOKENS)

    def _prompt_chunk_done(self, stats) -> None:
        """Scheduler thread: a chunk of a prompt of its own has run."""
        with self._lock:
            self.prefill_tokens += stats.tokens
            self.prefill_seconds += stats.seconds

    # ------------------------------------------------------------------ health and closing
    def stats(self) -> api.BackendStats:
        problem = self._problem or self._dead_rank()
        by_status, per_rank = self.docs.counts()
        with self._lock:
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
                problem=problem, prefix_cache=self.prefix_cache.stats() if self.prefix_cache is not None else None)

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
        for doc_id in self.docs.unsaved():  # a document answered from memory is completed on disk
            try:
                self.docs.saved(doc_id, timeout=max(1.0, deadline - time.monotonic()))
            except (SchedulerStopped, TimeoutError) as exc:
                self.log(f"ringctx serve: {doc_id} was not saved before the stop ({exc}); add it again")
        if self.prefix_cache is not None and self._problem is None:  # a restart on this store finds them
            try:
                saved = scheduler.call(lambda: self.prefix_cache.save_all(deadline),
                                       timeout=max(1.0, deadline - time.monotonic()))
                self.log(f"ringctx serve: {saved} cached prompt(s) saved in the store")
            except (SchedulerStopped, TimeoutError, RankFailure) as exc:
                self.log(f"ringctx serve: the cached prompts were not all saved before the stop ({exc})")
        self.docs.stop_ingests()  # an ingest cut short is never half-kept: it resumes at the next start
        self.scheduler.stop()
        self.engine.close()

    def follow(self) -> int:
        """Torchrun, every rank but 0: run rank 0's commands until it stops; the exit status (0, or 1
        when a rank was lost)."""
        import signal

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

    def __init__(self, backend: EngineBackend, ticket, *, prompt_tokens: int, cached: CachedPrompt):
        self.backend, self.ticket = backend, ticket
        self.prompt_tokens, self.cached = prompt_tokens, cached

    def cancel(self) -> None:
        self.ticket.cancel()

    async def __aiter__(self):
        backend = self.backend
        with backend._lock:
            backend.running += 1
        first_s = None  # from the request's arrival (a prompt of its own: its prefill included)
        try:
            async for event in self.ticket:
                if isinstance(event, Text):
                    if first_s is None:
                        first_s = time.monotonic() - self.ticket.submitted
                    yield api.Piece(event.text)
                elif isinstance(event, Done):
                    result = event.result
                    if result is None:  # cancelled
                        return
                    yield api.Finished(finish_reason="length" if result.finish_reason == "length" else "stop",
                                       prompt_tokens=self.prompt_tokens, completion_tokens=len(result.token_ids),
                                       cached_tokens=self.cached.cached_tokens,
                                       time_to_first_token_s=first_s if first_s is not None else
                                       time.monotonic() - self.ticket.submitted)
        except ValueError as exc:
            raise api.BadRequest(str(exc)) from None
        except SchedulerStopped as exc:
            raise backend._stopped_error(str(exc)) from None
        except RankFailure as exc:
            raise api.RankLost(str(exc)) from None
        finally:
            with backend._lock:
                backend.running -= 1
