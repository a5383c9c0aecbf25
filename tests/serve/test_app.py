"""The HTTP layer of `ringctx serve` (ringctx/serve/app.py) against a fake backend: the OpenAI wire
format as the real `openai` client parses it, the documents API, auth, limits and every error object.

The fake honours the Backend contract (ringctx/serve/backend.py) without ranks, so these tests run
in milliseconds; tests/serve/test_live_server.py runs the same paths against the real engine.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

from ringctx.serve import backend as api  # noqa: E402
from ringctx.serve.app import _stream, create_app  # noqa: E402
from ringctx.serve.metrics import ServeMetrics  # noqa: E402
from ringctx.serve.protocol import Limits  # noqa: E402

MODEL = "fake-model"
KEY = "s3cret-key"


class FakeAnswer:
    def __init__(self, words, request, cached, fail_after=None):
        self.words, self.request, self.cached, self.fail_after = words, request, cached, fail_after
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    def __iter__(self):
        n = min(len(self.words), self.request.sampling.max_tokens)
        for i, word in enumerate(self.words[:n]):
            if self.cancelled:
                return
            if self.fail_after is not None and i == self.fail_after:
                raise api.RankLost("rank 1 of 2 has exited (code -9)")
            yield api.Piece(word)
        yield api.Finished(finish_reason="length" if n < len(self.words) else "stop", prompt_tokens=10 + self.cached,
                           completion_tokens=n, cached_tokens=self.cached, time_to_first_token_s=0.01)

    async def __aiter__(self):
        for event in self:
            yield event


class FakeBackend:
    """Answers "one two three ..." (up to max_tokens); documents live in a dict and are ready at once."""

    model_id = MODEL
    max_context_tokens = 2048

    def __init__(self):
        self.docs: dict[str, api.DocumentInfo] = {}
        self.requests: list[api.GenerateRequest] = []
        self.answers: list[FakeAnswer] = []
        self.raise_on_generate: api.BackendError | None = None
        self.fail_after: int | None = None
        self.healthy = True
        self.lock = threading.Lock()

    def add_document(self, text, name=""):
        if not text.strip():
            raise api.BadRequest("the document is empty", param="text")
        if len(text) > 3_000:
            raise api.TooLarge("the document has 3,001+ tokens; this server keeps at most 3,000", param="text")
        doc_id = f"doc-{len(self.docs):024x}"
        self.docs[doc_id] = api.DocumentInfo(id=doc_id, name=name, status="ingesting", created=1, tokens=len(text.split()),
                                             chunks_total=1)
        info = api.DocumentInfo(**vars(self.docs[doc_id]))
        self.docs[doc_id].status, self.docs[doc_id].chunks_done = "ready", 1
        return info

    def document(self, doc_id):
        if doc_id not in self.docs:
            raise api.NotFound(f"no document {doc_id!r}", param="document")
        return self.docs[doc_id]

    def documents(self):
        return list(self.docs.values())

    def delete_document(self, doc_id):
        return self.docs.pop(self.document(doc_id).id)

    def generate(self, request):
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        cached = self.document(request.document).tokens if request.document else 0
        with self.lock:
            self.requests.append(request)
            answer = FakeAnswer("one two three four five six".split(" "), request, cached, self.fail_after)
            answer.words = [w if i == 0 else " " + w for i, w in enumerate(answer.words)]
            self.answers.append(answer)
        return answer

    def stats(self):
        return api.BackendStats(healthy=self.healthy, ranks=2, queue_depth=0, running=0,
                                documents_by_status={"ready": len(self.docs)}, kv_bytes_per_rank=[100, 200],
                                kv_budget_bytes=1000, prefill_tokens=50, prefill_seconds=0.5,
                                document_chunks_prefilled=3, problem=None if self.healthy else "rank 1 of 2 has exited")

    def close(self, drain_s=10.0):
        pass


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def log():
    return []


@pytest.fixture
def http(backend, log):
    app = create_app(backend, api_key=KEY, limits=Limits(max_body_bytes=4096, max_tokens=100), log=log.append)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def assert_error(response, status, *, param=None, code=None, says=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if says is not None:
        assert says in error["message"], error
    return error


# ---------------------------------------------------------------------------- the openai client
def test_models_and_chat_through_the_openai_client(client, backend):
    assert [m.id for m in client.models.list().data] == [MODEL]
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              temperature=0, seed=7, stop=["xyz"])
    assert response.choices[0].message.content == "one two three"
    assert response.choices[0].finish_reason == "length" and response.object == "chat.completion"
    assert response.usage.completion_tokens == 3 and response.usage.total_tokens == 13
    sent = backend.requests[-1]
    assert sent.messages == ({"role": "user", "content": "hi"},)
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.seed, sent.sampling.stop) == \
        (3, 0.0, 7, ("xyz",))


def test_a_streamed_chat_has_the_same_text_then_usage_then_done(client, http):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three four five six"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    raw = http.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]") and '"usage"' not in raw.text  # usage only when asked


def test_completions_streamed_and_not(client):
    done = client.completions.create(model=MODEL, prompt="Once", max_tokens=2)
    assert done.choices[0].text == "one two" and done.object == "text_completion"
    streamed = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "one two"


def test_a_document_named_in_extra_body_reaches_the_backend_and_counts_as_cached(client, http, backend):
    doc = http.post("/v1/documents", json={"text": "alpha beta gamma delta", "name": "greek"})
    assert doc.status_code == 202 and doc.json()["status"] == "ingesting"
    doc_id = doc.json()["id"]
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "what?"}],
                                              extra_body={"document": doc_id})
    assert backend.requests[-1].document == doc_id
    assert response.usage.prompt_tokens_details.cached_tokens == 4


def test_content_parts_are_joined_and_other_parts_refused(http, backend):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200 and backend.requests[-1].messages[0]["content"] == "ab"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": image}]})
    assert_error(r, 400, param="messages", says="image_url")


# ---------------------------------------------------------------------------- documents
def test_the_documents_api(http):
    a = http.post("/v1/documents", json={"text": "one two", "name": "a"}).json()
    b = http.post("/v1/documents", files={"file": ("notes.txt", b"three four five", "text/plain")})
    assert b.status_code == 202 and b.json()["name"] == "notes.txt" and b.json()["tokens"] == 3
    listed = http.get("/v1/documents").json()
    assert listed["object"] == "list" and [d["id"] for d in listed["data"]] == [a["id"], b.json()["id"]]
    one = http.get(f"/v1/documents/{a['id']}").json()
    assert one["status"] == "ready" and one["chunks"] == {"done": 1, "total": 1, "strategies": [], "seconds": [], "tokens": []}
    assert one["tokens_per_s"] is None
    assert set(one["kv"]) == {"in_memory", "bytes_per_rank", "decode_ranks", "bytes_on_disk"}
    assert http.delete(f"/v1/documents/{a['id']}").json() == {"id": a["id"], "object": "document", "deleted": True}
    assert_error(http.get(f"/v1/documents/{a['id']}"), 404, param="document")
    assert_error(http.delete(f"/v1/documents/{a['id']}"), 404)


def test_bad_documents_are_refused_by_name(http):
    assert_error(http.post("/v1/documents", json={"text": "   "}), 400, param="text", says="empty")
    assert_error(http.post("/v1/documents", json={"name": "no text"}), 400, param="text", says="text")
    assert_error(http.post("/v1/documents", files={"file": ("x.bin", b"\xff\xfe\x00", "application/octet-stream")}),
                 400, param="file", says="UTF-8")
    assert_error(http.post("/v1/documents", files={"other": ("x.txt", b"abc", "text/plain")}), 400, param="file")
    assert_error(http.post("/v1/documents", json={"text": "w " * 1600}), 413, code="document_too_large")


# ---------------------------------------------------------------------------- auth and limits
def test_every_endpoint_but_health_needs_the_key(backend, log):
    app = create_app(backend, api_key=KEY, log=log.append)
    with TestClient(app) as bare:
        assert bare.get("/health").status_code == 200
        for method, path in [("get", "/v1/models"), ("post", "/v1/chat/completions"), ("get", "/v1/documents"),
                             ("get", "/metrics"), ("delete", "/v1/documents/doc-x")]:
            error = assert_error(getattr(bare, method)(path), 401, code="invalid_api_key", says="no API key")
            assert error["type"] == "authentication_error"
        wrong = bare.get("/v1/models", headers={"Authorization": "Bearer not-the-key"})
        assert_error(wrong, 401, says="not valid")
        assert bare.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=TestClient(app),
                      max_retries=0).models.list()


def test_without_a_key_the_server_is_open(backend):
    with TestClient(create_app(backend, log=lambda line: None)) as bare:
        assert bare.get("/v1/models").status_code == 200


def test_bodies_over_the_limit_are_refused_before_being_read(http):
    big = json.dumps({"text": "x" * 5000})
    assert_error(http.post("/v1/documents", content=big, headers={"content-type": "application/json"}), 413,
                 code="too_large", says="4,096 bytes")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"x" * 1000

    assert_error(http.post("/v1/documents", content=chunks(), headers={"content-type": "application/json"}), 413,
                 says="--max-body-bytes")


def test_request_errors_are_openai_error_objects(http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    post = lambda body, **kw: http.post("/v1/chat/completions", json=body, **kw)  # noqa: E731
    assert_error(http.post("/v1/chat/completions", content=b"{bad", headers={"content-type": "application/json"}),
                 400, code="invalid_json")
    assert_error(http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400, says="JSON object")
    assert_error(post({**chat, "temperature": "hot"}), 422, param="temperature")
    assert_error(post({**chat, "temperature": 3}), 422, param="temperature")
    assert_error(post({**chat, "messages": []}), 422, param="messages")
    assert_error(post({**chat, "messages": [{"role": "wizard", "content": "x"}]}), 422, param="messages.0.role")
    assert_error(post({"messages": chat["messages"]}), 422, param="model")
    assert_error(post({**chat, "n": 2}), 400, param="n")
    assert_error(post({**chat, "max_tokens": 101}), 400, param="max_tokens", says="limit of 100")
    assert_error(post({**chat, "max_tokens": 0}), 422, param="max_tokens")
    assert_error(post({**chat, "stop": ["a", "b", "c", "d", "e"]}), 400, param="stop")
    assert_error(post({**chat, "tools": [{"type": "function"}]}), 400, param="tools")
    assert_error(post({**chat, "model": "gpt-4o"}), 404, param="model", code="model_not_found", says=MODEL)
    assert_error(post({**chat, "document": "doc-" + "9" * 24}), 404, param="document")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "echo": True}), 400, param="echo")
    assert_error(http.get("/v1/nothing"), 404, says="no route GET /v1/nothing")
    assert_error(http.get("/v1/chat/completions"), 405)


def test_backend_refusals_keep_their_status(http, backend, client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    backend.raise_on_generate = api.Overloaded("64 requests are waiting", retry_after_s=2.0)
    r = http.post("/v1/chat/completions", json=chat)
    assert_error(r, 429, code="queue_full") and r.headers["retry-after"] == "2"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**chat)
    backend.raise_on_generate = api.Unavailable("the server is stopping")
    assert_error(http.post("/v1/chat/completions", json=chat), 503, code="unavailable")
    backend.raise_on_generate = api.RankLost("rank 1 of 2 has exited (code -9)")
    assert_error(http.post("/v1/chat/completions", json=chat), 503, code="rank_lost", says="rank 1 of 2")
    backend.raise_on_generate = api.BadRequest("1,990 prompt tokens and max_tokens=100 go past the model's 2,048",
                                               param="max_tokens")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**chat)


def test_a_prompt_past_the_trained_context_is_a_400_context_length_exceeded(http, backend, client):
    """As vLLM answers prompt + max_tokens > max_model_len (EngineBackend raises it from the engine's guard)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    backend.raise_on_generate = api.ContextLengthExceeded(
        "8,300 tokens (8,200 new + 100 to generate) pass the trained context of fake-model, 8,192 tokens: ...",
        param="max_tokens")
    error = assert_error(http.post("/v1/chat/completions", json=chat), 400, param="max_tokens",
                         code="context_length_exceeded", says="8,192 tokens")
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100)
    assert caught.value.code == "context_length_exceeded"


