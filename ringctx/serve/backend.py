"""What the HTTP layer asks of the engine side: the contract between `ringctx.serve.app` and the
serving backend that owns the Engine's ranks (`ringctx.serve.service.EngineBackend`).

The HTTP layer (app.py) only validates, authenticates, limits and formats; everything that
touches tokens, documents or ranks goes through a `Backend`. Tests of the HTTP layer run against
a small fake that honours this contract; the real one drives the Engine's scheduler.

Threading: the app calls these methods from its request handlers (worker threads, never the event
loop); every method is thread-safe and returns promptly except the iterators of `generate`, which
block between events.

Errors: every method raises a `BackendError` subclass for what a client did or can wait out; the
app maps each to an OpenAI error object with the status given here. Anything else is a server
fault (500), and `RankLost` ends the server (503, then a non-zero exit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


class BackendError(Exception):
    """A request the backend refuses; `status` and `type`/`code` are those of the OpenAI error object."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class BadRequest(BackendError):
    """The request cannot be served as written (empty prompt, context too long, bad sampling)."""


class ContextLengthExceeded(BackendError):
    """The document, or its tokens with the request's and max_tokens, pass the model's trained context
    (ringctx.model.context; vLLM answers prompt + max_tokens > max_model_len alike)."""

    code = "context_length_exceeded"


class NotFound(BackendError):
    """No such document (or model)."""

    status, code = 404, "not_found"


class TooLarge(BackendError):
    """The document can never fit the decode ranks (or is over the server's token limit)."""

    status, code = 413, "document_too_large"


class Overloaded(BackendError):
    """The queue is full; try again after `retry_after_s`."""

    status, type, code = 429, "rate_limit_error", "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, param: str | None = None):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class Unavailable(BackendError):
    """The backend cannot serve now (starting, draining, or a rank is lost)."""

    status, type, code = 503, "server_error", "unavailable"


class RankLost(Unavailable):
    """A rank died or stopped answering: the message names it. The server must exit non-zero."""

    code = "rank_lost"


@dataclass(frozen=True)
class Sampling:
    """How to pick an answer's tokens (validated by the app; the backend re-checks ranges)."""

    max_tokens: int = 256
    temperature: float = 1.0
    """OpenAI's default is 1.0; 0 means greedy."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    """One chat or completion request, as the client sent it (the backend renders and tokenizes)."""

    messages: tuple[dict, ...] | None = None
    """Chat: [{"role": ..., "content": str}, ...]; None for a completion."""
    prompt: str | None = None
    """Completion: the prompt text; None for a chat."""
    document: str | None = None
    """A document id ("doc-..."): its KV cache is the prompt's prefix."""
    sampling: Sampling = Sampling()
    request_id: str = ""
    cache_salt: str | None = None
    """Requests reuse each other's cached prompts only when their salts are equal (None: no salt)."""


@dataclass(frozen=True)
class Piece:
    """Newly final answer text (may be "" when a token completes no character yet)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The last event of every answer."""

    finish_reason: str
    """"stop" (EOS or a stop string) or "length" (max_tokens)."""
    prompt_tokens: int
    """Prompt tokens of the request, the document's included."""
    completion_tokens: int
    cached_tokens: int
    """Of prompt_tokens, those whose KV came from a document or a cached prompt (not prefilled for this
    request)."""
    time_to_first_token_s: float = 0.0
    """Seconds from the request's arrival at the backend to its first answer text (its queue wait and
    its prompt's prefill included)."""


class Answer(Protocol):
    """An answer being produced: `async for` over it on the event loop for `Piece`s then one
    `Finished`, each awaited without blocking the loop or a thread; `cancel()` frees its rows."""

    def __aiter__(self) -> AsyncIterator[Piece | Finished]: ...

    def cancel(self) -> None: ...


