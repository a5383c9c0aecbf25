"""The engine's commands: every job the ranks of an engine run together, and what each runs on a rank.

A public `Engine` method (engine/api.py) is one or more of these commands. In a spawned job rank 0
sends each command's name and fields to the workers concerned over their pipes (engine/workers.py) and runs the
same function itself; under torchrun every rank calls the Engine method and runs the function
directly. Either way, every rank concerned runs the same functions in the same order, so their
collectives match:

    Engine.prefill / ingest  ->  PREFILL_START, PREFILL_CHUNK x chunks, PREFILL_FINISH  ->  runtime/prefill.py PrefillRun
                                 (PREFILL_CHUNK with a layer count: a slice of a chunk)
    Engine.extend            ->  EXTEND         ->  cp_prefill over the decode ranks, on a document's slices
    Engine.generate / ask    ->  ANSWER_START, ANSWER_STEP x tokens, ANSWER_END          ->  runtime/decode.py ShardedDecoder
                                 (under torchrun, where every rank calls generate: ANSWER_FOLLOW on the followers)
    Engine.batch / ask_many  ->  BATCH_JOIN per question, BATCH_STEP per step of every sequence, BATCH_LEAVE
                                 (BATCH_KEEP before it: the sequence's rows kept as a document)
                                                                                 ->  runtime/batch.py BatchDecoder
    Engine.document_prefix   ->  PREFIX         ->  a document's first tokens as a new document
    Engine.join_documents    ->  JOINED         ->  a document and a kept turn's own rows as one document
    Engine.cut_document      ->  CUT            ->  a document cut back to its first tokens, in place
    Engine.save_document     ->  SAVE           ->  runtime/documents.py save_document_slices
    Engine.start_save        ->  SAVE_START, SAVE_FINISH   (the slices written on a thread between them)
    Engine.load_document     ->  LOAD           ->  runtime/documents.py load_document_slices
    Engine.drop_document     ->  DROP
    Engine.document_rows     ->  ROWS
    Engine.whole_cache       ->  GATHER         ->  runtime/handoff.py gather_in_order
    Engine.move_document_pages -> MOVE_PAGES    ->  model/kvcache.py KVCache.huge_page_steps
    Engine(hardware="measured") -> MEASURE_HARDWARE at start-up -> runtime/measure.py measure_hardware

A prefill is three commands so that a scheduler can run other commands between two of its
chunks (a decode step of an answer, a chunk of another prefill); an answer is one command per
token for the same reason. The leader (the first decode rank) samples each token and its
decoder's `step(token)` hands it to the followers, whose part of each step is ANSWER_STEP.

Each function takes this rank's `RankState` and the command's fields (ints, strings and bytes:
the wire format between an engine's own processes), and on the calling rank also objects that
never travel (`local`: a callback, the caller's cache or Document). A ValueError means bad input,
raised on every rank alike before any communication; the engine stays usable.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..model import KVCache
from ..model.tensor_parallel import TensorParallel, gather_kv_heads
from ..parallel.comm import agree_across_ranks, all_gather_bytes, all_gather_ints
from ..planning.hardware import HardwareProfile
from ..units import fmt_bytes
from .batch import BatchDecoder, append_rows, own_storage, prefix_rows
from .decode import ShardedDecoder
from .document import Document
from .documents import (DROPPED_UNSEEN_KEY, ENGINE_CONFIG_KEY, PendingSave, layer_heads, load_document_slices,
                        start_document_save)
from .failures import with_test_hook
from .handoff import gather_in_order
from .measure import measure_hardware
from .memory_check import available_memory, memory_problem
from .checkpoint import remove_checkpoint
from .prefill import PrefillRun, cp_prefill
from .resume import open_checkpointed_prefill
from .rank_state import RankState


@dataclass(frozen=True)
class Command:
    """One kind of job the ranks of an engine run together."""

    name: str
    """What rank 0 sends (the first field of the message)."""
    run: Callable[..., Any]
    """run(state, *fields, **local): this rank's part."""
    decode_only: bool
    """Only the decode ranks (every TP rank of them) take part; the others never hear of it."""


def ids_from_bytes(data: bytes) -> torch.Tensor:
    """Token ids as they travel in a command (int64 bytes)."""
    return torch.frombuffer(bytearray(data), dtype=torch.long) if data else torch.empty(0, dtype=torch.long)


def ids_to_bytes(ids: torch.Tensor) -> bytes:
    return ids.cpu().contiguous().numpy().tobytes()


