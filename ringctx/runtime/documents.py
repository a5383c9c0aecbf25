"""Document files: a prefilled document's KV cache, written by N decode ranks, read by M.

A document is a directory (no pickle anywhere):

    report.kv/
        manifest.json              format, ringctx version, model fingerprint and weights digest,
                                   weights ("model" or "int8"), dtype, kv_dtype, length, the
                                   slices and their SHA-256, caller
                                   fields (the chat frame)
        tokens.safetensors         token_ids [length] int64
        slice-00000.safetensors    one decode rank's rows: k.{layer}, v.{layer} [rows, Hkv, D] as
        slice-00001.safetensors    stored (8-bit caches also k_scale.{layer}, v_scale.{layer}
        ...                        [rows, Hkv]) and positions [rows] int64; a windowed or
                                   chunked layer that dropped rows holds only its last
                                   rows - kept[layer] (the manifest's slice lists `kept`)
                                   a hybrid's linear-attention states at the document's end
                                   in decode rank 0's slice: linear_conv.{layer} [K-1, C],
                                   linear_state.{layer} [Hv, Dk, Dv] float32 (under TP each part
                                   its TP rank's heads, the part's "linear_tp" says which)
        slice-00000-kv-002-004.safetensors   under tensor parallelism: a decode rank's rows for KV
                                   heads 2..3, written by the TP rank that holds them (the manifest
                                   lists a slice's "parts" and their heads; "layer_heads" per
                                   layer where layers differ in KV heads, Gemma 4 31B's)

Every decode rank (every TP rank of it) writes its own slice (its own heads), so no rank ever
holds more than its share and the writes run in parallel. Loading on M decode ranks: rank m takes rows m*R/M .. (m+1)*R/M - 1 of the
slices taken in order (R rows in all), and of them the KV heads its TP rank holds (all of them
without TP), whatever TP size saved them, reading only those rows (plain file reads);
each slice file's checksum is verified by one of the loading ranks, streaming the file. With one
decode rank the rows are put in sequence order, as a single-rank cache is kept.

Saving writes into `<path>.partial/` and renames it to `<path>` once every rank has written its
slice and the manifest is complete: a crash never leaves a half-written document at `<path>`. A
file in the older single-file format (`ringctx.model.kvfile`) still loads on one decode rank.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading

import torch
from safetensors.torch import save_file

from ..model import KVCache
from ..attention.quant import dequantize_rows
from ..model.kvcache import write_rows
from ..model.tensor_parallel import split_range
from ..model.kvfile import check_made_with, load_kv_cache, weights_digest
from ..parallel.comm import agree_across_ranks, all_gather_bytes

FORMAT = "ringctx-doc/1"
LOAD_BLOCK_ROWS = 16384
"""Rows read (and converted, for another kv_dtype) at a time while loading: bounds the temporaries."""
MANIFEST = "manifest.json"
ENGINE_CONFIG_KEY = "engine_config"
"""The manifest's extra entry that records the EngineConfig a document was made with (`to_dict`)."""
TOKENS = "tokens.safetensors"
DROPPED_UNSEEN_KEY = "dropped_unseen"
"""The manifest's extra entry saying the document's windowed layers kept only what later tokens see."""


