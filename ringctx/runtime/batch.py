"""Many sequences decoded together: one step for every running question, over split documents.

A served document is asked many questions at once. Decode is memory-bound: each step of an answer
reads its document's whole KV cache, so B answers decoded one after another read it B times per
token. Here every running sequence advances in one step, and each decode rank reads each
document's rows once for all the queries on it:

    every decode rank holds        each document's slice (its rows, never written by a question)
                                   and, for each sequence, its OWN rows (question + answer so far),
                                   balanced over the decode ranks like the document's slices
    a question joins (JOIN)        its prefill over the decode ranks on top of the document's
                                   slices (cp_prefill, as Engine.generate's); its new rows are then
                                   moved from behind the document's rows into its own rows
    one step of B sequences (STEP) the layers once with B tokens (the matmuls see B rows); per
                                   layer on each decode rank:
                                     for each document: its rows once for all its sequences'
                                       queries (B_doc x Hq query rows in one pass: on CPUs inside
                                       the fused C step, FusedBatchStep; else attention_block)
                                     for each sequence: its own rows (the step's owner writes the
                                       token's K/V first), merged with the above by LSE
                                   ONE all-gather of the [B, Hq, D + 1] partials for the whole
                                   batch, merged exactly (Eq. 4), as ShardedDecoder does for one
    the leader                     final norm, LM head for the B tokens; each sequence samples
                                   with its own Sampler (its seed), stop strings, max tokens
    a sequence leaves (LEAVE)      its own rows are freed at once; the documents are untouched

Which rank stores a sequence's next token follows ShardedDecoder's rule (the fewest rows of that
sequence, document rows included; ties round-robin), so a sequence's rows lie where they would lie
were it decoded alone, and its logits equal its lone decode's up to float rounding (the split of a
rank's rows into the document's and its own adds one exact LSE merge).

`BatchDecoder` is one decode rank's part (commands.BATCH_*); `Batch` (engine/handles.py) is rank
0's handle: it sends the commands, runs its own part, and drives each sequence's `Generation`
(model/generate.py) with the step's logits (`Generation.next_input` / `accept`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..attention import PartialAccumulator
from ..attention.spans import query_heads
from ..model import KVCache
from ..model.kvcache import copy_rows
from ..model.decode_step import AttentionSource, FusedBatchStep, step_logits
from ..model.transformer import HybridAttend
from ..parallel.comm import rank_and_world
from .decode import merge_across_ranks, step_owner
from .document import Document
from .failures import maybe_die
from .prefill import cp_prefill
from .shm_exchange import ShmExchange, shm_supported

ANSWER_ROOM_ROWS = 64
"""Rows a sequence's own slice keeps free on each rank beyond its question (it grows as needed)."""


@dataclass
class BatchSequence:
    """One decode rank's part of one sequence in the batch."""

    id: int
    document: Document | None
    """The document it asks about (its rows are read, never written), or None."""
    own: KVCache
    """This rank's own rows of the sequence (its question and answer so far), positions kept."""
    rows: list[int]
    """Every decode rank's rows of this sequence, document rows included (where the next token goes)."""
    length: int
    """Tokens of the whole sequence so far: the next token's global position."""
    steps: int = 0

    def owner(self) -> int:
        """The decode rank that stores the next token's K/V: a lone decode's rule (`step_owner`)."""
        return step_owner(self.rows, self.steps)


