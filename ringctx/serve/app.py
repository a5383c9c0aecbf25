"""The HTTP layer of `ringctx serve`: a FastAPI app over a `Backend` (ringctx/serve/backend.py).

    GET  /                          the page (ringctx/serve/static/): ingest, watch, ask; no key needed to load it
    GET  /static/{app.js,style.css} its script and style
    GET  /health                    200 when every rank is up, 503 (with the problem) when not; no key needed
    GET  /metrics                   Prometheus text format
    GET  /v1/models                 the one served model
    POST /v1/chat/completions       OpenAI chat, streamed (server-sent events) or not; "document": "doc-..."
    POST /v1/completions            OpenAI completions, likewise
    POST /v1/documents              {"text", "name"} or a multipart file: 202, ingested in the background
    GET  /v1/documents[/{id}]       status, tokens, chunks, ETA, where the KV cache lives
    DELETE /v1/documents/{id}

This layer only authenticates, limits, validates and formats; the backend owns tokens, documents
and ranks. Every backend call runs in a worker thread (`run_in_threadpool`): the event loop never
blocks on the engine; an answer's tokens are awaited on the loop itself (the backend wakes it for
each), so that no answer holds a worker thread while it runs. Every error, ours or the backend's, is an OpenAI error object.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from . import protocol
from .backend import Backend, BackendError, Finished, Overloaded, Piece
from .metrics import ServeMetrics
from .protocol import ChatRequest, CompletionRequest, DocumentCreate, Limits, RequestProblem

STATIC = Path(__file__).with_name("static")
PAGE = {"/": ("index.html", "text/html; charset=utf-8"),
        "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
        "/static/style.css": ("style.css", "text/css; charset=utf-8")}
"""The page's files by path: a fixed set (no directory is served), all inside the package."""
PAGE_HEADERS = {
    # The page runs its own script only: no inline script, no other origin (it works offline).
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

OPEN_PATHS = frozenset({"/health", *PAGE})
"""Paths that need no API key: a supervisor's liveness probe carries none, and the page is static (the
API calls it makes carry the key, asked of the user when the server answers 401)."""


class BodyTooLarge(HTTPException):
    """Raised while a body is read, as soon as it passes the limit (the rest is never read)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over this server's limit of {limit:,} bytes (--max-body-bytes)")


def create_app(backend: Backend, *, api_key: str | None = None, limits: Limits | None = None,
               log=print) -> FastAPI:
    """The app serving `backend`. `api_key`: required of every request but /health (Bearer)."""
    limits = limits or Limits()
    metrics = ServeMetrics(backend)
    app = FastAPI(title="ringctx serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, log=log, metrics=metrics)
    _install_error_handlers(app)
    started = int(time.time())

    for path, (name, media_type) in PAGE.items():
        app.add_api_route(path, _page_file(STATIC / name, media_type), methods=["GET"], include_in_schema=False)

    @app.get("/health")
    async def health():
        stats = await run_in_threadpool(backend.stats)
        body = {"status": "ok" if stats.healthy else "unavailable", "ranks": stats.ranks, "problem": stats.problem}
        return JSONResponse(body, status_code=200 if stats.healthy else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(await run_in_threadpool(metrics.render), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return protocol.model_list(backend.model_id, started)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(backend, model_id, param=None)
        return protocol.model_list(backend.model_id, started)["data"][0]

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _generate(backend, metrics, limits, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(backend, metrics, limits, body, request, chat=False)

    @app.post("/v1/documents", status_code=202)
    async def add_document(request: Request):
        text, name = await _document_upload(request)
        info = await run_in_threadpool(backend.add_document, text, name)
        return JSONResponse(protocol.document_object(info), status_code=202)

    @app.get("/v1/documents")
    async def list_documents():
        infos = await run_in_threadpool(backend.documents)
        return {"object": "list", "data": [protocol.document_object(i) for i in infos]}

    @app.get("/v1/documents/{doc_id}")
    async def get_document(doc_id: str):
        return protocol.document_object(await run_in_threadpool(backend.document, doc_id))

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str):
        info = await run_in_threadpool(backend.delete_document, doc_id)
        return {"id": info.id, "object": "document", "deleted": True}

    return app


def _page_file(path: Path, media_type: str):
    async def page_file():
        return FileResponse(path, media_type=media_type, headers=PAGE_HEADERS)
    return page_file


# ---------------------------------------------------------------------------- answers
async def _generate(backend: Backend, metrics: ServeMetrics, limits: Limits, body, request: Request, *, chat: bool):
    _check_model(backend, body.model, param="model")
    request_id = protocol.new_id("chatcmpl" if chat else "cmpl")
    generate_request = protocol.generate_request(body, limits, request_id)
    arrived = time.monotonic()
    answer = await run_in_threadpool(backend.generate, generate_request)
    endpoint = "chat" if chat else "completions"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(answer, metrics, endpoint, arrived, request_id, backend.model_id, chat, include_usage, request)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        text, done = await _collect(answer, metrics, arrived)
    except BaseException:  # an error, or the client went away (the handler is cancelled)
        answer.cancel()
        raise
    _note(request, done)
    build = protocol.chat_response if chat else protocol.completion_response
    return build(request_id, backend.model_id, text, done)


async def _collect(answer, metrics: ServeMetrics, arrived: float) -> tuple[str, Finished]:
    """The whole answer (text, Finished), its token times into the histograms."""
    pieces, clock = [], _TokenClock(metrics, arrived)
    async with contextlib.aclosing(aiter(answer)) as events:
        async for event in events:
            if isinstance(event, Piece):
                clock.tick()
                pieces.append(event.text)
            elif isinstance(event, Finished):
                return "".join(pieces), event
    raise BackendError("the answer ended without a result (cancelled)")


async def _stream(answer, metrics, endpoint, arrived, request_id, model, chat, include_usage, request):
    """Server-sent events of one answer; an error after the first byte is sent as an error event."""
    created, clock = int(time.time()), _TokenClock(metrics, arrived)
    finished = False

    def chunk(**kw) -> str:
        build = protocol.chat_chunk if chat else protocol.completion_chunk
        return _sse(build(request_id, model, created, **kw))

    try:
        if chat:
            yield chunk(delta={"role": "assistant", "content": ""})
        async with contextlib.aclosing(aiter(answer)) as events:
            async for event in events:
                if isinstance(event, Piece):
                    clock.tick()
                    if event.text:
                        yield chunk(delta={"content": event.text}) if chat else chunk(text=event.text)
                elif isinstance(event, Finished):
                    finished = True
                    _note(request, event)
                    yield chunk(finish_reason=event.finish_reason)
                    if include_usage:
                        yield chunk(usage_of=event)
        yield "data: [DONE]\n\n"
    except BackendError as exc:
        yield _sse(protocol.error_object(exc.message, exc.type, exc.param, exc.code))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away, or an error: free the answer's rows
            answer.cancel()


class _TokenClock:
    """Time to first token and inter-token times of one answer (a tick per token), into the metrics."""

    def __init__(self, metrics: ServeMetrics, arrived: float):
        self.metrics, self.last = metrics, None
        self.arrived = arrived

    def tick(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.arrived)
        else:
            self.metrics.inter_token.observe(now - self.last)
        self.last = now


def _note(request: Request, done: Finished) -> None:
    """What the request's log line adds about its tokens."""
    request.scope.setdefault("ringctx", {})["tokens"] = (
        f"prompt={done.prompt_tokens} cached={done.cached_tokens} completion={done.completion_tokens} "
        f"ttft={done.time_to_first_token_s:.3f}s")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _check_model(backend: Backend, name: str, param: str | None) -> None:
    if name != backend.model_id:
        raise _NotServed(f"the model {name!r} is not served here; this server serves {backend.model_id!r} "
                         "(GET /v1/models)", param=param)


class _NotServed(BackendError):
    status, code = 404, "model_not_found"


async def _document_upload(request: Request) -> tuple[str, str]:
    """(text, name) of a document upload: JSON {"text", "name"} or a multipart form with a file."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise RequestProblem("a multipart upload needs the document in a form field named 'file'", "file")
        raw = await upload.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestProblem("the uploaded file is not UTF-8 text: upload plain text", "file") from None
        name = form.get("name")
        return text, str(name) if isinstance(name, str) and name else (upload.filename or "")
    try:
        body = DocumentCreate.model_validate_json(await request.body())
    except ValueError as exc:
        raise RequestProblem(f"send JSON {{\"text\": ..., \"name\": ...}} or a multipart file: {_first_error(exc)}",
                             "text") from None
    return body.text, body.name


# ---------------------------------------------------------------------------- errors
def _install_error_handlers(app: FastAPI) -> None:
    def error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None):
        return JSONResponse(protocol.error_object(message, type_, param, code), status_code=status, headers=headers)

    @app.exception_handler(BackendError)
    async def backend_error(request, exc: BackendError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if isinstance(exc, Overloaded) else None
        return error(exc.status, exc.message, exc.type, exc.param, exc.code, headers)

    @app.exception_handler(RequestProblem)
    async def request_problem(request, exc: RequestProblem):
        return error(400, str(exc), param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error(400, "the request body is not valid JSON", code="invalid_json")
        first = problems[0] if problems else {}
        if tuple(first.get("loc", ())) == ("body",):
            return error(400, "the request body must be a JSON object (Content-Type: application/json)",
                         code="invalid_json")
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error(422, f"{where or 'body'}: {first.get('msg', 'invalid')}", param=where, code="invalid_value")

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        codes = {401: ("authentication_error", "invalid_api_key"), 404: ("invalid_request_error", "not_found"),
                 405: ("invalid_request_error", "method_not_allowed"), 413: ("invalid_request_error", "too_large")}
        type_, code = codes.get(exc.status_code, ("invalid_request_error", None))
        message = exc.detail if isinstance(exc.detail, str) and exc.detail not in ("Not Found",) else (
            f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail))
        return error(exc.status_code, message, type_, code=code)

    @app.exception_handler(Exception)
    async def server_fault(request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(x) for x in first.get('loc', ())) or 'body'}: {first.get('msg')}"
    return str(exc)


# ---------------------------------------------------------------------------- the guard
class _Guard:
    """ASGI middleware in front of every route: the API key, the body limit and one log line per request.

    The body limit is enforced while the body arrives (Content-Length first, then counting what is
    read), so an oversized upload is refused without being held in memory."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, log, metrics: ServeMetrics):
        self.app, self.api_key, self.max_body_bytes, self.log, self.metrics = app, api_key, max_body_bytes, log, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), [500]

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send_noting_status)
                return
            await self.app(scope, self._limited(receive), send_noting_status)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(endpoint=self.metrics.endpoint(path), status=str(status[0])).inc()
            extra = scope.get("ringctx", {}).get("tokens", "")
            self.log(f"ringctx serve: {scope['method']} {path} {status[0]} {time.monotonic() - started:.3f}s {extra}"
                     .rstrip())

    def _refusal(self, scope):
        """A response refusing the request before it reaches a route, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                why = "no API key given" if not given else "the API key is not valid"
                return JSONResponse(protocol.error_object(f"{why}: send Authorization: Bearer KEY",
                                                          "authentication_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return JSONResponse(protocol.error_object(BodyTooLarge(self.max_body_bytes).detail, code="too_large"),
                                status_code=413)
        return None

    def _limited(self, receive):
        seen = [0]

        async def receive_within_limit():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return receive_within_limit