def slice_name(index: int) -> str:
    return f"slice-{index:05d}.safetensors"


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes, read in blocks (memory stays small for any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def part_sha256(path: str, part: dict) -> str:
    """SHA-256 of one part of a slice: its whole file, or its bytes [offset, offset + bytes) where
    the part is one record of a file that holds several (an ingest checkpoint's)."""
    file = os.path.join(path, part["file"])
    if "offset" not in part:
        return file_sha256(file)
    h, left = hashlib.sha256(), int(part["bytes"])
    with open(file, "rb") as f:
        f.seek(int(part["offset"]))
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                raise OSError(f"{file} ends before its record does (truncated)")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _slice_tensors(cache: KVCache, states: bool = False) -> dict[str, torch.Tensor]:
    """A decode rank's rows as a slice file holds them: each layer's stored rows (from kept_from);
    with `states`, a hybrid's linear-attention states too (copies: a question may advance them)."""
    n = cache.length
    tensors = {"positions": cache.row_positions().cpu().contiguous(), **(linear_state_tensors(cache) if states else {})}
    names = ["k", "v"] + (["k_scale", "v_scale"] if cache.quantized else [])
    for layer in range(cache.n_layers):
        for name, rows in zip(names, cache.stored_rows(layer, min(cache.kept_from(layer), n), n)):
            tensors[f"{name}.{layer}"] = rows.cpu()
    return tensors


def linear_state_tensors(cache: KVCache) -> dict[str, torch.Tensor]:
    """Copies of a hybrid's linear-attention states as a slice or checkpoint record holds them:
    linear_conv.{layer} [K-1, C], linear_state.{layer} [Hv, Dk, Dv] (none without linear layers)."""
    tensors = {}
    for layer, state in enumerate(cache.linear_states or ()):
        if state is not None:
            tensors[f"linear_conv.{layer}"] = state.conv.detach().to("cpu", copy=True).contiguous()
            tensors[f"linear_state.{layer}"] = state.recurrent.detach().to("cpu", copy=True).contiguous()
    return tensors


def part_name(index: int, heads: tuple[int, int] | None, tp_rank: int | None = None) -> str:
    """The file of decode rank `index`'s rows: all KV heads (None), or heads [a, b) under TP (and
    the TP rank that wrote it, when layers differ in KV heads: two ranks may share [a, b) then)."""
    if heads is None:
        return slice_name(index)
    rank = "" if tp_rank is None else f"-tp-{tp_rank:03d}"
    return f"slice-{index:05d}-kv-{heads[0]:03d}-{heads[1]:03d}{rank}.safetensors"


def layer_heads(config, tp) -> list[tuple[int, int]]:
    """Per layer, the KV heads [a, b) TP rank `tp` holds of the whole model `config` (all of them
    without TP): what a document part it writes holds of each layer."""
    return [(0, 0) if config.linear(layer) is not None else tp.kv_heads(config, layer)
            for layer in range(config.n_layers)]  # a linear-attention layer keeps no rows


def save_document_slices(path: str, cache: KVCache, token_ids: torch.Tensor, model, extra: dict, *, group,
                         rank: int, world: int, tp_size: int = 1, heads: tuple[int, int] | None = None,
                         writes: bool = True) -> None:
    """Write this rank's part of the document; the leader (rank 0 of `group`) also writes the
    tokens and the manifest and swaps the finished directory in. Call on every rank of `group`.

    group, rank, world: every rank that holds part of the cache, in (decode rank, TP rank) order
    (the decode ranks alone without tensor parallelism). Under TP (`tp_size` > 1) this rank's
    cache holds KV `heads` [a, b) of the model's; `writes` is False for a rank whose heads another
    TP rank of its decode rank already writes (KV heads replicated when TP > KV heads). A layer
    with its own KV head count holds its own heads, `layer_heads(model.full_config, model.tp)`.
    """
    start_document_save(path, cache, token_ids, model, extra, group=group, rank=rank, world=world, tp_size=tp_size,
                        heads=heads, writes=writes).finish()


class PendingSave:
    """A save whose slice this rank writes on a thread of its own (`start_document_save`):
    `finish()`, on every rank of the group, waits for it and completes the document (collective).

    Between the two, the rank may run anything else (decode steps of answers in flight: writing and
    hashing a slice releases the GIL); the cache must not change meanwhile, which a document's
    never does (its rows are only read)."""

    def __init__(self, path: str, partial: str, token_ids, model, cache: KVCache, extra: dict, group, rank: int,
                 world: int, index: int | None, heads: tuple[int, int] | None):
        """index: the decode rank whose slice this rank writes (None: it writes nothing); heads: the
        KV heads it writes under TP (None: all)."""
        self.path, self.partial, self.token_ids, self.model, self.extra = path, partial, token_ids, model, extra
        self.dtype, self.kv_dtype, self.n_layers = cache.dtype, cache.kv_dtype, cache.n_layers
        full = model.full_config
        self.n_kv_heads = full.n_kv_heads
        # per layer, the heads this rank's part holds, recorded where layers differ (None: `heads` for every layer)
        self.layer_heads = None if full.uniform_heads else layer_heads(full, model.tp)
        self.tp_rank = None if full.uniform_heads else model.tp.rank
        self.group, self.rank, self.world = group, rank, world
        self.record, self.problem, self.linear_tp = "", None, None
        self.kept = list(cache.kept)
        self._written = threading.Event()
        self._thread: threading.Thread | None = None
        if index is None:
            self._written.set()
            return
        # The rows are taken here (views): rows a question appends later are not the document's. A
        # hybrid's states are the same on every decode rank: decode rank 0's parts carry them.
        self.linear_tp = [model.tp.size, model.tp.rank] if index == 0 and cache.linear_states is not None else None
        self._thread = threading.Thread(target=self._write, args=(_slice_tensors(cache, self.linear_tp is not None),
                                                                  cache.length, index, heads),
                                        name="ringctx-save", daemon=True)
        self._thread.start()

    @property
    def written(self) -> bool:
        """Whether this rank's slice is on disk (finish() then waits for no write of its own)."""
        return self._written.is_set()

    def wait_written(self, timeout: float | None = None) -> bool:
        """Block until this rank's slice is on disk (or timeout); whether it is."""
        return self._written.wait(timeout)

    def _write(self, tensors: dict[str, torch.Tensor], rows: int, index: int, heads: tuple[int, int] | None) -> None:
        try:
            name = part_name(index, heads, None if heads is None else self.tp_rank)
            file = os.path.join(self.partial, name)
            save_file(tensors, file, metadata={"format": FORMAT, "slice": str(index)})
            by_layer = {} if self.layer_heads is None else {"layer_heads": [list(h) for h in self.layer_heads]}
            linear = {} if self.linear_tp is None else {"linear_tp": self.linear_tp}
            self.record = json.dumps({"index": index, "file": name, "heads": list(heads or (0, self.n_kv_heads)),
                                      **by_layer, **linear, "rows": rows, "kept": self.kept,
                                      "sha256": file_sha256(file)})
        except Exception as exc:  # disk full, permissions: every rank must hear of it
            self.problem = f"rank {self.rank} could not write its slice: {exc}"
        finally:
            self._written.set()

    def finish(self) -> None:
        """Wait for this rank's slice; the leader writes the tokens and the manifest and swaps the
        directory in. Collective; raises ValueError on every rank when any rank's write failed."""
        from ..version import __version__

        if self._thread is not None:
            self._thread.join()
        group, world, partial, path = self.group, self.world, self.partial, self.path
        _agree("save", self.problem, group, world)
        records = [json.loads(r) for r in all_gather_bytes(self.record.encode(), group, world) if r]
        problem = None
        if self.rank == 0:
            try:
                token_ids = torch.as_tensor(self.token_ids, dtype=torch.long).reshape(-1).cpu().contiguous()
                save_file({"token_ids": token_ids}, os.path.join(partial, TOKENS))
                manifest = {
                    "format": FORMAT, "ringctx_version": __version__, "model": self.model.full_config.name,
                    "model_fingerprint": self.model.full_config.fingerprint(),
                    "weights_digest": weights_digest(self.model), "weights": self.model.weights_format,
                    "dtype": str(self.dtype).removeprefix("torch."), "kv_dtype": self.kv_dtype,
                    "length": int(token_ids.numel()), "n_layers": self.n_layers,
                    "tokens_sha256": file_sha256(os.path.join(partial, TOKENS)), "slices": _slices(records),
                    "extra": self.extra,
                }
                if sum(s["rows"] for s in manifest["slices"]) != manifest["length"]:
                    raise ValueError(f"the slices hold {sum(s['rows'] for s in manifest['slices'])} rows but the "
                                     f"document has {manifest['length']} tokens")
                with open(os.path.join(partial, MANIFEST), "w") as f:
                    json.dump(manifest, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                _swap_in(partial, path)
            except Exception as exc:
                problem = f"could not finish {path!r}: {exc}"
                shutil.rmtree(partial, ignore_errors=True)
        _agree("save", problem, group, world)


def start_document_save(path: str, cache: KVCache, token_ids: torch.Tensor, model, extra: dict, *, group,
                        rank: int, world: int, tp_size: int = 1, heads: tuple[int, int] | None = None,
                        writes: bool = True) -> PendingSave:
    """`save_document_slices` in two halves: the leader makes `<path>.partial/` (collective: every
    rank hears whether it could) and this rank starts writing its slice on a thread; the returned
    PendingSave's `finish()` completes the document. Arguments as `save_document_slices`'s."""
    path = os.path.abspath(os.fspath(path))
    partial = path + ".partial"
    problem = None
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
            os.makedirs(partial)
        except OSError as exc:
            problem = f"cannot create {partial!r}: {exc}"
    _agree("save", problem, group, world)
    return PendingSave(path, partial, token_ids, model, cache, extra, group, rank, world,
                       index=rank // tp_size if writes else None, heads=heads if tp_size > 1 else None)


def _slices(records: list[dict]) -> list[dict]:
    """The manifest's slices from every written part: one entry per decode rank, with its file (all
    KV heads) or its parts (one per TP rank that wrote heads)."""
    slices = []
    for index in sorted({r["index"] for r in records}):
        parts = sorted((r for r in records if r["index"] == index), key=lambda r: r["heads"][0])
        kept = {"kept": parts[0]["kept"]} if any(parts[0].get("kept") or ()) else {}
        if len(parts) == 1:
            linear = {"linear_tp": parts[0]["linear_tp"]} if "linear_tp" in parts[0] else {}
            slices.append({"file": parts[0]["file"], "rows": parts[0]["rows"], "sha256": parts[0]["sha256"], **kept,
                           **linear})
        else:
            slices.append({"rows": parts[0]["rows"], **kept,
                           "parts": [{"file": r["file"], "heads": r["heads"], "sha256": r["sha256"],
                                      **({"layer_heads": r["layer_heads"]} if "layer_heads" in r else {}),
                                      **({"linear_tp": r["linear_tp"]} if "linear_tp" in r else {})}
                                     for r in parts]})
    return slices


def slice_parts(entry: dict, config) -> list[dict]:
    """A manifest slice's files with the KV heads each holds (a single file holds all of them, of
    every layer: `config`'s, the whole model's)."""
    whole = {} if config.uniform_heads else {"layer_heads": [[0, h] for h, _ in config.kv_shapes]}
    linear = {"linear_tp": entry["linear_tp"]} if "linear_tp" in entry else {}
    return entry.get("parts") or [{"file": entry["file"], "heads": [0, config.n_kv_heads], "sha256": entry["sha256"],
                                   **whole, **linear}]


def _swap_in(partial: str, path: str) -> None:
    """Replace `path` (a directory, a file or nothing) by the finished `partial` directory."""
    old = None
    if os.path.lexists(path):
        old = path + ".old"
        if os.path.isdir(old):
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(partial, path)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)


def read_manifest(path: str) -> dict:
    """The manifest of a document directory; ValueError naming the problem."""
    path = os.fspath(path)
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(path):
        raise ValueError(f"document {path!r} does not exist; create it with `ringctx ingest FILE --save {path}`")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"document {path!r} has no readable {MANIFEST} ({exc}); it is incomplete or not a "
                         "ringctx document: save it again") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a ringctx document (format {manifest.get('format')!r}, expected {FORMAT!r})")
    return manifest


def describe_document(path: str) -> dict:
    """dtype, kv_dtype, weights ("model" or "int8": what the model it was made with was loaded
    as), length and engine_config (the EngineConfig it was made with, as a dict; None in files
    written before it was recorded) of a saved document (a directory, or the older single file),
    read from its manifest or header alone; ValueError naming the problem."""
    from ..model.kvfile import read_kv_metadata

    if os.path.isfile(path):
        meta = read_kv_metadata(path)
        return {"dtype": meta["dtype"], "kv_dtype": "model", "weights": "model", "length": int(meta["length"]),
                "engine_config": None}
    manifest = read_manifest(path)
    return {"dtype": manifest["dtype"], "kv_dtype": manifest["kv_dtype"], "weights": manifest.get("weights", "model"),
            "length": int(manifest["length"]),
            "engine_config": (manifest.get("extra") or {}).get(ENGINE_CONFIG_KEY)}


def read_document(path: str, model, room: int = 0) -> tuple[KVCache, torch.Tensor, dict]:
    """A whole saved document in this process, in sequence order: (cache, token_ids, extra). For
    checks and tools; a document larger than one device loads with `Engine.load_document`."""
    return load_document_slices(path, model, group=None, rank=0, world=1, room=room)


def load_document_slices(path: str, model, *, group, rank: int, world: int, room: int,
                         memory_check=None, kv_dtype: str | None = None,
                         manifest: dict | None = None) -> tuple[KVCache, torch.Tensor, dict]:
    """This decode rank's share of a saved document: (cache, token_ids, extra). Call on every
    decode rank; a problem on any rank is a ValueError on all of them, before anything is read.

    memory_check(rows, bytes_per_row) -> problem or None: refuse a share that would not fit.
    kv_dtype: store the loaded rows so (None: as saved); e.g. a bf16 document loaded as "fp8" is
    quantized row by row as it is read.
    A tensor-parallel shard (model.tp) keeps only its KV heads of every row it reads.
    manifest: read these slices of `path` instead of its manifest file (an ingest checkpoint's
    finished chunks, runtime/checkpoint.py, whose parts are records at offsets of the ranks' files).
    """
    from safetensors import safe_open

    path = os.fspath(path)
    problem = None
    if manifest is None and os.path.isfile(path):  # the single-file format of ringctx.model.kvfile
        if world > 1 or model.tp.size > 1:
            problem = (f"{path!r} is a single-file KV cache: load it with one decode rank (--decode-ranks 1) and "
                       "--tp 1, and save it again to load it on several")
        _agree("load", problem, group, world)
        cache, token_ids, extra = load_kv_cache(path, model, room=room)
        return cache, token_ids, extra
    try:
        manifest = manifest or read_manifest(path)
        check_made_with(f"document {path!r}", manifest, model)
    except ValueError as exc:
        problem = str(exc)
    _agree("load", problem, group, world)

    slices, length = manifest["slices"], int(manifest["length"])
    lo, hi = split_range(length, world, rank)  # loading rank `rank` takes a contiguous share
    saved_as, kv_dtype = manifest["kv_dtype"], kv_dtype or manifest["kv_dtype"]
    full = model.full_config
    n_layers = model.config.n_layers
    # The share's rows go in position order (one decode rank: row = position), so that the rows a
    # windowed or chunked layer kept (the file holds a slice's last rows - kept[layer] of it) are
    # the share's last rows of that layer too.
    pieces, start = [], 0  # (slice, first and last row of the share in it, its positions)
    for s in slices:
        a, b = max(lo, start), min(hi, start + s["rows"])
        if a < b and problem is None:
            try:
                with HeadReader(path, slice_parts(s, full), None) as f:
                    pieces.append((s, a - start, b - start, f.rows("positions", a - start, b - start)))
            except (OSError, ValueError, KeyError) as exc:
                problem = f"document {path!r} is incomplete ({exc}); save it again"
        start += s["rows"]
    if problem is not None:
        pieces = []
        lo = hi = 0
    file_positions = torch.cat([p for *_, p in pieces]) if pieces else torch.empty(0, dtype=torch.long)
    order = torch.argsort(file_positions)
    target = torch.empty_like(order)
    target[order] = torch.arange(order.numel())  # share row -> cache row
    stored = torch.ones(n_layers, hi - lo, dtype=torch.bool)  # [layer, share row]: in the file
    at = 0
    for s, a, b, _ in pieces:
        for layer, first in enumerate(s.get("kept") or [0] * n_layers):
            stored[layer, at:at + max(0, min(first, b) - a)] = False
        at += b - a
    kept = []
    for layer in range(n_layers):
        have = torch.zeros(hi - lo, dtype=torch.bool)
        have[target] = stored[layer]
        first = int(have.logical_not().sum())
        if problem is None and not bool(have[first:].all()):
            problem = (f"document {path!r}: layer {layer}'s kept rows are not its last ones; the slices disagree "
                       "(save the document again)")
        kept.append(first)
    # in ordinary pages, as a prefill's (their first touch is cheap; a server moves them into 2 MiB
    # pages when it has nothing else to do: Engine.move_document_pages)
    cache = KVCache.for_model(model.config, max(1, hi - lo + room), dtype=model.dtype, device=model.device,
                              kv_dtype=kv_dtype, sliced=world > 1, small_pages=True, kept=kept)
    if any(kept):
        cache.spans = model.config.layer_spans
    if memory_check is not None and problem is None:
        problem = memory_check(-(-cache.nbytes // max(1, cache.bytes_per_token)), cache.bytes_per_token)
    files = [part for s in slices for part in slice_parts(s, full)]
    # Checksums: file i is verified by rank i mod world, the tokens file by rank 0.
    try:
        if problem is None:
            for i, part in enumerate(files):
                if i % world == rank and part_sha256(path, part) != part["sha256"]:
                    problem = (f"document {path!r}: {part['file']} fails its checksum (altered or truncated); "
                               "save it again")
            if rank == 0 and problem is None and \
                    file_sha256(os.path.join(path, TOKENS)) != manifest["tokens_sha256"]:
                problem = f"document {path!r}: {TOKENS} fails its checksum; save it again"
    except OSError as exc:
        problem = f"document {path!r} is incomplete ({exc}); save it again"
    _agree("load", problem, group, world)

    names = ["k", "v"] + (["k_scale", "v_scale"] if saved_as in ("fp8", "int8") else [])
    heads = layer_heads(full, model.tp)  # every KV head without tensor parallelism
    at = 0
    for s, a, b, _ in pieces:  # the share's rows of each slice, a block of rows at a time
        with HeadReader(path, slice_parts(s, full), heads) as f:
            for layer in range(cache.n_layers):
                if cache.shapes[layer][0] == 0:  # a linear-attention layer: no rows (its state comes below)
                    continue
                first = (s.get("kept") or [0] * n_layers)[layer]  # the slice's rows in the file start here
                for r0 in range(max(a, first), b, LOAD_BLOCK_ROWS):
                    r1 = min(b, r0 + LOAD_BLOCK_ROWS)
                    where = target[at + r0 - a:at + r1 - a].to(model.device)
                    rows = [f.rows(f"{name}.{layer}", r0 - first, r1 - first).to(model.device) for name in names]
                    if saved_as == kv_dtype:  # as stored: no conversion
                        slots = where - cache.kept_from(layer)
                        for part_target, part in zip(cache.storage_tensors(layer), rows):
                            write_rows(part_target, slots, part)
                        continue
                    if len(rows) == 4:  # another storage: through the model's dtype, quantized by update()
                        rows = [dequantize_rows(rows[0], rows[2], model.dtype),
                                dequantize_rows(rows[1], rows[3], model.dtype)]
                    cache.update(layer, where, rows[0], rows[1])
        at += b - a
    if world > 1:
        cache.positions[:hi - lo] = file_positions[order]
    cache.length = hi - lo
    if cache.linear_states is not None:
        problem = None
        try:
            read_linear_states(path, slice_parts(slices[0], full), model, cache)
        except (OSError, ValueError, KeyError) as exc:
            problem = f"document {path!r}: its linear-attention states do not match the model ({exc}); save it again"
        _agree("load", problem, group, world)
    with safe_open(os.path.join(path, TOKENS), framework="pt") as f:
        token_ids = f.get_tensor("token_ids")
    return cache, token_ids, dict(manifest.get("extra") or {})


def read_linear_states(path: str, parts: list[dict], model, cache: KVCache) -> None:
    """A hybrid's linear-attention states from decode rank 0's parts into `cache` (this TP rank's
    heads of them, whatever TP size saved them): each part holds its TP rank's key heads and their
    value heads (model/tensor_parallel.py's `linear_rows`), put back together, then cut again."""
    from ..model.tensor_parallel import TensorParallel, linear_rows

    full = model.full_config
    saved = [p for p in parts if "linear_tp" in p]
    if not saved:
        raise ValueError("no part of decode rank 0's slice holds the states")
    for layer in full.linear_layers:
        shape = full.linear(layer)
        conv = torch.zeros(shape.conv_width - 1, shape.channels, dtype=cache.dtype)
        recurrent = torch.zeros(shape.value_heads, shape.key_dim, shape.value_dim)
        for part in saved:
            size, rank = part["linear_tp"]
            tp = TensorParallel(size, rank)
            with SliceReader(os.path.join(path, part["file"]), part.get("offset", 0)) as f:
                conv_rows, state_rows = (f.header[f"{n}.{layer}"]["shape"][0] for n in ("linear_conv", "linear_state"))
                part_conv = f.rows(f"linear_conv.{layer}", 0, conv_rows)
                part_state = f.rows(f"linear_state.{layer}", 0, state_rows)
            channels, heads = linear_rows(shape, tp, "conv_weight")[1], linear_rows(shape, tp, "dt_bias")[1]
            if channels is None:
                channels, heads = torch.arange(shape.channels), torch.arange(shape.value_heads)
            if tuple(part_conv.shape) != (shape.conv_width - 1, channels.numel()) or \
                    tuple(part_state.shape) != (heads.numel(), shape.key_dim, shape.value_dim):
                raise ValueError(f"layer {layer}'s saved states have shapes {tuple(part_conv.shape)} and "
                                 f"{tuple(part_state.shape)}")
            conv[:, channels] = part_conv.to(conv.dtype)
            recurrent[heads] = part_state.float()
        channels, heads = linear_rows(shape, model.tp, "conv_weight")[1], linear_rows(shape, model.tp, "dt_bias")[1]
        state = cache.linear_states[layer]
        state.conv.copy_(conv if channels is None else conv[:, channels])
        state.recurrent.copy_(recurrent if heads is None else recurrent[heads])


class SliceReader:
    """Row ranges of the tensors of one safetensors file, read with plain file reads.

    safetensors' own reader maps the file into memory, and every page it touches then counts in
    the process's resident memory until the file is closed: loading a slice that way peaked at
    the cache plus the whole file. Row ranges of a row-major tensor are contiguous bytes, so they
    are read straight from their offsets in the header (the format: an 8-byte little-endian header
    size, a JSON header with each tensor's dtype, shape and data_offsets, then the data).
    """

    _DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
               "F8_E4M3": torch.float8_e4m3fn}

    def __init__(self, path: str, offset: int = 0):
        """offset: where the safetensors data starts in the file (an ingest checkpoint appends one
        per chunk to a rank's file: runtime/checkpoint.py)."""
        self.file = open(path, "rb")
        self.file.seek(offset)
        size = int.from_bytes(self.file.read(8), "little")
        self.header = json.loads(self.file.read(size))
        self.header.pop("__metadata__", None)
        self.data_start = offset + 8 + size

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of tensor `name` (a new tensor)."""
        info = self.header[name]
        dtype, shape = self._DTYPES[info["dtype"]], info["shape"]
        row_bytes = math.prod(shape[1:]) * torch.empty(0, dtype=dtype).element_size()
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        self.file.seek(self.data_start + info["data_offsets"][0] + start * row_bytes)
        if self.file.readinto(out.view(torch.uint8).numpy().reshape(-1)) != (stop - start) * row_bytes:
            raise ValueError(f"{self.file.name}: {name} is shorter than its header says; save the document again")
        return out

    def __enter__(self) -> "SliceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


class HeadReader:
    """Row ranges of some KV heads of one decode rank's slice, from the files of its parts (one file
    with every head, or one per TP rank that saved it): each part read with a SliceReader.

    heads: per layer, the KV heads [a, b) wanted (None: positions only). A part holds heads
    [a, b) of every layer ("heads"), or its own range per layer ("layer_heads"); where parts
    overlap (a head replicated on several TP ranks), the first part holding a head gives it."""

    def __init__(self, path: str, parts: list[dict], heads: list[tuple[int, int]] | None):
        self.heads = heads
        parts = sorted(parts, key=lambda p: p["heads"][0])
        self.parts = [(p.get("layer_heads"), p["heads"], SliceReader(os.path.join(path, p["file"]), p.get("offset", 0)))
                      for p in parts]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of tensor `name` ("k.{layer}"...), of this reader's KV heads of that
        layer (positions: as stored)."""
        if name == "positions":
            return self.parts[0][2].rows(name, start, stop)
        layer = int(name.rsplit(".", 1)[1])
        lo, hi = self.heads[layer]
        pieces = []
        for by_layer, whole, reader in sorted(self.parts, key=lambda p: (p[0] or [p[1]] * (layer + 1))[layer][0]):
            a, b = (by_layer or [whole] * (layer + 1))[layer]
            if a <= lo < b:  # in head order: the part holding the next head we still need
                take = min(b, hi)
                pieces.append(reader.rows(name, start, stop)[:, lo - a:take - a])
                lo = take
            if lo >= hi:
                break
        if lo < hi:
            raise ValueError(f"no part of the slice holds KV head {lo} of layer {layer}")
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def __enter__(self) -> "HeadReader":
        return self

    def __exit__(self, *exc) -> None:
        for *_, reader in self.parts:
            reader.__exit__()


def _agree(what: str, problem: str | None, group, world: int) -> None:
    if world > 1:
        agree_across_ranks(f"document {what}", problem, "document", group)
    elif problem:
        raise ValueError(problem)
