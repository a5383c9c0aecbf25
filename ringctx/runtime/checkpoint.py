"""Ingest checkpoints: every rank appends its rows of each chunk as the chunk completes, so that a
crash costs at most the chunk in flight, and a rerun resumes from the last chunk every rank wrote.

    X.ingest/
        ingest.json               what any resume must match: the model (fingerprint, weights
                                  digest, weights format), dtype, kv_dtype, the token ids' count and
                                  SHA-256, drop_unseen, the caller's `extra` (a document's chat frame)
        tokens.safetensors        token_ids [T] int64
        run-000/                  one run of the prefill on one mesh
            run.json              cp, tp, ep, chunk_tokens, base_tokens, strategy, rule,
                                  linear_exchange, attn_backend, and the hardware profile the
                                  per-chunk rule used (a resume decides its chunks by it)
            rank-00001-tp-000.kv      records appended, never rewritten: one safetensors blob per
                                  chunk of this rank's rows of it as stored (k.{layer}, v.{layer}
                                  [rows, Hkv, D], 8-bit scales, positions [rows]); CP rank 0's
                                  also the linear-attention states at the chunk's end (its TP
                                  rank's heads) and, for the last chunk, the last token's logits
            rank-00001-tp-000.jsonl   the journal: one JSON line per record once its blob is on
                                  disk (fsync), with its offset, size, SHA-256, rows, heads and
                                  the chunk's stats; a torn last line or blob is not a record
        run-001/                  a resume on another mesh or chunk size: its first record per
                                  rank ("base") holds that rank's share of the tokens done before,
                                  resliced as documents load on any number of ranks

Why the prefill ranks' rows, not the decode ranks': until the hand-off a token's rows live on the
rank that computed them, so writing them there moves no data, and a resume on the same mesh puts
back every rank's shard exactly as it was: the rest of the prefill, the hand-off, the document and
its answers are then bit-identical to an ingest that never stopped. On another mesh (or chunk
size) the tokens done are read back "as documents load" (runtime/documents.py, over the run's
records) and the prefill continues on top of them: exact within the usual tolerances, not bit-
identical (another mesh splits every later chunk differently). The directory must be one every
rank sees (one host, or a filesystem the hosts share).

The leader decides how to resume (`decide_resume`) from the files alone and tells every rank;
a mismatch of the model, dtype, KV dtype or tokens is one line, before any rank communicates.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import queue
import shutil
import sys
import threading

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from ..files import write_json_atomically
from ..model.kvfile import weights_digest
from .documents import FORMAT as DOCUMENT_FORMAT, file_sha256, layer_heads, linear_state_tensors
from .failures import hook_point, maybe_die

FORMAT = "ringctx-ingest/1"
HEADER = "ingest.json"
TOKENS = "tokens.safetensors"
RUN = "run.json"
SUFFIX = ".ingest"
WRITE_QUEUE_CHUNKS = 2
"""Chunks a rank's writer may hold before the prefill waits for it: memory stays bounded (two
chunks' rows) when the disk is slower than the chunks."""
MATCHED = ("cp", "tp", "ep", "chunk_tokens", "strategy", "rule", "linear_exchange", "attn_backend")
"""Settings of a run that a resume must share to continue it exactly (else it reslices)."""
TEST_DISK_FULL_ENV = "RINGCTX_TEST_DISK_FULL"
"""Tests only: "<rank>:chunk<N>" makes that rank's write of chunk N fail with ENOSPC."""


def checkpoint_path(document_path) -> str:
    """Where the ingest of a document saved at `document_path` keeps its checkpoint."""
    return os.path.abspath(os.fspath(document_path)).rstrip("/") + SUFFIX


def rank_name(cp_rank: int, tp_rank: int) -> str:
    return f"rank-{cp_rank:05d}-tp-{tp_rank:03d}"


def tokens_sha256(token_ids: torch.Tensor) -> str:
    return hashlib.sha256(token_ids.cpu().to(torch.long).contiguous().numpy().tobytes()).hexdigest()


def ingest_header(model, token_ids: torch.Tensor, kv_dtype: str, drop_unseen: bool, extra: dict) -> dict:
    """What every resume of this ingest must match (ingest.json)."""
    full = model.full_config
    return {"format": FORMAT, "model": full.name, "model_fingerprint": full.fingerprint(),
            "weights_digest": weights_digest(model), "weights": model.weights_format,
            "dtype": str(model.dtype).removeprefix("torch."), "kv_dtype": kv_dtype,
            "tokens": int(token_ids.numel()), "tokens_sha256": tokens_sha256(token_ids),
            "drop_unseen": bool(drop_unseen), "extra": extra}


