"""Automatic prefix caching: every long prompt's KV stays on the decode ranks, found again by its tokens.

A client that resends a long prompt (a document pasted into the chat, a conversation that grew by
one turn, a system prompt shared by many clients) should prefill only what is new. Each kept
prompt is an *entry*: an engine Document (split over the decode ranks like any document) with its
token ids, found by a hash chain over fixed blocks of its tokens:

    seed      SHA-256 of what the KV depends on besides the tokens: model, dtype, KV dtype, chat
              template, and the request's cache_salt (tenants' entries never meet)
    chain     h[i] = BLAKE2b(h[i-1] + tokens of block i), one per full block of BLOCK_TOKENS tokens
    index     h[i] -> the entries whose first i blocks are exactly these

A prompt's lookup hashes its own blocks and walks the chain while the index knows it: the last hash
found names every entry sharing those blocks, and the tokens after them are compared directly, so a
match ends at the exact token where the prompt and the entry part. Then:

    the whole entry begins the prompt     the question is the rest, on the entry's rows
    the prompt parts inside the entry     a *view* of the entry's rows below that token (PREFIX
                                          with view: no copy; each decode rank's rows are kept in
                                          position order, so they are its first rows)
    it reaches into a kept turn (a tail)  the turn's own rows joined after its entry's (JOINED: one
                                          copy) into a new entry that replaces the tail, when it
                                          covers at least half of the turn (its next turn); else
                                          a view of the entry up to where the turn began
    it parts inside a leaf's last answer  the leaf (a conversation's own entry) cut back in place to
                                          there (CUT): the client retold the answer as text, which
                                          tokenizes otherwise than it was sampled
    nothing, or fewer than min_tokens     a miss: the prompt is prefilled, then kept

A hybrid model (linear-attention layers: their state stands at an entry's end, not at each token)
takes the first case only: an entry serves a prompt it begins whole, or the prompt is a miss.

When an answer completes, its sequence's rows (question and answer) are kept too (Batch: keep), so
the next turn of a conversation finds all of it: a leaf entry (one no other question reads, asked
whole) grows in place; on any other entry (or a view of it) the turn's own rows alone are kept, a
*tail*, joined to the entry's rows only if a next turn reaches into them; on a document outside the
cache (a registered one) they are copied with the document's when the turn holds min_tokens.
Entries live within a memory budget (least recently used first out); with a directory, an entry
leaving memory is saved there (the document format, checked on load) and comes back when a prompt
needs it, within a disk budget, and a restart on the same directory finds them.

The cache is used on the engine's thread (a Scheduler's, or the caller's); `lookup`, `stats` and
the counters may be read from any thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..files import write_json_atomically
from ..runtime.document import Document

BLOCK_TOKENS = 64
"""Tokens per hashed block: the index's grain (a match is then found to the token by comparing
tokens). Shorter blocks hash more per prompt; 64 keeps a 1M-token prompt's chain at 16K links."""

RECORD_FORMAT = "ringctx-prefix-entry/1"
ENTRY_ID_LENGTH = 24


def prefix_seed(model: str, dtype: str, kv_dtype: str, chat_template: str | None, salt: str | None = None) -> str:
    """What an entry's KV depends on besides its tokens, as the hash chain's first link (hex)."""
    key = json.dumps({"model": model, "dtype": dtype, "kv_dtype": kv_dtype, "chat_template": chat_template or "",
                      "salt": salt or ""}, sort_keys=True)
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def engine_seed(engine, salt: str | None = None) -> str:
    """`prefix_seed` of an Engine: its model as named, its dtype and weights, KV dtype and chat template."""
    config = engine.config
    template = getattr(engine.model.tokenizer, "chat_template", None) if engine.model.tokenizer is not None else None
    return prefix_seed(str(config.model), f"{engine.model.dtype}/{config.weights}", engine.kv_dtype, template, salt)