# ------------------------------------------------------------------------------------------ prefill
def prefill_start(state: RankState, prefill_id: int, ids: bytes, chunk_tokens: int, strategy: str, decode_room: int,
                  trace: bool, cached: int, keep: int | None, drop_unseen: bool = False, checkpoint: str = "",
                  restart: bool = False, keep_checkpoint: bool = False, extra: str = "{}", *,
                  cache: KVCache | None = None,
                  cache_token_ids=None, on_chunk=None) -> PrefillRun:
    """Check the memory, agree on the inputs and plan the shards of a prefill over every CP rank.

    checkpoint: a directory where every rank appends its rows of each chunk as it completes, and
    from which the prefill resumes when it holds chunks of the same tokens (runtime/resume.py;
    `restart`: start over whatever it holds). It goes when the prefill finishes unless
    `keep_checkpoint` (the caller removes it once the document is saved). extra: JSON the
    checkpoint records (a document's chat frame)."""
    token_ids = ids_from_bytes(ids)
    config = state.prefill_config(chunk_tokens, strategy, decode_room, trace)
    _check_memory(state, token_ids, cached, config, drop_unseen)
    hook = with_test_hook(on_chunk, state.rank)
    if checkpoint:
        if cache is not None or cached:
            raise ValueError("a checkpointed prefill starts from nothing (a document's ingest), not on top of a cache")
        world_group = None if state.world_size > 1 else "local"
        run, plan = open_checkpointed_prefill(
            state.model, token_ids, config, directory=checkpoint, restart=restart, extra=json.loads(extra),
            drop_unseen=drop_unseen, cp_group=state.mesh.cp_group, cp_rank=state.mesh.cp_rank,
            cp_size=state.settings.cp_size, tp_rank=state.mesh.tp_rank, world_group=world_group,
            global_rank=state.rank, world_size=state.world_size, on_chunk=hook)
        run.resume_plan, run.checkpoint_dir, run.keep_checkpoint = plan, checkpoint, keep_checkpoint
    else:
        run = PrefillRun(state.model, token_ids, config, group=state.mesh.cp_group, cache=cache,
                         cache_token_ids=cache_token_ids, on_chunk=hook, drop_unseen=drop_unseen)
        run.resume_plan = None
    run.keep = keep  # the document id to register when it finishes (None: a plain prefill)
    state.prefills[prefill_id] = run
    return run


def prefill_chunk(state: RankState, prefill_id: int, layers: int = 0):
    """The next chunk of a prefill (ChunkStats), or with layers > 0 the next `layers` layers of it
    (None until the chunk's last layer has run)."""
    return state.prefills[prefill_id].step(layers or None)


def prefill_finish(state: RankState, prefill_id: int):
    """Hand the prefill's KV cache off to the decode ranks; keep it as a document when asked (PrefillResult)."""
    run = state.prefills.pop(prefill_id)
    result = run.finish()
    if run.resume_plan is not None and not run.keep_checkpoint and state.rank == 0:
        remove_checkpoint(run.checkpoint_dir)  # every rank's writer closed before finish() returned
    if run.keep is not None and result.cache is not None:
        result.document = Document(cache=result.cache, token_ids=result.token_ids, stats=result.stats, id=run.keep,
                                   dropped_unseen=run.drop_unseen)
        state.documents[run.keep] = result.document
    return result


def prefill_cancel(state: RankState, prefill_id: int) -> None:
    """Forget a prefill that will not finish (no message: every rank drops its part). Its
    checkpoint stays as far as it got: a later run of the same ingest resumes from it."""
    run = state.prefills.pop(prefill_id, None)
    if run is not None and run.checkpoint is not None:
        run.checkpoint.close()


def _check_memory(state: RankState, token_ids, cached: int, config, drop_unseen: bool) -> None:
    """Refuse a prefill the memory cannot hold, on every rank alike (see memory_check.memory_problem)."""
    s = state.settings
    torchrun = state.mode == "torchrun"
    local_ranks = s.ranks_per_host if torchrun else state.world_size
    local_decode = not torchrun or state.leader // s.ranks_per_host == state.rank // s.ranks_per_host
    problem = memory_problem(state.model, int(token_ids.numel()), cached, config.chunk_tokens, s.cp_size,
                             state.mesh.cp_rank, config.decode_rank, config.decode_room, local_ranks=local_ranks,
                             local_decode=local_decode, decode_ranks=config.decode_ranks, kv_dtype=config.kv_dtype,
                             drop_unseen=drop_unseen and state.model.device.type == "cpu")
    if state.world_size > 1:
        agree_across_ranks("prefill", problem, "memory check")
    elif problem:
        raise ValueError(f"prefill: {problem}")