def header_problem(saved: dict, current: dict, where: str) -> str | None:
    """One line naming what differs between a checkpoint's ingest.json and this ingest, or None."""
    if saved.get("format") != FORMAT:
        return f"{where} is not a ringctx ingest checkpoint (format {saved.get('format')!r})"
    if saved.get("tokens") != current["tokens"] or saved.get("tokens_sha256") != current["tokens_sha256"]:
        return (f"{where} was made for other tokens ({saved.get('tokens')} tokens, SHA-256 "
                f"{str(saved.get('tokens_sha256'))[:12]}...) than this ingest's ({current['tokens']}, "
                f"{current['tokens_sha256'][:12]}...)")
    for key, what in (("dtype", "dtype"), ("kv_dtype", "KV dtype"), ("model_fingerprint", "model"),
                      ("weights", "weights format"), ("weights_digest", "weights"), ("drop_unseen", "drop_unseen")):
        if saved.get(key) != current[key]:
            return f"{where} was made with {what} {saved.get(key)!r}, this ingest has {current[key]!r}"
    return None


def run_settings(model, config, cp_size: int) -> dict:
    """This prefill's settings as a run records them (`MATCHED` and the hardware profile)."""
    from ..planning.hardware import load_profile

    hardware = load_profile(config.hardware).to_dict()  # an engine's ranks resolved "measured" at start-up
    return {"cp": cp_size, "tp": model.tp.size, "ep": model.ep.size, "chunk_tokens": config.chunk_tokens,
            "strategy": config.strategy, "rule": config.rule, "linear_exchange": config.linear_exchange,
            "attn_backend": config.attn_backend, "hardware": hardware}


# ------------------------------------------------------------------------------------------ journal
def read_journal(path: str) -> list[dict]:
    """The complete records of a rank's journal, in order (a torn or unreadable line ends it)."""
    records = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return records
    for line in data.split(b"\n")[:-1]:  # the part after the last newline was never finished
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not isinstance(record, dict) or "sha256" not in record:
            break
        records.append(record)
    return records


def chunk_records(records: list[dict]) -> list[dict]:
    """A journal's chunk records 0, 1, ... in order, up to the first gap."""
    out = []
    for record in records:
        if record.get("kind") == "chunk" and record.get("chunk") == len(out):
            out.append(record)
    return out


def base_record(records: list[dict]) -> dict | None:
    return next((r for r in records if r.get("kind") == "base"), None)  # a resliced run's first record


def read_record(run_dir: str, name: str, record: dict) -> dict[str, torch.Tensor]:
    """A record's tensors, its checksum verified; ValueError when the bytes do not match."""
    path = os.path.join(run_dir, name + ".kv")
    with open(path, "rb") as f:
        f.seek(int(record["offset"]))
        data = f.read(int(record["bytes"]))
    if len(data) != int(record["bytes"]) or hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ValueError(f"{path}: the record of {_what(record)} fails its checksum (altered or truncated)")
    return load_safetensors(data)


def _what(record: dict) -> str:
    return "the base rows" if record.get("kind") == "base" else f"chunk {record.get('chunk')}"