def test_a_rank_lost_mid_answer(http, backend):
    backend.fail_after = 2
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 503, code="rank_lost")
    streamed = http.post("/v1/chat/completions", json={**chat, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "rank_lost" and events[-1] == "[DONE]"
    assert backend.answers[-1].cancelled


def test_a_stream_the_client_leaves_cancels_its_answer(backend):
    request = api.GenerateRequest(messages=({"role": "user", "content": "hi"},))
    answer = backend.generate(request)

    class Req:
        scope: dict = {}

    async def leave_after_two():
        events = _stream(answer, ServeMetrics(backend), "chat", 0.0, "id", MODEL, True, False, Req())
        await events.__anext__()
        await events.__anext__()
        await events.aclose()

    asyncio.run(leave_after_two())
    assert answer.cancelled


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_answers_waiting_for_tokens_hold_no_worker_thread(backend, stream):
    """More answers than the worker threads (anyio's 40) all waiting for their next token: the
    backend calls of other requests still run (an answer waits on the event loop, not in a thread)."""
    streams = 48
    release_threads, release_loop = threading.Event(), None
    waiting = []  # one entry per answer that has begun to wait for its first token

    class SlowAnswer(FakeAnswer):
        def __iter__(self):  # what a thread reading the answer would block on
            waiting.append(self)
            release_threads.wait(timeout=120)
            yield from super().__iter__()

        async def __aiter__(self):
            waiting.append(self)
            await release_loop.wait()
            for event in super().__iter__():
                yield event

    backend.generate = lambda request: SlowAnswer(["a", " b"], request, 0)
    app = create_app(backend, log=lambda line: None)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}

    async def run():
        nonlocal release_loop
        release_loop = asyncio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http_client:
            tasks = [asyncio.create_task(http_client.post("/v1/chat/completions", json=chat)) for _ in range(streams)]
            for _ in range(6000):  # until every answer waits (a thread-bound server gets no further than 40)
                if len(waiting) == streams:
                    break
                await asyncio.sleep(0.01)
            try:  # the bound only ends a server whose threads are all taken; the call itself takes ms
                listed = await asyncio.wait_for(http_client.get("/v1/documents"), timeout=60)
            finally:
                release_loop.set()
                release_threads.set()
            answers = await asyncio.gather(*tasks)
        return listed, answers

    listed, answers = asyncio.run(run())
    assert listed.status_code == 200
    assert all(r.status_code == 200 for r in answers)
    if stream:
        assert all('"content":" b"' in r.text for r in answers)
    else:
        assert all(r.json()["choices"][0]["message"]["content"] == "a b" for r in answers)


# ---------------------------------------------------------------------------- operations
def test_health_metrics_and_a_log_line_per_request(http, backend, log, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    text = http.get("/metrics").text
    for name in ("ringctx_time_to_first_token_seconds_count 1.0", "ringctx_inter_token_seconds_count 3.0",
                 'ringctx_requests_total{endpoint="chat",status="200"} 1.0', 'ringctx_kv_bytes{decode_rank="1"} 200.0',
                 "ringctx_document_chunks_prefilled_total 3.0", "ringctx_prefill_tokens_per_second 100.0",
                 'ringctx_documents{status="ready"}', "ringctx_queue_depth 0.0"):
        assert name in text, name
    assert any(line.startswith("ringctx serve: POST /v1/chat/completions 200 ") and "completion=4" in line
               for line in log)
    assert http.get("/health").json() == {"status": "ok", "ranks": 2, "problem": None}
    backend.healthy = False
    r = http.get("/health")
    assert r.status_code == 503 and "rank 1 of 2" in r.json()["problem"]