# ------------------------------------------------------------------------------------------ extend
def extend(state: RankState, document_id: int, ids: bytes, decode_room: int, *, document: Document | None = None,
           on_chunk=None):
    """Prefill tokens on top of a document over the decode ranks, each on its own slice (PrefillStats)."""
    document = document or state.document(document_id)
    token_ids = ids_from_bytes(ids)
    own_storage(document, int(token_ids.numel()) + decode_room)  # a view's rows past it are another document's
    config = state.decode_prefill_config(document.cache.kv_dtype, decode_room)
    result = cp_prefill(state.model, token_ids, config, group=state.decode_group, shard=document.rewind(),
                        on_chunk=on_chunk)
    document.cache, document.rows = result.cache, result.cache.length
    document.token_ids = torch.cat([document.token_ids, token_ids])
    document.keep_states()
    return result.stats


# ------------------------------------------------------------------------------------------ answers
def answer_decoder(state: RankState, document: Document, answer_room: int) -> ShardedDecoder:
    """This decode rank's decoder of `document` (its slice cut back to the document); collective.
    answer_room: rows its slice keeps free after the question for the answer (`answer_room`)."""
    own_storage(document, answer_room)  # the answer's rows stay after the document's: not in another's storage
    config = state.decode_prefill_config(document.cache.kv_dtype, answer_room)
    return ShardedDecoder(state.model, document.rewind(), document.length, state.decode_group, config,
                          timeout_s=state.settings.timeout_s, control_group=state.control_group, leader=state.leader)


def answer_start(state: RankState, answer_id: int, document_id: int, ids: bytes, room: int) -> None:
    """A follower's part of an answer's start: the question's prefill over the decode ranks."""
    document = state.document(document_id)
    decoder = answer_decoder(state, document, room)
    decoder.prefill(ids_from_bytes(ids))
    state.answers[answer_id] = (document, decoder)


def answer_step(state: RankState, answer_id: int) -> None:
    """A follower's part of one decode step (the leader's token arrives by broadcast)."""
    state.answers[answer_id][1].follow_step()


def answer_end(state: RankState, answer_id: int) -> None:
    """A follower's part of an answer's end: the leader's close, then the document keeps the (grown) slice."""
    document, decoder = state.answers.pop(answer_id)
    decoder.follow_step()
    document.cache = decoder.cache


def follow_answer(state: RankState, document_id: int, ids: torch.Tensor, room: int, *,
                  document: Document | None = None) -> None:
    """A follower under torchrun, where no command is sent (every rank calls Engine.generate): the
    question's prefill, then every step the leader broadcasts, until it ends the answer."""
    document = document or state.document(document_id)
    decoder = answer_decoder(state, document, room)
    decoder.prefill(ids)
    decoder.follow()
    document.cache = decoder.cache