class ChunkWriter:
    """This rank's records, appended on a thread of its own (a chunk's rows are written while the
    next chunk computes): the blob, fsync, then its journal line, fsync.

    A write that fails (a full disk) ends this rank's checkpoint there: one line on stderr, the
    prefill goes on in memory, and a crash later resumes from the last record every rank wrote."""

    def __init__(self, run_dir: str, name: str, rank: int, keep: list[dict]):
        """keep: the journal's records this run keeps (a resume's); anything after them (a record a
        crash left behind that other ranks never matched) is cut off before the first append."""
        self.run_dir, self.name, self.rank = run_dir, name, rank
        self.data_path = os.path.join(run_dir, name + ".kv")
        self.journal_path = os.path.join(run_dir, name + ".jsonl")
        self.problem: str | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
        self._thread: threading.Thread | None = None
        try:
            end = max((int(r["offset"]) + int(r["bytes"]) for r in keep), default=0)
            # unbuffered: a write that fails (a full disk) fails there, and nothing is left to flush later
            self._data = open(self.data_path, "r+b" if os.path.exists(self.data_path) else "w+b", buffering=0)
            self._data.truncate(end)
            self._data.seek(end)
            self._journal = open(self.journal_path, "w+b" if not keep else "r+b", buffering=0)
            lines = b"".join(json.dumps(r).encode() + b"\n" for r in keep)
            self._journal.seek(0)
            _write_all(self._journal, lines)
            self._journal.truncate(len(lines))
            os.fsync(self._journal.fileno())
        except OSError as exc:
            self._stopped(f"could not open its files ({exc})")
            return
        self._thread = threading.Thread(target=self._run, name="ringctx-checkpoint", daemon=True)
        self._thread.start()

    def _stopped(self, why: str) -> None:
        self.problem = (f"the ingest's checkpoint stopped on rank {self.rank}: {why}; the ingest goes on, and a "
                        "crash from here resumes from the last chunk every rank wrote")
        print(f"ringctx: {self.problem}", file=sys.stderr, flush=True)

    def append(self, record: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Queue a record (its tensors must not change afterwards: pass copies). Waits while
        WRITE_QUEUE_CHUNKS records are queued."""
        if self.problem is None and self._thread is not None:
            self._queue.put((record, tensors))

    def wait(self) -> str | None:
        """Wait until every record queued so far is on disk (or the checkpoint stopped); its problem."""
        if self._thread is not None:
            self._queue.join()
        return self.problem

    def close(self) -> str | None:
        """Wait for every queued record; the problem that ended the checkpoint, or None."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            for f in (self._data, self._journal):
                try:
                    f.close()
                except OSError:
                    pass
        return self.problem

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self.problem is None:
                    self._write(*item)
            except OSError as exc:
                self._stopped(f"writing {_what(item[0])} failed ({exc})")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, record: dict, tensors: dict[str, torch.Tensor]) -> None:
        blob = save_safetensors(tensors, metadata={"format": FORMAT})
        point = f"chunk{record.get('chunk', 'base')}"
        if hook_point(TEST_DISK_FULL_ENV, self.rank) == point:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset = self._data.tell()
        half = len(blob) // 2
        _write_all(self._data, memoryview(blob)[:half])
        maybe_die(self.rank, f"write-{point}")  # tests: a crash inside the write
        _write_all(self._data, memoryview(blob)[half:])
        os.fsync(self._data.fileno())
        maybe_die(self.rank, f"journal-{point}")  # tests: the blob is on disk, its line is not
        line = {**record, "offset": offset, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        _write_all(self._journal, json.dumps(line).encode() + b"\n")
        os.fsync(self._journal.fileno())


def _write_all(f, data) -> None:
    """Write every byte (an unbuffered file may take part of them in one call)."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


# ------------------------------------------------------------------------------------------ resume
@dataclasses.dataclass
class ResumePlan:
    """How this ingest starts, decided by the leader from the checkpoint's files (sent to every
    rank as JSON)."""

    mode: str
    """"fresh" (nothing to resume: a new checkpoint), "exact" (continue `run` on the same mesh and
    settings: bit-identical) or "reslice" (a new `run` whose base is the tokens `source` did)."""
    run: str
    """The run directory this prefill appends to."""
    chunks: int = 0
    """exact: the chunks of `run` every rank wrote, which are restored; reslice: those of `source` taken."""
    base_tokens: int = 0
    """Tokens before the run's first chunk (its ranks' base records hold their rows)."""
    source: str | None = None
    """reslice: the run the done tokens are read from."""
    done_tokens: int = 0
    """Tokens already prefilled (0 when fresh)."""
    source_settings: dict | None = None
    """The settings of the run resumed (exact) or read (reslice)."""

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "ResumePlan":
        return cls(**json.loads(data))

    def describe(self, total_tokens: int) -> str:
        """One line for the user."""
        if self.mode == "fresh":
            return ""
        done = f"{self.done_tokens:,} of {total_tokens:,} tokens done"
        if self.mode == "exact":
            chunks = f"{self.chunks} chunk{'' if self.chunks == 1 else 's'}"
            return f"resuming the ingest from its checkpoint: {done} ({chunks}), on the same ranks"
        s = self.source_settings or {}
        return (f"resuming the ingest from its checkpoint: {done}, made on {s.get('cp')} CP x {s.get('tp')} TP "
                f"ranks in chunks of {s.get('chunk_tokens')}, read back over this mesh (exact to the usual "
                "tolerance, not bit-identical: the remaining chunks are split differently)")


def chunk_bounds(total_tokens: int, base_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of a run's chunks over the prompt (tokens from `base_tokens` on)."""
    return [(s, min(s + chunk_tokens, total_tokens)) for s in range(base_tokens, total_tokens, chunk_tokens)]