class BatchDecoder:
    """This decode rank's part of every sequence decoded together (one per rank: RankState.batch).

    Call `join`, `step` and `leave` on every decode rank alike, in the same order (join and step
    are collective over `group`; leave is not).

    Args:
        model: the Transformer (this rank's TP shard of it).
        group: the decode ranks of this TP index ("local" or None for one rank alone).
        timeout_s: how long a merge waits for a rank that stops answering.
        fused: run the layers in the fused CPU kernel where it applies (False: PyTorch's ops).
    """

    def __init__(self, model, group, timeout_s: float = 300.0, *, fused: bool = True):
        self.model, self.group, self.timeout_s = model, group, timeout_s
        # the layers of a step in one C call where the kernel applies (else PyTorch, layer by layer)
        self._fused = FusedBatchStep.build(model) if fused else None
        self.rank, self.world = rank_and_world(group)
        self.sequences: dict[int, BatchSequence] = {}
        self._shm: ShmExchange | None = None
        self._shm_batch = 0  # sequences the shared buffer has room for
        self.steps = 0  # batch steps run (the RINGCTX_TEST_KILL hook's "decode<N>" counts them)

    # -- joining and leaving ------------------------------------------------------------------
    def join(self, sequence_id: int, document: Document | None, token_ids: torch.Tensor, config,
             kv_dtype: str) -> torch.Tensor:
        """Prefill a sequence's question [T] on top of `document` (or of nothing) into its own rows;
        the float32 logits [vocab] of its last token (on every rank). Collective.

        config: the PrefillConfig of a prefill over the decode ranks (decode_room is ignored);
        kv_dtype: the storage of a sequence without a document (with one: the document's)."""
        if sequence_id in self.sequences:
            raise ValueError(f"sequence {sequence_id} is already in the batch")
        model = self.model
        lent = None
        if document is not None:
            base, start = document.rewind(), document.rows
            if document.borrowed:  # the rows its prefill writes past the view are another document's
                lent = LentRows(base, start, int(token_ids.numel()) + 1)
        else:
            base = KVCache.for_model(model.config, 1, dtype=model.dtype, device=model.device, kv_dtype=kv_dtype,
                                     sliced=True)
            start = 0
        config = replace(config, decode_room=0, kv_dtype=base.kv_dtype)
        result = cp_prefill(model, token_ids, config, group=self.group, shard=base)
        cache = result.cache
        if document is not None:  # the question's rows (and a hybrid's states) leave the document's cache at once
            own = split_off(cache, start, room=ANSWER_ROOM_ROWS, states=document.start_states())
            if lent is not None:
                lent.give_back()
                document.borrowed = cache is base  # a grown cache is its own copy
            document.cache = cache
        else:
            own = cache.grown(cache.length + ANSWER_ROOM_ROWS)
        length = (document.length if document is not None else 0) + int(token_ids.numel())
        self.sequences[sequence_id] = BatchSequence(sequence_id, document, own,
                                                    list(result.stats.decode_slice_rows_per_rank), length)
        return result.logits

    def leave(self, sequence_id: int) -> None:
        """Forget a sequence: its own rows are freed (not collective; unknown ids are ignored)."""
        self.sequences.pop(sequence_id, None)

    def keep(self, sequence_id: int, token_ids: torch.Tensor, new_id: int | None, room: int,
             own_only: bool = False) -> Document:
        """The sequence's rows kept as a document (a conversation's next turn asks about it), this
        rank's part of them: its document's rows and its own rows (question and answer so far).

        token_ids: the sequence's tokens after its document whose K/V its rows hold (its question,
        then the answer's tokens fed back; the last sampled token has no row and is not given).
        new_id: the new document's id, or None to extend the sequence's document in place (only
        when no other sequence reads it: its rows would grow under them); room: rows kept free.
        own_only: the new document holds only the sequence's own rows (positions after its
        document's; `joined_rows` puts the two together when a next turn needs them), no copy.
        Not collective: every decode rank keeps its own rows."""
        s = self.sequences[sequence_id]
        document = s.document
        before = document.length if document is not None else 0
        if int(token_ids.numel()) != s.length - before:
            raise ValueError(f"sequence {sequence_id} holds {s.length - before} tokens after its document, "
                             f"{int(token_ids.numel())} given")
        if own_only:
            return Document(cache=s.own, token_ids=token_ids.clone(), id=new_id)
        base = document.rewind() if document is not None else None
        if new_id is None:
            if document is None:
                raise ValueError("a sequence without a document has none to extend: give the new document an id")
            if document.borrowed:
                raise ValueError("the document is a view of another one's rows: keep this one as a new document")
            if any(o is not s and o.document is document for o in self.sequences.values()):
                raise ValueError("another sequence reads the document: keep this one as a new document")
            cache = append_rows(base, s.own, room)
            document.cache, document.rows = cache, cache.length
            document.token_ids = torch.cat([document.token_ids, token_ids.to(document.token_ids.dtype)])
            document.keep_states()
            return document
        cache = joined_rows(base, s.own, room)
        tokens = token_ids if document is None else torch.cat([document.token_ids, token_ids])
        if document is None:
            return Document(cache=cache, token_ids=tokens, id=new_id)
        return Document(cache=cache, token_ids=tokens, question_prefix=document.question_prefix,
                        question_suffix=document.question_suffix, metadata=dict(document.metadata), id=new_id,
                        dropped_unseen=document.dropped_unseen)

    # -- one step -----------------------------------------------------------------------------
    def step(self, sequence_ids: list[int], tokens: list[int]) -> torch.Tensor | None:
        """Feed tokens[i] to sequence sequence_ids[i], all in one step; float32 logits [B, vocab] of
        their next positions on the group's first rank (every TP rank of it), None elsewhere."""
        missing = [i for i in sequence_ids if i not in self.sequences]
        if missing or len(sequence_ids) != len(tokens) or len(set(sequence_ids)) != len(sequence_ids):
            raise ValueError(f"a batch step needs one token per running sequence, each once (unknown: {missing})")
        self.steps += 1
        maybe_die(rank_and_world(None)[0], f"decode{self.steps}")  # tests only
        model = self.model
        seqs = [self.sequences[i] for i in sequence_ids]
        owners = [s.owner() for s in seqs]
        for s, owner in zip(seqs, owners):
            if owner == self.rank and s.own.length >= s.own.max_tokens:
                s.own = s.own.grown(s.own.max_tokens + max(ANSWER_ROOM_ROWS, s.own.max_tokens // 8))
        writes = [s.own.length if owner == self.rank else None for s, owner in zip(seqs, owners)]
        by_document: dict[int, tuple[Document, list[int]]] = {}
        for i, s in enumerate(seqs):
            if s.document is not None:
                by_document.setdefault(id(s.document), (s.document, []))[1].append(i)
        one_document, members_of_one = next(iter(by_document.values()), (None, []))
        self._ensure_exchange(len(seqs))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            softmax = model.layer_softmax(layer)  # windowed layers see rows by position
            B, H, D = q.shape[0], query_heads(q, softmax), q.shape[2]  # dual chunk q: three versions per head
            if len(by_document) == 1 and len(members_of_one) == B and one_document.rows:
                # every sequence asks the one document (ask_many): its result is the partial as is
                o, l = one_document.cache.attend_rows(layer, q, one_document.rows, softmax=softmax,
                                                      q_positions=positions)
                out, lse = o.float(), l
            else:
                out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
                lse = torch.full((H, B), float("-inf"), dtype=torch.float32, device=q.device)
                for document, members in by_document.values():  # the document's rows once for its queries
                    if document.rows:
                        o, l = document.cache.attend_rows(layer, q[members], document.rows, softmax=softmax,
                                                          q_positions=[positions[i] for i in members])
                        out[members], lse[:, members] = o.float(), l
            own_out = torch.zeros_like(out)  # then each sequence's own rows, merged in once for all
            own_lse = torch.full_like(lse, float("-inf"))
            for i, (s, row) in enumerate(zip(seqs, writes)):
                if row is not None:
                    s.own.update(layer, row, k[i:i + 1], v[i:i + 1])
                keys = s.own.length + int(row is not None)
                if keys:
                    o, l = s.own.attend_rows(layer, q[i:i + 1], keys, softmax=softmax, q_positions=positions[i:i + 1])
                    own_out[i], own_lse[:, i] = o[0].float(), l[:, 0]
            PartialAccumulator.over(out, lse).add(own_out, own_lse)
            merged = merge_across_ranks(out, lse, self.world, self.group, self._shm, with_lse=True)
            return softmax.finish(*merged).to(q.dtype)

        def mix_linear(layer: int, module, x: torch.Tensor) -> torch.Tensor:
            # each sequence's own state (in its own rows' cache), replicated on every decode rank
            y, after = module.step_many(x, [s.own.linear_states[layer] for s in seqs])
            for s, state in zip(seqs, after):
                s.own.linear_states[layer] = state
            return y

        positions = [s.length for s in seqs]
        for s, row in zip(seqs, writes):
            if row is not None and s.own.positions is not None:  # first: windowed layers read rows by position
                s.own.positions[row] = s.length
        with torch.inference_mode():
            fused = self._fused_sources(seqs, writes, by_document)
            if fused is not None:  # every layer and its attention in one C call
                documents, own = fused
                merge = None if self.world == 1 else self._merge
                x = self._fused(tokens, positions, documents, own, merge)
            else:
                x = model.embed(torch.tensor(tokens, dtype=torch.long, device=model.device))
                at = torch.tensor(positions, dtype=torch.long, device=model.device)
                rope = model.rope(at, sequence_end=at + 1)  # each sequence's own step (LongRoPE)
                layers_attend = HybridAttend(attend, mix_linear) if model.config.has_linear else attend
                with model.ep.replicated_rows():  # every decode rank runs the same rows (model/expert_parallel.py)
                    for index, block in enumerate(model.layers):
                        x = block.forward(x, rope, layers_attend, index)
            logits = step_logits(model, x) if self.rank == 0 else None
        for s, owner, row in zip(seqs, owners, writes):
            if row is not None:
                if s.own.positions is not None:
                    s.own.positions[row] = s.length
                s.own.length = row + 1
            s.rows[owner] += 1
            s.length += 1
            s.steps += 1
        return logits

    def _fused_sources(self, seqs: list[BatchSequence], writes: list[int | None],
                       by_document: dict) -> tuple[list[AttentionSource], list[AttentionSource]] | None:
        """The fused step's attention sources for this step (each document's rows for its
        sequences, then each sequence's own rows), or None where the fused step does not apply."""
        if self._fused is None or len(seqs) > self._fused.max_rows:
            return None
        documents = [AttentionSource(document.cache, members, document.rows)
                     for document, members in by_document.values() if document.rows]
        own = []
        for i, (s, row) in enumerate(zip(seqs, writes)):
            keys = s.own.length + int(row is not None)
            if keys:
                own.append(AttentionSource(s.own, [i], keys, row))
        if not all(self._fused.takes(source.cache) for source in documents + own):
            return None
        return documents, own

    def own_rows(self) -> int:
        """Own rows of every sequence on this rank (what the batch holds besides the documents)."""
        return sum(s.own.length for s in self.sequences.values())

    def _merge(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's partials (out [B, Hq, D], lse [Hq, B] float32) merged exactly: one exchange; with
        the merged lse (a layer with sink logits applies them to the merged result)."""
        return merge_across_ranks(out, lse, self.world, self.group, self._shm, with_lse=True)

    def _ensure_exchange(self, batch: int) -> None:
        """The shared-memory exchange with room for `batch` sequences (collective when it grows:
        every rank sees the same batch sizes, so every rank grows it at the same step)."""
        if self.world == 1 or not shm_supported(self.model.device) or batch <= self._shm_batch:
            return
        size = max(8, 1 << (batch - 1).bit_length())
        cfg = self.model.config
        self._shm = ShmExchange.create(size * cfg.n_heads * (cfg.widest_head_dim + 1), self.group, self.timeout_s)
        self._shm_batch = size if self._shm is not None else 1 << 62  # None: the process group, for good


class LentRows:
    """Rows `start` .. `start + n - 1` of a cache's storage, copied aside, to be put back (`give_back`)
    after a write that borrows them (a question's prefill on a view of a longer document)."""

    def __init__(self, cache: KVCache, start: int, n: int):
        stop = min(cache.max_tokens, start + n)
        self.places = [(rows, rows.clone()) for layer in range(cache.n_layers)
                       for rows in cache.stored_rows(layer, start, stop)] if stop > start else []

    def give_back(self) -> None:
        for storage, rows in self.places:
            storage.copy_(rows)


def own_storage(document: Document, room: int) -> None:
    """Give a borrowed document (a view) a copy of its rows of its own, with `room` rows free: for
    writers that keep what they write there (an answer decoded alone, an extension)."""
    if document.borrowed:
        document.cache = prefix_rows(document.rewind(), document.length, room)
        document.borrowed = False


def append_rows(cache: KVCache, rows: KVCache, room: int) -> KVCache:
    """`cache` (grown when it lacks the room) with `rows`' valid rows after its own, positions kept;
    `room` rows stay free after them. An in-order cache stays in order (rows must then continue it)."""
    n, start = rows.length, cache.length
    if cache.positions is None and not torch.equal(rows.row_positions(), torch.arange(start, start + n)):
        raise ValueError("rows appended to a cache in sequence order must continue it")
    cache = cache.grown(start + n + room)
    copy_rows(cache, start, rows, 0, n)
    if cache.positions is not None:
        cache.positions[start:start + n] = rows.row_positions()
    cache.length = start + n
    if rows.linear_states is not None:  # a hybrid's states stand after the appended rows: theirs
        cache.linear_states = [None if st is None else st.clone() for st in rows.linear_states]
    return cache


def joined_rows(first: KVCache | None, rows: KVCache, room: int) -> KVCache:
    """A new cache of `first`'s valid rows (None: none) then `rows`', positions kept, `room` rows free."""
    like = first if first is not None else rows
    total = (first.length if first is not None else 0) + rows.length
    sliced = first is None or first.positions is not None
    out = like.empty_like(total + max(room, 1), sliced=sliced, kept=first.kept if first is not None else None)
    if first is not None:
        out.spans = first.spans
        copy_rows(out, 0, first, 0, first.length)
        if sliced:
            out.positions[:first.length] = first.row_positions()
        out.length = first.length
    return append_rows(out, rows, room)


def prefix_rows(cache: KVCache, tokens: int, room: int) -> KVCache:
    """A new cache of `cache`'s rows at positions below `tokens`, in their order, positions kept
    (`room` rows free): a document cut back to its first `tokens` tokens."""
    if not cache.serves_prefix(tokens):
        raise ValueError(f"the document's windowed or chunked layers keep only the rows its next tokens see, "
                         f"not those of its first {tokens} tokens: ingest it again with drop_unseen=False "
                         "to take prefixes of it")
    if cache.linear_states is not None and cache.length and int(cache.row_positions().max()) >= tokens:
        raise ValueError(f"a prefix of {tokens} tokens of a hybrid model's document: its linear-attention layers "
                         "keep their state at the document's end only, not at each token; ingest those tokens as "
                         "a document of their own")
    positions = cache.row_positions()
    keep = torch.nonzero(positions < tokens).flatten()
    n = int(keep.numel())
    out = cache.empty_like(n + max(room, 1), sliced=cache.positions is not None,
                           kept=cache.kept if cache.trimmed else None)
    out.spans = cache.spans
    if n == 0 or int(keep[-1]) == n - 1:  # the first n rows: one copy each (always, once rows were dropped)
        copy_rows(out, 0, cache, 0, n)
    else:
        for dst, src in zip(out.storage_tensors(), cache.storage_tensors()):
            torch.index_select(src, 0, keep.to(src.device), out=dst[:n])
    if out.positions is not None:
        out.positions[:n] = positions[keep]
    out.length = n
    return out


def split_off(cache: KVCache, start: int, room: int = 0, states: list | None = None) -> KVCache:
    """Move rows start..length-1 of `cache` into a new cache (positions kept, `room` rows free) and
    cut `cache` back to `start` rows. A hybrid's linear states (after the moved rows) go with them;
    `cache` then takes `states`, its linear states at `start` (`Document.start_states`)."""
    n = cache.length - start
    # small pages: a question's rows grow a token at a time, and a 2 MiB page's first touch stalled
    # the whole batch's step (ringctx.host_memory)
    own = cache.empty_like(n + max(room, 1), sliced=True, small_pages=True)
    copy_rows(own, 0, cache, start, n)
    own.positions[:n] = cache.row_positions()[start:start + n]
    own.length = n
    if cache.linear_states is not None:
        own.linear_states = cache.linear_states
    cache.truncate(start, states)
    return own
