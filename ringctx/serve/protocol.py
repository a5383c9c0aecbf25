"""The OpenAI wire format `ringctx serve` speaks: request bodies in, response bodies out.

Requests are pydantic models of the fields the `openai` Python package sends for chat and
completions (unknown fields are ignored, as OpenAI's own server ignores what it does not use;
fields we cannot honour, such as n > 1 or tools, are refused by name). Responses are plain dicts in
the shapes the package parses: `chat.completion`, `chat.completion.chunk`, `text_completion`,
`document`, `list`, and the error object `{"error": {"message", "type", "param", "code"}}`.

The one field of our own is `document` ("doc-..."): sent by the `openai` client as
`extra_body={"document": id}`, it names the document whose cached rows are the prompt's prefix.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .backend import DocumentInfo, Finished, GenerateRequest, Sampling

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop` sequences."""


class Limits(BaseModel):
    """What one client may send (the server's flags set them; see `ringctx serve --help`)."""

    max_body_bytes: int = 64 * 2**20
    """Largest request body (a document upload included); larger ones get 413 before being read."""
    max_tokens: int = 4096
    """Largest `max_tokens` / `max_completion_tokens` a request may ask for."""
    default_max_tokens: int = 256
    """Answer length when a request names none (OpenAI runs to the context's end; on a CPU that can be
    minutes, so a bound that a client overrides)."""
    max_messages: int = 256
    """Most messages in one chat request."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a list (anything else is refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported: send text")
            parts.append(part.text)
        return "".join(parts)


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Generation(_Lenient):
    """Fields chat and completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    document: str | None = None
    """ringctx: the id of a ready document whose KV cache is the prompt's prefix."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    """As vLLM's: requests reuse each other's cached prompts only when their salts are equal (a
    tenant's own salt keeps its prompts, and the time its first tokens take, apart from others')."""
    user: str | None = None


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None
    logprobs: bool | None = None
    response_format: dict | None = None


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class DocumentCreate(_Lenient):
    text: str
    name: str = ""


class RequestProblem(ValueError):
    """A request that parsed but cannot be served as written: message and the field to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def generate_request(body: ChatRequest | CompletionRequest, limits: Limits, request_id: str) -> GenerateRequest:
    """The backend's request for a parsed body; RequestProblem names what to change."""
    if body.n != 1:
        raise RequestProblem("only n=1 is supported: send one request per answer", "n")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or min(limits.default_max_tokens, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise RequestProblem(f"max_tokens={max_tokens} is over this server's limit of {limits.max_tokens}",
                             "max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise RequestProblem(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    sampling = Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                        stop=tuple(stop))
    if isinstance(body, ChatRequest):
        if body.tools:
            raise RequestProblem("tools are not supported by this server", "tools")
        if body.logprobs:
            raise RequestProblem("logprobs are not supported by this server", "logprobs")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise RequestProblem("only response_format type 'text' is supported", "response_format")
        if len(body.messages) > limits.max_messages:
            raise RequestProblem(f"{len(body.messages)} messages is over this server's limit of "
                                 f"{limits.max_messages}", "messages")
        try:
            messages = tuple({"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                             for m in body.messages)
        except ValueError as exc:
            raise RequestProblem(str(exc), "messages") from None
        return GenerateRequest(messages=messages, document=body.document, sampling=sampling, request_id=request_id,
                               cache_salt=body.cache_salt)
    if body.echo or body.logprobs or body.suffix:
        field = "echo" if body.echo else "logprobs" if body.logprobs else "suffix"
        raise RequestProblem(f"{field} is not supported by this server", field)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise RequestProblem("send one prompt per request (a list of prompts is n answers)", "prompt")
        prompt = prompt[0]
    return GenerateRequest(prompt=prompt, document=body.document, sampling=sampling, request_id=request_id,
                           cache_salt=body.cache_salt)


# ---------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(done: Finished) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def chat_response(request_id: str, model: str, text: str, done: Finished) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": usage(done)}


def completion_response(request_id: str, model: str, text: str, done: Finished) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": usage(done)}


def chat_chunk(request_id: str, model: str, created: int, *, delta: dict | None = None,
               finish_reason: str | None = None, usage_of: Finished | None = None) -> dict:
    """One streamed chunk: a delta, the final finish_reason, or (choices empty) the usage."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [] if usage_of is not None else
             [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}]}
    if usage_of is not None:
        chunk["usage"] = usage(usage_of)
    return chunk


def completion_chunk(request_id: str, model: str, created: int, *, text: str = "",
                     finish_reason: str | None = None, usage_of: Finished | None = None) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": [] if usage_of is not None else
             [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage_of is not None:
        chunk["usage"] = usage(usage_of)
    return chunk


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "ringctx"}]}


def document_object(info: DocumentInfo) -> dict:
    """The documents API's view of one document."""
    return {
        "id": info.id, "object": "document", "name": info.name, "status": info.status, "created": info.created,
        "tokens": info.tokens,
        "chunks": {"done": info.chunks_done, "total": info.chunks_total, "strategies": info.chunk_strategies,
                   "seconds": info.chunk_seconds, "tokens": info.chunk_tokens},
        "seconds": info.seconds, "eta_s": info.eta_s, "tokens_per_s": info.tokens_per_s,
        "kv": {"in_memory": bool(info.kv_bytes_per_rank), "bytes_per_rank": info.kv_bytes_per_rank,
               "decode_ranks": info.decode_ranks, "bytes_on_disk": info.bytes_on_disk},
        "error": info.error,
    }


def error_object(message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
