"""How `ringctx serve` recognises a prompt that resends a document (PromptRenderer's
document_text_prefix, then prefix_document): by the SHA-256 of the prompt's first characters
before any tokenizing, the longest ready document winning, the rest tokenized on its own; by
tokens for a prompt that is a document's tokens followed by more. Run over stand-in documents (no
engine): the live server's resend test (tests/serve/test_live_server.py) runs the same path end to end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
from ringctx.serve.backend import DocumentInfo  # noqa: E402
from ringctx.serve.prompts import PromptRenderer, text_sha256  # noqa: E402


class CharTokenizer:
    """A token per character (its code point), counting how many characters it was given."""

    def __init__(self):
        self.chars = 0

    def __call__(self, text, add_special_tokens=False):
        self.chars += len(text)
        return {"input_ids": [ord(c) for c in text]}


def backend_with(*documents):
    """The prompts over stand-in documents: (id, rendered text, status) each."""
    records, tokens = [], {}
    for doc_id, text, status in documents:
        records.append(DocumentInfo(id=doc_id, name=doc_id, created=0, status=status, tokens=len(text),
                                    text_chars=len(text), text_sha256=text_sha256(text)))
        tokens[doc_id] = torch.tensor([ord(c) for c in text])
    served = SimpleNamespace(ready=lambda: [(r, tokens[r.id]) for r in records if r.status == "ready"])
    return PromptRenderer(CharTokenizer(), served)


def find(backend, text):
    return backend.document_text_prefix(text)


def test_a_resent_document_is_found_by_text_and_only_the_rest_tokenized():
    backend = backend_with(("doc-a", "<user>The ferry leaves at noon.", "ready"))
    doc_id, rest = find(backend, "<user>The ferry leaves at noon.\n\nWhen does it leave?")
    assert doc_id == "doc-a" and "".join(map(chr, rest.tolist())) == "\n\nWhen does it leave?"
    assert backend.tokenizer.chars == len("\n\nWhen does it leave?")  # the document's text was not tokenized


def test_the_longest_ready_document_wins_and_others_are_not_taken():
    backend = backend_with(("doc-short", "<user>The ferry", "ready"),
                           ("doc-long", "<user>The ferry leaves at noon.", "ready"),
                           ("doc-longer", "<user>The ferry leaves at noon. It is red.", "ingesting"),
                           ("doc-other", "<user>A different text that is long enough", "ready"))
    doc_id, rest = find(backend, "<user>The ferry leaves at noon. It is red. Why?")
    assert doc_id == "doc-long" and "".join(map(chr, rest.tolist())) == " It is red. Why?"
    doc_id, rest = find(backend, "<user>The ferry leaves late")
    assert doc_id == "doc-short" and "".join(map(chr, rest.tolist())) == " leaves late"
    assert find(backend, "<user>The ferr") is None          # shorter than every document
    assert find(backend, "<user>The ferry leaves at noon.") is not None  # doc-short's rest
    assert find(backend, "<user>the ferry leaves at noon. Why?") is None  # one character differs


def test_a_prompt_of_a_documents_tokens_and_more_is_found_by_tokens():
    backend = backend_with(("doc-a", "abc", "ready"), ("doc-b", "abcdef", "ready"), ("doc-c", "abcdefgh", "failed"))
    doc_id, rest = backend.prefix_document(torch.tensor([ord(c) for c in "abcdefghij"]))
    assert doc_id == "doc-b" and rest.tolist() == [ord(c) for c in "ghij"]
    assert backend.prefix_document(torch.tensor([ord(c) for c in "abc"])) is None