def block_hashes(seed: str, token_ids: torch.Tensor) -> list[str]:
    """The chain's links, one per full block of `token_ids` (see the module docstring)."""
    data = token_ids.to(torch.int64).contiguous().numpy().tobytes()
    step = BLOCK_TOKENS * 8
    out, link = [], bytes.fromhex(seed)
    for start in range(0, len(data) - step + 1, step):
        link = hashlib.blake2b(link + data[start:start + step], digest_size=16).digest()
        out.append(link.hex())
    return out


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens a and b share from their start."""
    n = min(int(a.numel()), int(b.numel()))
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.numel() else n


@dataclass
class Entry:
    """One kept prompt: its tokens, and its Document on the decode ranks (None while on disk)."""

    id: str
    seed: str
    token_ids: torch.Tensor
    hashes: list[str]
    document: Document | None = None
    on_disk: bool = False
    """Saved in the cache's directory (and identical to the document, when it is in memory too)."""
    users: int = 0
    """Questions reading it now: it stays in memory until they leave."""
    last_used: float = field(default_factory=time.monotonic)
    parent: "Entry | None" = None
    """A *tail*: the kept turn (question and answer) of a question on `parent`, its own rows alone;
    `token_ids` are the parent's first `parent_tokens` then the turn's. Joined to the parent's rows
    (one copy) only when a next turn reaches into it; never saved."""
    parent_tokens: int = 0
    answer_from: int = -1
    """Where the last answer it keeps begins (-1: it keeps none): a next turn that parts from it
    after that point retold the answer (as text, tokenized otherwise) and cuts it back there."""

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def rows(self) -> int:
        """Tokens whose rows it holds itself (a tail's after its parent's)."""
        return self.length - self.parent_tokens