def answer_room(max_new_tokens: int, decode_ranks: int) -> int:
    """Rows each decode rank's slice keeps free after a question for an answer of max_new_tokens:
    its share of them (the owner rule keeps the slices level) and two for the slices' unevenness,
    so that no slice grows mid-answer (growing copies the whole slice, a document's included)."""
    return -(-max_new_tokens // decode_ranks) + 2


# ------------------------------------------------------------------------------------------ batches
def batch_decoder(state: RankState) -> BatchDecoder:
    """This decode rank's part of the sequences decoded together (made at first use)."""
    if state.batch is None:
        state.batch = BatchDecoder(state.model, state.decode_group, state.settings.timeout_s)
    return state.batch


def batch_join(state: RankState, sequence_id: int, document_id: int, ids: bytes, *,
               document: Document | None = None) -> torch.Tensor:
    """A question joins the batch: its prefill over the decode ranks into its own rows; the float32
    logits [vocab] of its last token. document_id -1: a sequence without a document."""
    if document is None and document_id >= 0:
        document = state.document(document_id)
    config = state.decode_prefill_config(state.settings.kv_dtype, 0)
    return batch_decoder(state).join(sequence_id, document, ids_from_bytes(ids), config, state.settings.kv_dtype)


def batch_step(state: RankState, sequence_ids: bytes, tokens: bytes) -> torch.Tensor | None:
    """One decode step of every sequence named (the tokens in the same order); logits [B, vocab]
    on the leader (every TP rank of the first decode rank), None elsewhere."""
    return batch_decoder(state).step(ids_from_bytes(sequence_ids).tolist(), ids_from_bytes(tokens).tolist())


def batch_leave(state: RankState, sequence_id: int) -> None:
    """A sequence leaves the batch: its own rows are freed (no message between ranks)."""
    batch_decoder(state).leave(sequence_id)


def batch_keep(state: RankState, sequence_id: int, ids: bytes, new_id: int, room: int, own_only: bool) -> Document:
    """A sequence's rows kept as a document before it leaves (BatchDecoder.keep): new_id -1 extends
    its document in place. No message between ranks: each keeps its own rows."""
    document = batch_decoder(state).keep(sequence_id, ids_from_bytes(ids), None if new_id < 0 else new_id, room,
                                         own_only=bool(own_only))
    state.documents[document.id] = document
    return document


def document_cut(state: RankState, document_id: int, tokens: int, *, document: Document | None = None) -> None:
    """Cut a document back to its first `tokens` tokens in place: each decode rank keeps its rows at
    those positions (sorted by position first: no question reads it), nothing copied."""
    document = document or state.document(document_id)
    if not 0 < tokens <= document.length:
        raise ValueError(f"a cut to {tokens} tokens of a {document.length}-token document")
    cache = document.rewind().sorted_by_position()
    cache.truncate(int(torch.searchsorted(cache.row_positions(), torch.tensor(int(tokens)))))
    document.cache, document.rows = cache, cache.length
    document.token_ids = document.token_ids[:tokens].clone()


def documents_joined(state: RankState, first_id: int, second_id: int, first_tokens: int, tokens: int, new_id: int,
                     room: int, *, first: Document | None = None, second: Document | None = None) -> Document:
    """A new document of `first`'s first `first_tokens` tokens then `second`'s (which continues them:
    a kept turn's own rows), `tokens` tokens in all: each decode rank joins its own rows (no message)."""
    first, second = first or state.document(first_id), second or state.document(second_id)
    if not 0 < first_tokens <= first.length or not first_tokens < tokens <= first_tokens + second.length:
        raise ValueError(f"{tokens} tokens of {first_tokens} of a {first.length}-token document and a "
                         f"{second.length}-token one after them")
    tail = prefix_rows(second.rewind(), tokens, 0)
    cache = append_rows(prefix_rows(first.rewind(), first_tokens, tail.length + room), tail, room)
    token_ids = torch.cat([first.token_ids[:first_tokens], second.token_ids[:tokens - first_tokens]])
    joined = Document(cache=cache, token_ids=token_ids, question_prefix=first.question_prefix,
                      question_suffix=first.question_suffix, metadata=dict(first.metadata), id=new_id,
                      dropped_unseen=first.dropped_unseen)
    state.documents[new_id] = joined
    return joined


# ------------------------------------------------------------------------------------------ prefixes
def document_prefix(state: RankState, document_id: int, tokens: int, new_id: int, room: int, view: bool, *,
                    document: Document | None = None) -> Document:
    """A new document of a document's first `tokens` tokens, each decode rank from its own rows (no
    message between ranks): a copy of those rows, or with `view` a view of them (no copy: its rows
    sorted by position first when no question reads it, else copied after all)."""
    document = document or state.document(document_id)
    if not 0 < tokens <= document.length:
        raise ValueError(f"a prefix of {tokens} tokens of a {document.length}-token document")
    base = document.rewind()
    if view and not base.in_position_order():
        readers = state.batch is not None and any(s.document is document for s in state.batch.sequences.values())
        if not readers:  # sorted once (a loaded or handed-off slice); what questions read is never moved
            document.cache = base = base.sorted_by_position()
    borrowed = view and base.in_position_order()
    cache = base.view_below(tokens) if borrowed else prefix_rows(base, tokens, room)
    prefix = Document(cache=cache, token_ids=document.token_ids[:tokens].clone(),
                      question_prefix=document.question_prefix, question_suffix=document.question_suffix,
                      metadata=dict(document.metadata), id=new_id, borrowed=borrowed,
                      dropped_unseen=document.dropped_unseen)
    state.documents[new_id] = prefix
    return prefix


# ------------------------------------------------------------------------------------------ start-up
def measure(state: RankState) -> HardwareProfile:
    """Every rank measures this machine with the others (runtime/measure.py) and decides with the
    profile from now on; every rank builds the same one from the same all-gathered numbers."""
    profile = measure_hardware(state)
    state.settings = dataclasses.replace(state.settings, hardware=profile)
    return profile


# ------------------------------------------------------------------------------------------ documents
def save(state: RankState, document_id: int, path: str, *, document: Document | None = None) -> None:
    """Every rank of the decode host writes its own rows of its own KV heads (a replicated KV head
    by the first TP rank that holds it): nothing is gathered, the writes run in parallel."""
    _start_save(state, document_id, path, document).finish()


def save_start(state: RankState, document_id: int, path: str, save_id: int, *,
               document: Document | None = None) -> PendingSave:
    """`save`'s first half: this rank's slice is written on a thread while other commands run;
    SAVE_FINISH completes the document."""
    state.saves[save_id] = pending = _start_save(state, document_id, path, document)
    return pending


def save_finish(state: RankState, save_id: int) -> None:
    """Wait for this rank's slice; the leader writes the manifest and swaps the directory in."""
    state.saves.pop(save_id).finish()


def _start_save(state: RankState, document_id: int, path: str, document: Document | None) -> PendingSave:
    document = document or state.document(document_id)
    model, s = state.model, state.settings
    tp, full = model.tp, model.full_config
    heads = tp.kv_heads(full)
    # a TP rank writes unless an earlier one holds the same heads of every layer (replicated heads)
    mine = layer_heads(full, tp)
    writes = all(layer_heads(full, TensorParallel(tp.size, r)) != mine for r in range(tp.rank))
    writes = writes or full.has_linear  # each TP rank holds its own linear layers' heads of the states
    extra = {**document.frame, ENGINE_CONFIG_KEY: s.config}  # what made it, for whoever reads the manifest
    if document.dropped_unseen:
        extra[DROPPED_UNSEEN_KEY] = True
    return start_document_save(path, document.rewind(), document.token_ids, model, extra,
                               group=state.control_group, rank=state.decode_index * s.tp_size + tp.rank,
                               world=s.decode_ranks * s.tp_size, tp_size=s.tp_size, heads=heads, writes=writes)


def load(state: RankState, path: str, document_id: int, decode_room: int) -> Document:
    """This decode rank's slice of a saved document, in the engine's kv_dtype unless "model"."""
    s = state.settings
    on_host = s.decode_ranks * s.tp_size  # every TP rank of the decode ranks loads its heads' share
    local = on_host if state.mode != "torchrun" else min(on_host, s.ranks_per_host)
    cache, token_ids, extra = load_document_slices(
        path, state.model, group=state.decode_group, rank=state.decode_index, world=s.decode_ranks,
        room=decode_room, kv_dtype=s.kv_dtype if s.kv_dtype != "model" else None,
        memory_check=lambda rows, per_row: _slice_memory_problem(state.model, rows, per_row, local))
    extra.pop(ENGINE_CONFIG_KEY, None)  # the engine that made it, not a property of the document
    document = Document(cache=cache, token_ids=token_ids, question_prefix=extra.pop("question_prefix", ""),
                        question_suffix=extra.pop("question_suffix", ""), metadata=extra, id=document_id,
                        dropped_unseen=bool(extra.pop(DROPPED_UNSEEN_KEY, False)))
    state.documents[document_id] = document
    return document


def _slice_memory_problem(model, rows: int, bytes_per_row: int, local_ranks: int) -> str | None:
    """A one-line problem when `rows` KV rows (on each of `local_ranks` ranks sharing this memory) do not fit."""
    if os.environ.get("RINGCTX_MEMORY_CHECK", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from ..planning.memory import MEMORY_USABLE_FRACTION

    need = rows * bytes_per_row * local_ranks
    free, where = available_memory(model.device)
    if need <= free * MEMORY_USABLE_FRACTION:
        return None
    return (f"not enough memory to load the document: {local_ranks} decode rank(s) x {rows:,} KV rows need "
            f"{fmt_bytes(need)} but {where} has {fmt_bytes(free)} available; use more decode ranks on a host with "
            f"more memory (--decode-ranks), or an 8-bit KV cache (--kv-dtype fp8)")


def drop(state: RankState, document_id: int) -> None:
    """Free this rank's part of a document."""
    state.documents.pop(document_id, None)


def rows(state: RankState, document_id: int) -> list[int]:
    """KV rows of a document each decode rank holds now (its answers' rows included)."""
    length = state.document(document_id).cache.length
    return [r[0] for r in all_gather_ints([length], state.decode_group, state.settings.decode_ranks)]


def move_pages(state: RankState) -> int:
    """One 2 MiB page of this rank's document caches in small pages moved into a huge page
    (KVCache.huge_page_steps: a prefill writes its cache in small pages, whose first touch is cheap,
    and decode steps read huge pages faster). Returns the caches that were in small pages when it
    began, summed over every decode rank (each moves its own slices): 0 when nothing was left."""
    waiting = [d.cache for d in state.documents.values() if d.cache.small_pages]
    if state.page_mover is None and waiting:
        state.page_mover = waiting[0].huge_page_steps()
    if state.page_mover is not None:
        try:
            done = next(state.page_mover, StopIteration) is StopIteration
        except Exception:  # noqa: BLE001 - a speed-up only: the cache stays in small pages, the engine runs on
            done = True
        if done:
            state.page_mover = None
    s = state.settings
    return sum(r[0] for r in all_gather_ints([len(waiting)], state.control_group, s.decode_ranks * s.tp_size))


def gather(state: RankState, document_id: int) -> KVCache | None:
    """The document's whole KV cache in sequence order on the first decode rank (None elsewhere)."""
    document = state.document(document_id)
    model, n = state.model, state.settings.decode_ranks
    cache, group, rank = document.rewind(), state.decode_group, state.decode_index
    if n > 1:  # the slices in sequence order on the first decode rank (this TP rank's heads)
        mine = cache.row_positions().cpu().contiguous().numpy().tobytes()
        positions = [torch.frombuffer(bytearray(b), dtype=torch.long) for b in all_gather_bytes(mine, group, n)]
        out = KVCache.for_model(model.config, document.length, dtype=model.dtype, device=model.device,
                                kv_dtype=cache.kv_dtype) if rank == 0 else None
        gather_in_order(cache, out, positions, 0, rank, n, 0, group, free=False)
        if out is not None:
            out.length = document.length
        cache = out
    if state.settings.tp_size > 1 and rank == 0:  # then every head, on the leader
        cache = gather_kv_heads(cache, model)
    return cache if rank == 0 else None


# ------------------------------------------------------------------------------------------ the table
PREFILL_START = Command("prefill_start", prefill_start, decode_only=False)
PREFILL_CHUNK = Command("prefill_chunk", prefill_chunk, decode_only=False)
PREFILL_FINISH = Command("prefill_finish", prefill_finish, decode_only=False)
PREFILL_CANCEL = Command("prefill_cancel", prefill_cancel, decode_only=False)
EXTEND = Command("extend", extend, decode_only=True)
ANSWER_START = Command("answer_start", answer_start, decode_only=True)
ANSWER_STEP = Command("answer_step", answer_step, decode_only=True)
ANSWER_END = Command("answer_end", answer_end, decode_only=True)
ANSWER_FOLLOW = Command("answer_follow", follow_answer, decode_only=True)
BATCH_JOIN = Command("batch_join", batch_join, decode_only=True)
BATCH_STEP = Command("batch_step", batch_step, decode_only=True)
BATCH_LEAVE = Command("batch_leave", batch_leave, decode_only=True)
BATCH_KEEP = Command("batch_keep", batch_keep, decode_only=True)
PREFIX = Command("prefix", document_prefix, decode_only=True)
JOINED = Command("joined", documents_joined, decode_only=True)
CUT = Command("cut", document_cut, decode_only=True)
SAVE = Command("save", save, decode_only=True)
SAVE_START = Command("save_start", save_start, decode_only=True)
SAVE_FINISH = Command("save_finish", save_finish, decode_only=True)
LOAD = Command("load", load, decode_only=True)
DROP = Command("drop", drop, decode_only=True)
ROWS = Command("rows", rows, decode_only=True)
GATHER = Command("gather", gather, decode_only=True)
MOVE_PAGES = Command("move_pages", move_pages, decode_only=True)
MEASURE_HARDWARE = Command("measure_hardware", measure, decode_only=False)

COMMANDS: dict[str, Command] = {c.name: c for c in (
    PREFILL_START, PREFILL_CHUNK, PREFILL_FINISH, PREFILL_CANCEL, EXTEND, ANSWER_START, ANSWER_STEP, ANSWER_END,
    ANSWER_FOLLOW, BATCH_JOIN, BATCH_STEP, BATCH_LEAVE, BATCH_KEEP, PREFIX, JOINED, CUT, SAVE, SAVE_START, SAVE_FINISH, LOAD, DROP,
    ROWS, GATHER, MOVE_PAGES, MEASURE_HARDWARE)}
"""Every command by the name that travels: what a worker looks up for each message."""