def decide_resume(directory: str, header: dict, settings: dict, restart: bool) -> tuple[ResumePlan, str | None]:
    """How to start the ingest whose checkpoint is `directory` (leader only: reads files, writes
    nothing): (plan, problem). `header`: this ingest's ingest.json; `settings`: this prefill's
    run settings (`run_settings`)."""
    where = f"the checkpoint {directory!r}"
    fresh = ResumePlan("fresh", os.path.join(directory, "run-000"))
    if restart or not os.path.exists(os.path.join(directory, HEADER)):
        return fresh, None
    try:
        with open(os.path.join(directory, HEADER)) as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        return fresh, f"{where} has no readable {HEADER} ({exc}); start over with --restart (restart=True)"
    problem = header_problem(saved, header, where)
    if problem:
        return fresh, f"{problem}; start over with --restart (restart=True), which discards its chunks"
    usable = None
    for run_dir in sorted(_runs(directory), reverse=True):  # the newest run whose every rank has its base
        try:
            with open(os.path.join(run_dir, RUN)) as f:
                run = json.load(f)
        except (OSError, ValueError):
            continue
        journals = [read_journal(os.path.join(run_dir, rank_name(c, t) + ".jsonl"))
                    for c in range(run["cp"]) for t in range(run["tp"])]
        if run["base_tokens"] and any(base_record(j) is None for j in journals):
            continue  # a reslice that crashed before every rank wrote its base: the run before it stands
        usable = (run_dir, run, min(len(chunk_records(j)) for j in journals))
        break
    if usable is None:
        return fresh, None
    run_dir, run, chunks = usable
    total = header["tokens"]
    bounds = chunk_bounds(total, run["base_tokens"], run["chunk_tokens"])
    done = bounds[chunks - 1][1] if chunks else run["base_tokens"]
    if done == 0:  # nothing to keep: a fresh start (the directory is made anew)
        return fresh, None
    if all(run.get(k) == settings.get(k) for k in MATCHED):
        return ResumePlan("exact", run_dir, chunks=chunks, base_tokens=run["base_tokens"], done_tokens=done,
                          source_settings=run), None
    if done >= total:  # every chunk was done: the last one runs again, for its logits, over the new mesh
        chunks -= 1
        done = bounds[chunks - 1][1] if chunks else run["base_tokens"]
        if done == 0:
            return fresh, None
    return ResumePlan("reslice", _next_run(directory), chunks=chunks, base_tokens=done, source=run_dir,
                      done_tokens=done, source_settings=run), None


def _runs(directory: str) -> list[str]:
    return [os.path.join(directory, d) for d in os.listdir(directory) if d.startswith("run-")] \
        if os.path.isdir(directory) else []


def _next_run(directory: str) -> str:
    numbers = [int(os.path.basename(r)[4:]) for r in _runs(directory) if os.path.basename(r)[4:].isdigit()]
    return os.path.join(directory, f"run-{max(numbers, default=-1) + 1:03d}")


def start_checkpoint(directory: str, plan: ResumePlan, header: dict, token_ids: torch.Tensor, settings: dict) -> None:
    """Leader: make the files a plan needs before any rank appends (a fresh checkpoint replaces
    whatever was there; a new run gets its run.json). Raises OSError."""
    if plan.mode == "fresh":
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        save_file({"token_ids": token_ids.cpu().to(torch.long).contiguous()}, os.path.join(directory, TOKENS))
        write_json_atomically(os.path.join(directory, HEADER), header, indent=1)
    if plan.mode in ("fresh", "reslice"):
        os.makedirs(plan.run, exist_ok=True)
        write_json_atomically(os.path.join(plan.run, RUN), {**settings, "base_tokens": plan.base_tokens}, indent=1)


def drop_other_runs(directory: str, keep: str) -> None:
    """Leader, once every rank's base of a new run is on disk: the runs before it go."""
    for run_dir in _runs(directory):
        if os.path.abspath(run_dir) != os.path.abspath(keep):
            shutil.rmtree(run_dir, ignore_errors=True)