@dataclass
class PrefixMatch:
    """What a lookup found: `tokens` of the prompt's first tokens that `entry`'s rows give."""

    entry: Entry
    tokens: int

    @property
    def whole(self) -> bool:
        """The whole entry begins the prompt (else a view of its first `tokens` is asked)."""
        return self.tokens == self.entry.length


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters (ringctx serve's /metrics)."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    prompt_tokens: int = 0
    entries_kept: int = 0
    partial_hits: int = 0
    """Hits on part of an entry (a view of its first tokens)."""
    tails_joined: int = 0
    """Kept turns joined to their entry's rows because a next turn reached into them."""
    cuts: int = 0
    """Conversations' entries cut back in place to where their next turn parted (its last answer
    retold as text tokenizes otherwise)."""
    evicted_to_disk: int = 0
    evicted_dropped: int = 0
    loaded_from_disk: int = 0
    not_kept: int = 0
    """Prompts not kept: too large for the budget, or their rows could not be kept."""
    entries_in_memory: int = 0
    entries_on_disk: int = 0
    bytes_in_memory: int = 0
    bytes_on_disk: int = 0
    budget_bytes: int = 0
    disk_budget_bytes: int = 0


class PrefixCache:
    """The kept prompts of one engine (see the module docstring).

    Args:
        engine: the Engine; used only on the engine's thread (document_prefix, save, load, drop).
        bytes_per_token: KV bytes one token takes over every decode rank.
        budget_bytes: bytes the entries may keep in memory in all (a share of the KV budget).
        min_tokens: the shortest prompt kept, and the shortest shared start reused.
        directory: where entries leaving memory are saved (None: they are dropped). Made if missing;
            one that cannot be written is reported once through `log` and not used.
        disk_budget_bytes: bytes the saved entries may take (least recently used deleted first).
        others_bytes: the KV bytes the engine's other documents hold now: the entries take what
            is left of `limit_bytes` after them (registered documents come first).
        limit_bytes: the KV budget the entries share with those documents (None: budget_bytes).
        log: where one-line notices go.
    """

    def __init__(self, engine, *, bytes_per_token: int, budget_bytes: int, min_tokens: int,
                 directory: str | os.PathLike | None = None, disk_budget_bytes: int = 0,
                 others_bytes: Callable[[], int] | None = None, limit_bytes: int | None = None, log=None):
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.engine, self.bytes_per_token = engine, bytes_per_token
        self.budget_bytes, self.min_tokens = int(budget_bytes), int(min_tokens)
        self.limit_bytes = int(limit_bytes if limit_bytes is not None else budget_bytes)
        self.others_bytes = others_bytes or (lambda: 0)
        self.disk_budget_bytes = int(disk_budget_bytes)
        self.log = log or (lambda line: None)
        self.lock = threading.Lock()  # the entries and the index (lookups come from other threads)
        self.entries: dict[str, Entry] = {}  # least recently used first
        self.index: dict[str, set[str]] = {}  # chain link -> entry ids
        self.by_document: dict[int, Entry] = {}  # id(Document) -> its entry
        self.views: dict[int, tuple[Entry, Document]] = {}  # id(a view open) -> (its entry, the view)
        self.counts = PrefixCacheStats()
        # a hybrid model's linear layers keep their state at an entry's end only: an entry serves a
        # prompt it begins whole, never a view of its first tokens (nor a cut back into an answer)
        model = getattr(engine, "model", None)
        self.whole_entries_only = bool(getattr(getattr(model, "config", None), "has_linear", False))
        self.directory = self._open_directory(directory)
        self._disk_bytes: dict[str, int] = {}
        if self.directory is not None:
            self._reopen()

    # ------------------------------------------------------------------ any thread
    def lookup(self, token_ids: torch.Tensor, seed: str) -> PrefixMatch | None:
        """The entry whose rows give the most of the prompt's first tokens (at least min_tokens, at
        most all but its last token: a question needs a token of its own), or None."""
        token_ids = token_ids.reshape(-1).to(torch.long)
        hashes = block_hashes(seed, token_ids)
        best: PrefixMatch | None = None
        with self.lock:
            self.counts.lookups += 1
            self.counts.prompt_tokens += int(token_ids.numel())
            found: set[str] = set()
            for link in hashes:  # the chain as far as the index knows it
                ids = self.index.get(link)
                if not ids:
                    break
                found = ids
            limit = int(token_ids.numel()) - 1
            for entry_id in found:
                entry = self.entries[entry_id]
                if entry.parent is not None and self.entries.get(entry.parent.id) is not entry.parent:
                    continue  # a tail whose parent has gone
                tokens = min(common_prefix(entry.token_ids, token_ids), limit)
                if tokens < self.min_tokens:
                    continue
                if entry.parent is not None and 2 * (tokens - entry.parent_tokens) < entry.rows:
                    # less than half of the kept turn (another question that starts like it, not its
                    # next turn): its parent's rows, viewed, rather than a copy to join the two
                    match = PrefixMatch(entry.parent, min(tokens, entry.parent_tokens))
                else:
                    match = PrefixMatch(entry, tokens)
                if self.whole_entries_only and not match.whole:
                    continue
                if best is None or _rank(match) > _rank(best):
                    best = match
            if best is not None:
                self.counts.hits += 1
                self.counts.tokens_reused += best.tokens
        return best

    def stats(self) -> PrefixCacheStats:
        with self.lock:
            out = dataclasses.replace(self.counts)
            held = [e for e in self.entries.values() if e.document is not None]
            out.entries_in_memory, out.bytes_in_memory = len(held), sum(self._bytes(e) for e in held)
            out.entries_on_disk = sum(e.on_disk for e in self.entries.values())
            out.bytes_on_disk = sum(self._disk_bytes.values())
            out.budget_bytes, out.disk_budget_bytes = self.budget_bytes, self.disk_budget_bytes
        return out

    # ------------------------------------------------------------------ the engine's thread
    def open(self, match: PrefixMatch) -> Document | None:
        """A Document of exactly the match's first `tokens` tokens, in memory and marked in use
        (`close` it when its question leaves), or None when the entry is gone (the prompt is then a
        miss). The entry's own Document when it still has that length; else (a partial match, or
        an entry that grew with a conversation since the lookup) a view of its first `tokens`."""
        entry = match.entry
        if entry.parent is not None:
            return self._join_tail(entry, match.tokens)
        with self.lock:
            if self.entries.get(entry.id) is not entry:
                return None
            entry.users += 1  # in use from here until its question closes it
        if entry.document is None and not self._load(entry):
            return None
        self._touch(entry)
        if entry.length == match.tokens:
            return entry.document
        if self._cut_instead(entry, match.tokens):  # a conversation's own entry, its last answer retold
            return entry.document
        try:
            view = self.engine.document_prefix(entry.document, match.tokens, view=True)
        except ValueError as exc:
            entry.users -= 1
            self.log(f"ringctx: prefix cache: a view of {match.tokens:,} tokens could not be made ({exc})")
            return None
        with self.lock:
            self.views[id(view)] = (entry, view)
            self.counts.partial_hits += 1
        return view

    def _cut_instead(self, entry: Entry, tokens: int) -> bool:
        """Cut the entry back to `tokens` in place, rather than view it, when it is a conversation's
        own entry and its next turn parts from it inside its last answer (the client sent the answer
        back as text, which tokenizes otherwise than it was sampled), and no one else reads it or
        keeps a turn after it: the next turn grows it again, no copy."""
        if entry.answer_from < 0 or tokens < entry.answer_from or entry.users != 1:
            return False
        with self.lock:
            if any(e is entry for e, _ in self.views.values()) or any(
                    e.parent is entry for e in self.entries.values()):
                return False
        try:
            self.engine.cut_document(entry.document, tokens)
        except ValueError:
            return False
        with self.lock:
            self._unindex(entry)
            entry.token_ids = entry.token_ids[:tokens].clone()
            entry.hashes = block_hashes(entry.seed, entry.token_ids)
            entry.answer_from = -1
            self._index(entry)
            self.counts.cuts += 1
        if entry.on_disk:  # the saved copy is the longer one: forget it
            self._delete_files(entry.id)
            entry.on_disk = False
        return True

    def _join_tail(self, tail: Entry, tokens: int) -> Document | None:
        """A next turn reached into a kept turn: its parent's rows and its own joined (one copy) into
        a new leaf entry of `tokens` tokens, which replaces the tail; None when the parent has gone."""
        parent = tail.parent
        with self.lock:
            if self.entries.get(tail.id) is not tail or self.entries.get(parent.id) is not parent:
                return None
            parent.users += 1
            tail.users += 1
        try:
            if parent.document is None and not self._load(parent):
                return None
            self._make_room(tokens * self.bytes_per_token)
            document = self.engine.join_documents(parent.document, tail.document, tokens,
                                                  first_tokens=tail.parent_tokens)
        except ValueError as exc:
            self.log(f"ringctx: prefix cache: a kept turn could not be joined to its prompt ({exc})")
            return None
        finally:
            parent.users -= 1
            tail.users -= 1
        self._discard(tail)  # the leaf holds all of it now
        leaf = self._add(document, tail.seed, users=1)
        if leaf is not None:
            with self.lock:
                self.counts.tails_joined += 1
        return None if leaf is None else leaf.document

    def close(self, document: Document | None) -> None:
        """A question that read `document` (as `open` gave it) has left."""
        if document is None:
            return
        with self.lock:
            entry, view = self.views.pop(id(document), (None, None))
            if entry is None:
                entry = self.by_document.get(id(document))
            if entry is not None and entry.users > 0:
                entry.users -= 1
        if view is not None:
            self.engine.drop_document(view)

    def _entry_of(self, document: Document | None) -> Entry | None:
        """The entry whose rows `document` is (its own Document, or a view of it)."""
        if document is None:
            return None
        with self.lock:
            held = self.views.get(id(document))
            return held[0] if held is not None else self.by_document.get(id(document))

    def keep_mode(self, document: Document | None, new_tokens: int) -> str | None:
        """How a question's rows are kept when it completes (Batch's keep), so that the next turn of
        its conversation (its prompt, its answer, a new message) finds all of it: "extend" its
        document when that is an entry asked whole that no other question reads (the entry grows
        with the conversation, no copy); "own" on any other entry or a view of one (its own rows
        alone, a tail: joined to the entry's rows only if a next turn reaches into them); on a
        document outside the cache (a registered one), "copy" when its own tokens reach min_tokens;
        else None (freed)."""
        entry = self._entry_of(document)
        if entry is not None and document is entry.document and entry.parent is None and entry.users <= 1:
            return "extend"
        if entry is not None:
            return "own" if new_tokens > 0 else None
        return "copy" if new_tokens >= self.min_tokens else None

    def kept(self, document: Document | None, seed: str, after: Document | None = None,
             after_tokens: int = 0, answer_tokens: int = 0) -> None:
        """A completed question's rows were kept as `document`: its own document grown (its entry
        follows its new length), a new one (an entry), or, with `after` (the question's document,
        keep "own"), its own rows alone, which continue after's first `after_tokens` tokens (a tail
        of after's entry); its last `answer_tokens` tokens are the answer's. None: its rows were not
        kept."""
        if document is None:
            with self.lock:
                self.counts.not_kept += 1
            return
        entry = self.by_document.get(id(document))
        if entry is not None:  # grown in place
            with self.lock:
                self._unindex(entry)
                entry.token_ids = document.token_ids.clone()
                entry.hashes = block_hashes(entry.seed, entry.token_ids)
                entry.answer_from = entry.length - answer_tokens
                self._index(entry)
            if entry.on_disk:  # the saved copy is the shorter one: forget it
                self._delete_files(entry.id)
                entry.on_disk = False
            self._touch(entry)
            self._make_room(0)
            return
        parent = self._entry_of(after)
        if after is not None and (parent is None or parent.length < after_tokens):
            self.engine.drop_document(document)  # its entry has gone: the turn's rows alone are no use
            return
        if parent is not None:
            self._add_tail(document, parent, after_tokens)
            return
        if document.length < self.min_tokens:
            self.engine.drop_document(document)
            return
        self._add(document, seed)

    def _add_tail(self, document: Document, parent: Entry, parent_tokens: int) -> None:
        token_ids = torch.cat([parent.token_ids[:parent_tokens], document.token_ids.to(torch.long)])
        self._insert(Entry(id=_new_id(), seed=parent.seed, token_ids=token_ids,
                           hashes=block_hashes(parent.seed, token_ids), document=document, parent=parent,
                           parent_tokens=parent_tokens))

    def add(self, document: Document, seed: str, users: int = 0) -> Document | None:
        """Keep a prefilled prompt (a miss's document) as an entry, `users` questions reading it
        (each `close`s it); the Document its questions read (another entry's when one holds the
        same tokens), or None when it is not kept (shorter than min_tokens, or larger than the
        budget): the caller's document is then left as it is, for its question alone."""
        if document.length < self.min_tokens:
            return None
        if not self._fits(document):
            return None
        entry = self._add(document, seed, users=users)
        return None if entry is None else entry.document

    def _fits(self, document: Document) -> bool:
        """Whether a document fits the budget at all (else one line, counted as not kept)."""
        need = document.length * self.bytes_per_token
        if need <= self.budget_bytes:
            return True
        self.log(f"ringctx: prefix cache: a prompt of {document.length:,} tokens ({need:,} bytes of KV) is "
                 f"larger than the cache's budget ({self.budget_bytes:,} bytes); it is not kept")
        with self.lock:
            self.counts.not_kept += 1
        return False

    def save_all(self, deadline: float | None = None) -> int:
        """Save the entries held only in memory (the most recently used first, within the disk
        budget, until time.monotonic() passes `deadline`), so that a restart on the same directory
        finds them; they stay in memory. Returns how many were saved."""
        if self.directory is None:
            return 0
        with self.lock:
            waiting = [e for e in reversed(self.entries.values()) if e.document is not None and not e.on_disk]
        saved = 0
        for entry in waiting:
            if deadline is not None and time.monotonic() > deadline:
                break
            saved += self._save(entry, keep_newer=True)
        return saved

    def clear(self) -> None:
        """Forget every entry in memory (their documents dropped); saved ones stay on disk."""
        for entry in list(self.entries.values()):
            if entry.document is not None:
                self._release(entry, drop=True)
                if not entry.on_disk:
                    self._forget(entry)

    # ------------------------------------------------------------------ inside
    def _add(self, document: Document, seed: str, users: int = 0) -> Entry | None:
        """`document` kept as an entry (or, when an entry has the same tokens, that one kept instead
        and `document` dropped); None when it is larger than the budget (dropped)."""
        if not self._fits(document):
            self.engine.drop_document(document)
            return None
        token_ids = document.token_ids.clone()
        with self.lock:  # the same tokens kept twice (two clients at once): one entry stays
            same = next((e for e in self.entries.values() if e.seed == seed and e.length == document.length
                         and torch.equal(e.token_ids, token_ids)), None)
            if same is not None and same.document is None:  # saved only: this copy is its memory now
                same.document = document
                self.by_document[id(document)] = same
            if same is not None:
                same.users += users
                self._touch_locked(same)
        if same is not None:
            if same.document is not document:
                self.engine.drop_document(document)
            return same
        return self._insert(Entry(id=_new_id(), seed=seed, token_ids=token_ids,
                                  hashes=block_hashes(seed, token_ids), document=document, users=users))

    def _insert(self, entry: Entry) -> Entry:
        """A new entry in the cache and its index; older ones leave memory if it needs the room."""
        entry.users += 1  # while room is made for it
        with self.lock:
            self.entries[entry.id] = entry
            self.by_document[id(entry.document)] = entry
            self._index(entry)
            self.counts.entries_kept += 1
        self._make_room(0)
        entry.users -= 1
        return entry

    def _bytes(self, entry: Entry) -> int:
        return entry.rows * self.bytes_per_token

    def _memory_limit(self) -> int:
        return max(0, min(self.budget_bytes, self.limit_bytes - self.others_bytes()))

    def _make_room(self, need: int) -> None:
        """Move the least recently used entries out of memory until `need` more bytes fit."""
        while True:
            with self.lock:
                held = [e for e in self.entries.values() if e.document is not None]
                used = sum(self._bytes(e) for e in held)
                victims = [e for e in held if e.users == 0]
                if used + need <= self._memory_limit() or not victims:
                    return
                victim = victims[0]
            self._release(victim, drop=False)

    def shrink(self, limit: int) -> None:
        """Move entries out of memory until they hold at most `limit` bytes (a registered document needs room)."""
        while True:
            with self.lock:
                held = [e for e in self.entries.values() if e.document is not None]
                victims = [e for e in held if e.users == 0]
                if sum(self._bytes(e) for e in held) <= limit or not victims:
                    return
                victim = victims[0]
            self._release(victim, drop=False)

    def bytes_in_memory(self) -> int:
        with self.lock:
            return sum(self._bytes(e) for e in self.entries.values() if e.document is not None)

    def _release(self, entry: Entry, drop: bool) -> None:
        """An entry leaves memory: saved to the directory first (when there is one and it fits)."""
        document = entry.document
        saved = entry.on_disk or (not drop and self._save(entry))
        with self.lock:
            entry.document = None
            self.by_document.pop(id(document), None)
            if saved:
                self.counts.evicted_to_disk += not drop
            else:
                self.counts.evicted_dropped += 1
                self._forget_locked(entry)
        self.engine.drop_document(document)

    def _discard(self, entry: Entry) -> None:
        """Forget an entry another one supersedes (its document dropped, its files deleted)."""
        with self.lock:
            self._forget_locked(entry)
            document = entry.document
            entry.document = None
            self.by_document.pop(id(document), None)
        if document is not None:
            self.engine.drop_document(document)
        if entry.on_disk:
            self._delete_files(entry.id)

    def _save(self, entry: Entry, keep_newer: bool = False) -> bool:
        """Write the entry into the directory within the disk budget, deleting the least recently
        used saved entries to make room (with keep_newer, only those used before it)."""
        if self.directory is None or entry.parent is not None:  # a tail is its parent's: never saved alone
            return False
        need = self._bytes(entry)
        if need > self.disk_budget_bytes:
            return False
        self._trim_disk(self.disk_budget_bytes - need, before=entry.last_used if keep_newer else None)
        if sum(self._disk_bytes.values()) + need > self.disk_budget_bytes:
            return False
        path = self.directory / f"{entry.id}.kv"
        try:
            self.engine.save_document(entry.document, path)
            write_json_atomically(self.directory / f"{entry.id}.json", {
                "format": RECORD_FORMAT, "id": entry.id, "seed": entry.seed, "tokens": entry.length,
                "saved": time.time()})
        except (OSError, ValueError) as exc:
            self.log(f"ringctx: prefix cache: an entry could not be saved in {self.directory} ({exc}); it is dropped")
            self._delete_files(entry.id)
            return False
        entry.on_disk = True
        self._disk_bytes[entry.id] = _tree_bytes(path)
        return True

    def _trim_disk(self, limit: int, before: float | None = None) -> None:
        """Delete the least recently used saved entries (not in memory; used before `before` when
        given) until at most `limit` bytes remain."""
        while sum(self._disk_bytes.values()) > limit:
            with self.lock:
                victims = [e for e in self.entries.values() if e.on_disk and e.document is None
                           and (before is None or e.last_used < before)]
                if not victims:
                    return
                victim = victims[0]
                self._forget_locked(victim)
            self._delete_files(victim.id)

    def _load(self, entry: Entry) -> bool:
        """Bring a saved entry back into memory; False (and the entry forgotten) when it does not load."""
        self._make_room(self._bytes(entry))
        path = self.directory / f"{entry.id}.kv"
        try:
            document = self.engine.load_document(path)
            if not torch.equal(document.token_ids.to(torch.long), entry.token_ids):
                self.engine.drop_document(document)
                raise ValueError("its tokens differ from its record's")
        except (OSError, ValueError) as exc:
            self.log(f"ringctx: prefix cache: a saved entry does not load ({exc}); it is deleted")
            with self.lock:
                self._forget_locked(entry)
            self._delete_files(entry.id)
            return False
        with self.lock:
            entry.document = document
            self.by_document[id(document)] = entry
            self.counts.loaded_from_disk += 1
            self._touch_locked(entry)
        return True

    def _touch(self, entry: Entry) -> None:
        with self.lock:
            self._touch_locked(entry)

    def _touch_locked(self, entry: Entry) -> None:
        entry.last_used = time.monotonic()
        if entry.id in self.entries:
            self.entries[entry.id] = self.entries.pop(entry.id)  # now the most recently used

    def _index(self, entry: Entry) -> None:
        for link in entry.hashes:
            self.index.setdefault(link, set()).add(entry.id)

    def _unindex(self, entry: Entry) -> None:
        for link in entry.hashes:
            ids = self.index.get(link)
            if ids is not None:
                ids.discard(entry.id)
                if not ids:
                    del self.index[link]

    def _forget(self, entry: Entry) -> None:
        with self.lock:
            self._forget_locked(entry)

    def _forget_locked(self, entry: Entry) -> None:
        if self.entries.pop(entry.id, None) is not None:
            self._unindex(entry)

    def _delete_files(self, entry_id: str) -> None:
        self._disk_bytes.pop(entry_id, None)
        if self.directory is None:
            return
        try:
            (self.directory / f"{entry_id}.json").unlink()
        except FileNotFoundError:
            pass
        shutil.rmtree(self.directory / f"{entry_id}.kv", ignore_errors=True)

    # ------------------------------------------------------------------ the directory
    def _open_directory(self, directory) -> Path | None:
        if directory is None:
            return None
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
            probe.close()
        except OSError as exc:
            self.log(f"ringctx: prefix cache: {path} cannot be written ({exc.strerror or exc}); kept prompts stay "
                     "in memory only (give a writable --store)")
            return None
        return path

    def _reopen(self) -> None:
        """The entries a previous run saved: their records and tokens (their rows load when asked)."""
        from safetensors.torch import load_file

        for partial in self.directory.glob("*.kv.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        found = []
        for record_path in self.directory.glob("*.json"):
            entry_id = record_path.stem
            try:
                record = json.loads(record_path.read_text())
                if record.get("format") != RECORD_FORMAT or record.get("id") != entry_id or not _is_id(entry_id):
                    raise ValueError("not a prefix cache record")
                tokens = load_file(str(self.directory / f"{entry_id}.kv" / "tokens.safetensors"))["token_ids"].long()
                if int(tokens.numel()) != int(record["tokens"]):
                    raise ValueError("its tokens and its record disagree")
                seed = str(record["seed"])
                bytes.fromhex(seed)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.log(f"ringctx: prefix cache: {record_path.name} is damaged ({exc}); it is deleted")
                if _is_id(entry_id):
                    self._delete_files(entry_id)
                continue
            found.append((float(record.get("saved", 0.0)), Entry(id=entry_id, seed=seed, token_ids=tokens,
                                                                  hashes=block_hashes(seed, tokens), on_disk=True)))
        for _, entry in sorted(found, key=lambda f: f[0]):  # the oldest first: least recently used
            self.entries[entry.id] = entry
            self._index(entry)
            self._disk_bytes[entry.id] = _tree_bytes(self.directory / f"{entry.id}.kv")
        self._trim_disk(self.disk_budget_bytes)


def _rank(match: PrefixMatch) -> tuple:
    """Which of two matches a prompt takes: more tokens; then no copy (not a tail's); then one in
    memory; then the most recently used."""
    entry = match.entry
    return (match.tokens, match.whole and entry.parent is None, entry.document is not None, entry.last_used)


def _new_id() -> str:
    return "pfx-" + secrets.token_hex(ENTRY_ID_LENGTH // 2)


def _is_id(name: str) -> bool:
    return (len(name) == 4 + ENTRY_ID_LENGTH and name.startswith("pfx-")
            and all(c in "0123456789abcdef" for c in name[4:]))


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


class CachedPrompt:
    """One prompt and the prefix cache, for a question that asks it: the cached prompt it reuses (a
    work_items.DocumentSource when the question joins), how its rows are kept when it completes
    (`keep`, Batch's keep) and what then becomes an entry (`left`, a Question's on_leave). With the
    cache off (None) nothing is kept. Engine.chat and ringctx serve ask alike through it.

    Args:
        cache: the PrefixCache, or None.
        seed: the prompt's `engine_seed` (with its salt).
        match: what `cache.lookup` found for the prompt, or None.
        prompt_ids: the prompt's token ids [T] (a document's included).
        cached: the prompt's tokens whose rows it will not prefill (the match's, or its document's).
        room: rows a Document prefilled here keeps free for the question.
    """

    def __init__(self, cache: PrefixCache | None, seed: str, match: PrefixMatch | None,
                 prompt_ids: torch.Tensor | None, cached: int, room: int = 256):
        self.cache, self.seed, self.match, self.prompt_ids, self.room = cache, seed, match, prompt_ids, room
        self.cached_tokens = cached
        """Of the prompt's tokens, those whose rows it did not prefill (usage.prompt_tokens_details)."""
        self.kept_mode: str | None = None  # what `keep` chose
        self.kept_after = 0

    def document(self, engine):
        """Scheduler thread, when the question joins: the cached prompt's Document of exactly the
        matched tokens; when its entry has gone since the lookup, those tokens prefilled now."""
        document = self.cache.open(self.match)
        if document is None:
            self.cached_tokens = 0
            prefix = self.prompt_ids[:self.match.tokens]
            document = engine.ingest(prefix.tolist(), decode_room=self.room)
            document = self.cache.add(document, self.seed, users=1) or document
        return document

    def private_copy(self, engine):
        """Scheduler thread: a copy of the cached rows of its own, to extend by a long rest of the
        prompt a chunk per step (Prefill's on_top); the cached entry is released."""
        document = self.document(engine)
        copy = engine.document_prefix(document, document.length, decode_room=self.room)
        if self.cache is not None:
            self.cache.close(document)
        return copy

    def prefilled(self, result):
        """Scheduler thread: a prompt of its own was prefilled; kept as an entry when it is long enough."""
        if self.cache is None:
            return result.document
        return self.cache.add(result.document, self.seed, users=1) or result.document

    def keep(self, member) -> str | None:
        """Scheduler thread, as the question leaves: how its rows are kept (BatchMember.keep)."""
        if self.cache is None:
            return None
        new_tokens = int(member.generation.prompt_ids.numel()) + len(member.result.token_ids)
        self.kept_mode = self.cache.keep_mode(member.document, new_tokens)
        # the tokens its own rows continue (its document may grow before `left`: another question's keep)
        self.kept_after = member.document.length if member.document is not None else 0
        return self.kept_mode

    def left(self, member) -> None:
        """Scheduler thread: the question has left; what it kept becomes an entry."""
        if self.cache is None:
            return
        if member.kept is not None or self.kept_mode is not None:
            own = self.kept_mode == "own"
            answer = max(0, len(member.result.token_ids) - 1) if member.result is not None else 0
            self.cache.kept(member.kept, self.seed, after=member.document if own else None,
                            after_tokens=self.kept_after if own else 0, answer_tokens=answer)
        self.cache.close(member.document)
