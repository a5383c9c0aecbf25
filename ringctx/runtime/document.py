"""A prefilled document: its KV cache on a decode rank, its tokens and the frame a question needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model import KVCache


@dataclass
class Document:
    """A prefilled document ready for questions: its KV cache and what a question must append.

    With several decode ranks every one of them holds a Document of its own for the same text,
    whose `cache` is that rank's slice of the tokens; the engine keeps them in step.
    """

    cache: KVCache
    """This rank's KV cache of the document: all tokens in order (one decode rank) or a slice."""
    token_ids: torch.Tensor
    """The document's token ids."""
    question_prefix: str = ""
    """Text placed before each question (empty for raw documents)."""
    question_suffix: str = ""
    """Text placed after each question (the chat template's end of turn and assistant start)."""
    stats: object | None = None
    """PrefillStats of the ingest (None when loaded from a file)."""
    metadata: dict = field(default_factory=dict)
    id: int = -1
    """The engine's handle for the document on every decode rank."""
    rows: int = -1
    """Rows of `cache` that belong to the document (the rest are an answer's); -1: cache.length."""
    dropped_unseen: bool = False
    """Its windowed and chunked layers kept only the rows later tokens see (KVCache.drop_unseen):
    it serves questions after it, not prefixes of it."""
    borrowed: bool = False
    """Its cache's storage past `rows` is another document's (a view of a longer document's first
    tokens, KVCache.view_below): a question's prefill that writes there puts the rows back after."""

    linear_states: list | None = None
    """A hybrid's linear-attention states at the document's end (copies, never written: a question's
    prefill advances the cache's own states, `rewind` puts these back); None: no linear layers."""

    def __post_init__(self):
        if self.rows < 0:
            self.rows = self.cache.length
        if self.linear_states is None and self.cache.linear_states is not None:
            self.keep_states()

    def keep_states(self) -> None:
        """Take the cache's linear-attention states as the document's (after its rows grew: an
        extension, a kept answer)."""
        states = self.cache.linear_states
        self.linear_states = None if states is None else [None if st is None else st.clone() for st in states]

    def check_prefix(self, tokens: int, what: str = "a prefix") -> None:
        """Raise a ValueError when the document cannot give its first `tokens` tokens (`what`)."""
        if self.linear_states is not None and tokens < self.length:
            raise ValueError(f"{what} of {tokens} tokens of a {self.length}-token document of a hybrid model: its "
                             "linear-attention layers keep their state at the document's end only, not at each "
                             "token; ingest those tokens as a document of their own")
        if self.dropped_unseen and tokens < self.length:
            raise ValueError(f"{what} of {tokens} tokens of a {self.length}-token document whose windowed and "
                             "chunked layers keep only the rows its next tokens see: ingest it with "
                             "drop_unseen=False to take prefixes of it")

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def rewind(self) -> KVCache:
        """The cache cut back to the document (questions do not see each other), a hybrid's linear
        states back at the document's end."""
        self.cache.truncate(self.rows, self.start_states())
        return self.cache

    def start_states(self) -> list | None:
        """Copies of the document's linear-attention states, for a question to start from (None
        without linear layers)."""
        return None if self.linear_states is None else [None if st is None else st.clone()
                                                         for st in self.linear_states]

    @property
    def frame(self) -> dict:
        """What a saved document keeps besides the cache: the chat frame and the metadata."""
        return {"question_prefix": self.question_prefix, "question_suffix": self.question_suffix, **self.metadata}


def chat_frame(tokenizer) -> tuple[str, str]:
    """(text before the document, text after a question) from the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00RINGCTX_QUESTION\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
    before, after = rendered.split(marker)
    return before, after