def remove_checkpoint(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def source_manifest(directory: str, plan: ResumePlan, header: dict, model) -> dict:
    """The tokens a reslice takes from its source run, as a document manifest whose slices are the
    run's records (runtime/documents.py `load_document_slices` reads them on any mesh): the base
    records, then chunk 0 of every CP rank, chunk 1, ...; a first slice of no rows whose parts hold
    CP rank 0's linear-attention states at the last chunk taken."""
    from ..model.tensor_parallel import TensorParallel

    run, full = plan.source_settings, model.full_config
    rel = os.path.relpath(plan.source, directory)

    def part(c: int, t: int, record: dict, states: bool = False) -> dict:
        tp = TensorParallel(run["tp"], t)
        p = {"file": os.path.join(rel, rank_name(c, t) + ".kv"), "offset": record["offset"],
             "bytes": record["bytes"], "sha256": record["sha256"], "heads": list(tp.kv_heads(full))}
        if not full.uniform_heads:
            p["layer_heads"] = [list(h) for h in layer_heads(full, tp)]
        if states:
            p["linear_tp"] = [run["tp"], t]
        return p

    # per (CP rank, TP rank): the records taken, in order (its base first, when the run has one)
    taken = {}
    for c in range(run["cp"]):
        for t in range(run["tp"]):
            journal = read_journal(os.path.join(plan.source, rank_name(c, t) + ".jsonl"))
            base = [base_record(journal)] if run["base_tokens"] else []
            taken[(c, t)] = base + chunk_records(journal)[:plan.chunks]
    slices = []
    if full.has_linear:  # CP rank 0's states at the last record taken
        slices.append({"rows": 0, "parts": [part(0, t, taken[(0, t)][-1], states=True) for t in range(run["tp"])]})
    for i in range(len(taken[(0, 0)])):
        for c in range(run["cp"]):
            records = [taken[(c, t)][i] for t in range(run["tp"])]
            if records[0]["rows"]:
                slices.append({"rows": records[0]["rows"], "parts": [part(c, t, r) for t, r in enumerate(records)]})
    return {"format": DOCUMENT_FORMAT, "model": header["model"], "model_fingerprint": header["model_fingerprint"],
            "weights_digest": header["weights_digest"], "weights": header["weights"], "dtype": header["dtype"],
            "kv_dtype": header["kv_dtype"], "length": plan.done_tokens, "n_layers": full.n_layers,
            "tokens_sha256": file_sha256(os.path.join(directory, TOKENS)), "slices": slices, "extra": {}}


def rows_record(cache, start: int, stop: int, positions: torch.Tensor, states: bool) -> dict[str, torch.Tensor]:
    """Copies of rows start..stop-1 of every attention layer of `cache` as stored, their positions,
    and with `states` the cache's linear-attention states: one record's tensors."""
    tensors, names = {"positions": positions.cpu().to(torch.long).contiguous().clone()}, ["k", "v"]
    names += ["k_scale", "v_scale"] if cache.quantized else []
    for layer in range(cache.n_layers):
        if cache.shapes[layer][0] == 0:  # a linear-attention layer keeps no rows
            continue
        for name, rows in zip(names, cache.stored_rows(layer, start, stop)):
            tensors[f"{name}.{layer}"] = rows.detach().to("cpu", copy=True).contiguous()
    if states:
        tensors.update(linear_state_tensors(cache))
    return tensors


def cache_from_record(tensors: dict[str, torch.Tensor], model, kv_dtype: str, sliced: bool, room: int):
    """A KVCache holding a base record's rows (in the record's order) and states."""
    from ..model import KVCache
    from ..model.gated_deltanet import LinearState

    rows = int(tensors["positions"].numel())
    cache = KVCache.for_model(model.config, max(1, rows + room), dtype=model.dtype, device=model.device,
                              kv_dtype=kv_dtype, sliced=sliced, small_pages=True)
    names = ["k", "v"] + (["k_scale", "v_scale"] if cache.quantized else [])
    for layer in range(cache.n_layers):
        if cache.shapes[layer][0] == 0:
            continue
        for target, name in zip(cache.storage_tensors(layer), names):
            target[:rows].copy_(tensors[f"{name}.{layer}"])
    for layer, state in enumerate(cache.linear_states or ()):
        if state is not None and f"linear_state.{layer}" in tensors:
            cache.linear_states[layer] = LinearState(tensors[f"linear_conv.{layer}"].to(state.conv),
                                                     tensors[f"linear_state.{layer}"].to(state.recurrent))
    if sliced:
        cache.positions[:rows] = tensors["positions"]
    cache.length = rows
    return cache
