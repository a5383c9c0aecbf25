"""A request's prompt as the engine runs it: which document's cached rows it follows, and the tokens after them.

    request naming a document    its messages rendered as the rest of the document's chat turn
                                 (`continuation`), or its prompt text, tokenized
    request without a document   the chat template over its messages (or its prompt text); a ready
                                 document whose text begins it is found by text, before tokenizing
                                 (`document_text_prefix`), else one whose tokens begin its tokens
                                 (`prefix_document`); else it is a prompt of its own

So a question about a document prefills only its own tokens, exactly as Engine.ask, whether the
client names the document or sends its text again.
"""

from __future__ import annotations

import hashlib

import torch

from ..runtime.document import chat_frame
from . import backend as api


class PromptRenderer:
    """Requests' prompts over the server's documents (`documents`: a ServedDocuments, read only)."""

    def __init__(self, tokenizer, documents):
        self.tokenizer, self.documents = tokenizer, documents
        chat_frame(tokenizer)  # a chat template that cannot render fails at start-up, not at the first request

    def prompt(self, request: api.GenerateRequest) -> tuple[str | None, torch.Tensor]:
        """(the document whose rows are the prefix, or None; the token ids to prefill after it)."""
        tok = self.tokenizer
        if request.document is not None:
            record = self.documents.get(request.document)
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
                text = self.continuation(list(request.messages))
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
        reuse = self.document_text_prefix(text)  # a resent document: its text is not tokenized again
        if reuse is not None:
            return reuse
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            raise api.BadRequest("the prompt has fewer than 2 tokens: give a longer prompt",
                                 param="messages" if request.messages is not None else "prompt")
        ids = torch.tensor(ids, dtype=torch.long)
        reuse = self.prefix_document(ids)
        return reuse if reuse is not None else (None, ids)

    def continuation(self, messages: list[dict]) -> str:
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

    def document_text_prefix(self, text: str) -> tuple[str, torch.Tensor] | None:
        """(a ready document whose text begins the prompt's, the tokens of the prompt's text after
        it), for a client that resends the document, or None. The longest such document wins.

        Found by text, before the prompt is tokenized (an 8K-token document took 11 ms to tokenize
        again, most of what a resent question cost over one naming its document): the SHA-256 of the
        prompt's first characters against each document's rendered text, one pass over the prompt
        for all of them. Tokens alone would not tell: where the document ends the prompt's text goes
        on, and BPE merges across that boundary differently ("sun. \n\n" alone, "sun. \n\nWhat" in
        the prompt). So the rest of the prompt is tokenized on its own: the tokens Engine.ask puts
        after the document for that text."""
        candidates = sorted((r for r, _ in self.documents.ready() if r.text_sha256 and r.text_chars < len(text)),
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

    def prefix_document(self, ids: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(a ready document whose tokens begin the prompt's, the prompt's tokens after them), or None
        (a prompt sent as the document's tokens' text without its rendered frame, say). The longest
        such document wins."""
        candidates = [(record, tokens) for record, tokens in self.documents.ready() if tokens is not None]
        for record, tokens in sorted(candidates, key=lambda c: -c[1].numel()):
            n = tokens.numel()
            if n < ids.numel() and torch.equal(ids[:n], tokens):
                return record.id, ids[n:]
        return None


def text_sha256(text: str) -> str:
    """The SHA-256 a document's rendered text is recognised by (document_text_prefix)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