@dataclass
class DocumentInfo:
    """One document: what the server's store keeps of it (store.STORED_FIELDS, with `status`
    "ingesting", "ready" or "failed") and what the documents API shows (a copy with the live numbers
    filled in, and "on_disk" for a ready document not in memory)."""

    id: str
    name: str
    status: str
    """"ingesting", "ready" (in the decode ranks' memory), "on_disk" (saved, not in memory) or "failed"."""
    created: int
    """Unix seconds."""
    tokens: int = 0
    chunks_done: int = 0
    chunks_total: int = 0
    chunk_strategies: list[str] = field(default_factory=list)
    chunk_seconds: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    """New tokens of each chunk done."""
    seconds: float = 0.0
    """Ingest time so far (or in all, once ready)."""
    tokens_per_s: float | None = None
    """Prefill rate of the chunks done: their tokens over their seconds (None before the first chunk)."""
    eta_s: float | None = None
    """Seconds left of the ingest (None when not ingesting)."""
    kv_bytes_per_rank: list[int] = field(default_factory=list)
    """KV bytes each decode rank holds for it (empty when not in memory)."""
    decode_ranks: list[int] = field(default_factory=list)
    """The global ranks that hold it in memory."""
    bytes_on_disk: int = 0
    error: str | None = None
    """Why it failed."""
    kv_dtype: str = ""
    """How its KV cache is stored (the engine's kv_dtype when it was ingested)."""
    text_chars: int = 0
    """Characters of the text its tokens were made from (the chat frame included)."""
    text_sha256: str = ""
    """SHA-256 of that text (UTF-8): how a prompt that resends the document is recognised."""


@dataclass
class BackendStats:
    """Numbers for /metrics and /health."""

    healthy: bool
    ranks: int
    queue_depth: int
    running: int
    documents_by_status: dict[str, int]
    kv_bytes_per_rank: list[int]
    kv_budget_bytes: int
    prefill_tokens: int
    """Tokens prefilled since start (documents and prompts)."""
    prefill_seconds: float
    document_chunks_prefilled: int
    """Document chunks prefilled since start (0 after a restart that only reloaded documents)."""
    problem: str | None = None
    """Why it is not healthy."""
    batch_size: int = 0
    """Questions decoding together now (one step runs them all)."""
    max_batch: int = 0
    max_step_tokens: int = 0
    """Tokens one step may run (decode tokens plus prompt tokens prefilled): the step budget."""
    step_tokens: int = 0
    """Tokens the last step ran."""
    slice_layers: int = 0
    """Layers of an ingest's chunk the last step ran beside the questions decoding (0: none)."""
    ingest_share: float = 0.0
    """A slice of an ingest beside answers takes about this many decode steps (--ingest-share)."""
    join_share: float = 0.0
    """The questions joining in one step beside answers take about this many decode steps (--join-share)."""
    step_joins: int = 0
    """Questions that joined in the last step."""
    joins_held: int = 0
    """Steps in which a question waited for the next step because of --join-share, since start."""
    answer_rows: int = 0
    """KV rows the running questions may hold (prompts and max_tokens); freed when they leave."""
    max_answer_rows: int = 0
    """The bound on answer_rows beyond which questions wait (0: none)."""
    decode_steps: int = 0
    """Batched decode steps since start."""
    decoded_tokens: int = 0
    """Tokens those steps decoded (decoded_tokens / decode_steps: the mean batch)."""
    decode_seconds: float = 0.0
    """Seconds those steps took in the engine (decode_seconds / decode_steps: the mean step, which the
    inter-token time a client sees exceeds by what the HTTP layer and the joins add)."""
    prefix_cache: object | None = None
    """The prefix cache's counters (engine.prefix_cache.PrefixCacheStats), None when it is off."""


class Backend(Protocol):
    """The engine side of `ringctx serve` (see the module docstring for threads and errors)."""

    model_id: str
    """The name /v1/models lists and requests may name in "model"."""
    max_context_tokens: int
    """The longest prompt + answer a request may ask for: the model's trained context (any length with
    --allow-long-context), at most what its RoPE computes."""

    def add_document(self, text: str, name: str = "") -> DocumentInfo:
        """Tokenize and queue an ingest; returns at once with status "ingesting". Raises TooLarge
        before any prefill when the document could never fit, ContextLengthExceeded when it passes the
        model's trained context, BadRequest when it is empty."""

    def document(self, doc_id: str) -> DocumentInfo:
        """One document (NotFound)."""

    def documents(self) -> list[DocumentInfo]:
        """Every document, oldest first."""

    def delete_document(self, doc_id: str) -> DocumentInfo:
        """Forget a document everywhere (memory, disk); an ingest in progress is cancelled (NotFound)."""

    def generate(self, request: GenerateRequest) -> Answer:
        """Queue an answer; returns at once (BadRequest, ContextLengthExceeded, NotFound, Overloaded, Unavailable)."""

    def stats(self) -> BackendStats:
        """Current numbers (never raises)."""

    def close(self, drain_s: float = 10.0) -> None:
        """Finish in-flight answers for up to drain_s, then stop every rank."""

