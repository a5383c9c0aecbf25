"""One decode step: the next token of a cached sequence through the model, fused on CPUs.

    step = DecodeStep(model, cache)     # once per generation, after the prompt is prefilled
    logits = step(token_id)             # float32 [1, vocab]; K/V written at row cache.length,
                                        # which then advances by one

A decode step multiplies one activation row by every weight matrix and attends over the cache
(in the model dtype, or 8-bit rows with their scales, which the kernel quantizes as it writes).
Run as PyTorch ops, a layer of a small model is ~40 ops on vectors of a few hundred elements, and
on a CPU their dispatch costs about as much as reading the weights (docs/BENCHMARKS.md). Where
the fused kernel applies (`FusedBatchStep.build`: a CPU model in float32 or bf16 with head_dim a
multiple of 16, the kernels built, see ringctx/kernels/), the step runs every layer in one
call of csrc/cpu_decode.c, with the same math and roundings as `Block.forward`; the final norm
and the output head stay in PyTorch (two calls); Qwen3's per-head q/k norms run in the kernel
too, and so does each layer's attention kind, given to the kernel as data per layer (its window
or chunk, softmax scale, soft-cap, sink logits, and its RoPE table, rotary dims or none: see
`_shape_and_layers`), and a mixture of experts (Mixtral's and Qwen3-MoE's routing, `_fused_experts`:
the router's product, each row's top k, then each chosen expert's weights read once for the batch
rows that chose it, `layer_experts` in the C file). Everywhere else it is `forward_with_cache` on
one token.

There is one fused kernel, for B sequences at once (`FusedBatchStep`, what runtime/batch.py runs);
a lone sequence (`FusedStep`) is a batch of one. Its cache's first `shared_rows` rows are its
document and the rows after them its own (the question and the answer so far): the engine's
decode (runtime/decode.py) names the document's rows, so that its attention over the two is merged
by log-sum-exp exactly as a batch merges a document's rows and a sequence's own, and an answer
asked alone and the same answer decoded beside others are the same bits, in every dtype.
`step_logits` computes the final norm and head a few rows at a time for the same reason.

The fused step holds the data pointers of the model's weights and the cache's buffers: build it
after both are final (it is rebuilt for every generation).

`FusedStep.split` runs the same step over one rank's slice of a KV cache split over ranks: the
caller says which row (if any) receives the token's K/V and how many rows to attend, and gives a
`merge(out, lse)` that combines this rank's partial attention with the other ranks' (the engine's
decode does it with one exchange per layer); the kernel calls it between each layer's attention
and output projection.

`FusedPrefill` runs a question's prefill on one rank (its T tokens over a document's rows) in one
call of the kernels the layer-by-layer path would run (a bf16 model on a CPU without bf16 units),
with that path's bits; the prefill engine (runtime/prefill.py) takes it where `takes` says so.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from dataclasses import dataclass

import torch

from ..kernels import abi, build, selection
from ..kernels.cpu_features import computes_in_float32
from .config import Experts
from .int8_weights import int8_of
from .kvcache import KVCache, forward_with_cache


class DecodeStep:
    """step(token) -> float32 logits [1, vocab] of the next position, for one cached sequence.

    Args:
        model: a ringctx Transformer.
        cache: the KVCache holding the sequence so far; each call appends one token.
        fused: try the fused CPU kernel (default); False always runs `forward_with_cache`.
    """

    def __init__(self, model, cache: KVCache, *, fused: bool = True):
        self.model, self.cache = model, cache
        self.kernel = FusedStep.build(model, cache) if fused else None
        self._input = torch.empty(1, dtype=torch.long, device=model.device)  # reused every step

    @property
    def is_fused(self) -> bool:
        """True when the steps run in the fused CPU kernel."""
        return self.kernel is not None

    def __call__(self, token: int) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(token)
        self._input.fill_(token)
        return forward_with_cache(self.model, self._input, self.cache)


class FusedStep:
    """One sequence's steps over one cache in the fused kernel: a `FusedBatchStep` of one row.

    Its attention sources: rows [0, shared_rows) of the cache as a document (never written), then
    rows [shared_rows, keys) as the sequence's own rows (the step's K/V written there first).
    """

    def __init__(self, model, cache: KVCache, shared_rows: int, batch: "FusedBatchStep"):
        self.model, self.cache, self.shared_rows, self.batch = model, cache, shared_rows, batch

    @classmethod
    def build(cls, model, cache: KVCache, shared_rows: int = 0) -> "FusedStep | None":
        """The fused step for this model and cache, or None where the kernel does not apply."""
        if not 0 <= shared_rows <= cache.length:
            raise ValueError(f"shared_rows must lie within the cache's {cache.length} rows, got {shared_rows}")
        batch = FusedBatchStep.build(model)
        if batch is None or cache.dtype != model.dtype or not batch.takes(cache):
            return None
        cache.check_model(model.config)
        if not all(t.is_contiguous() for t in cache.storage_tensors()):
            return None
        return cls(model, cache, shared_rows, batch)

    def __call__(self, token: int) -> torch.Tensor:
        cache = self.cache
        cache.ensure_room(1)
        position = cache.length
        x = self._layers(token, position, position, position + 1, None)
        cache.length = position + 1
        return step_logits(self.model, x)

    def split(self, token: int, position: int, write_row: int | None, keys: int, merge, *,
              logits: bool = True) -> torch.Tensor | None:
        """One step over this rank's slice of a split cache; float32 logits [1, vocab] (or None).

        position: the token's global position (its RoPE angle); write_row: the slice row that
        stores its K/V, None when another rank stores it; keys: slice rows attended (the written
        row included); merge(out [1, Hq, D], lse [Hq, 1]): given this rank's float32 partial,
        return the float32 output [1, Hq, D] merged over all ranks, or (out, lse), which a model
        with sink logits needs (None: this slice is the whole cache). A sliced cache's written row
        has its position set first (a windowed layer reads rows by position). The cache's `length`
        is the caller's to advance.
        """
        x = self._layers(token, position, write_row, keys, merge)
        return step_logits(self.model, x) if logits else None

    def _layers(self, token: int, position: int, write_row: int | None, keys: int, merge) -> torch.Tensor:
        shared = min(self.shared_rows, keys)
        if write_row is not None and write_row < shared:
            raise ValueError(f"row {write_row} belongs to the {shared} rows the generation found in the cache: "
                             "a step writes after them")
        documents = [AttentionSource(self.cache, [0], shared)] if shared else []
        own = [AttentionSource(self.cache, [0], keys - shared, None if write_row is None else write_row - shared,
                               first_row=shared)] if keys > shared else []
        return self.batch([token], [position], documents, own, merge)


@dataclass
class AttentionSource:
    """One KV cache a batched step attends, and the batch rows whose queries attend it.

    A document's rows: `rows` every sequence asking it, never written (write_row None). A
    sequence's own rows: `rows` its one batch row; write_row the row that takes the step's K/V
    (None: another rank stores this token). Rows are counted from `first_row` of the cache."""

    cache: KVCache
    rows: list[int]
    """Batch rows (indices into the step's tokens) whose queries attend this cache."""
    keys: int
    """Cache rows attended: first_row .. first_row + keys - 1 (a written row included)."""
    write_row: int | None = None
    """The row (counted from first_row) that takes the step's K/V first."""
    first_row: int = 0
    """Where the source starts in the cache (a lone sequence's own rows follow its document's)."""


class FusedBatchStep:
    """B tokens, one per sequence, through every layer and its attention in one C call
    (ringctx_decode_step_batch, csrc/cpu_decode.c).

    Each matrix product reads its weights once for all B rows (the lone step's sums, row by row);
    each row is rotated at its own position. Attention: each document's rows once for all the
    queries on it, then each sequence's own rows, merged by log-sum-exp, all inside the kernel; a
    rank holding part of the rows gives `merge`, called once per layer with this rank's float32
    partial (out [B, Hq, D], lse [Hq, B]) and returning the float32 output merged over every rank
    (runtime/batch.py: one exchange per layer for the whole batch).

        step = FusedBatchStep.build(model)                    # None where the kernel does not apply
        x = step(tokens, positions, documents, own, merge)    # [B, dim] model dtype, before the final norm
    """

    max_rows = selection.MAX_BATCH
    """Most tokens one call takes."""

    def __init__(self, model, lib: ctypes.CDLL):
        self.model, self.lib = model, lib
        self.shape, self.layers, self._sinks = _shape_and_layers(model)
        self._softmax = [model.layer_softmax(i) for i in range(model.config.n_layers)]
        self._spans = model.has_spans  # a span layer finds a row's keys by position
        self.rows, self.threads = 0, 0  # what the work buffer below is sized for
        self._merge, self._merge_error = None, None
        self._callback = abi.MERGE_FN(self._on_merge)  # one object, kept alive with the step
        self._pointers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> its layer tables

    @classmethod
    def build(cls, model) -> "FusedBatchStep | None":
        """The fused batch step for this model, or None where the kernel does not apply (the lone
        step's conditions on the model; caches are checked per call by `takes`)."""
        if not _layers_fit(model):
            return None
        lib = build.library()
        return None if lib is None else cls(model, lib)

    def takes(self, cache: KVCache) -> bool:
        """Whether the kernel reads this cache: rows in the model dtype or 8-bit, on the CPU."""
        stored = cache.k[0].dtype
        return cache.device.type == "cpu" and (stored == self.model.dtype or stored in abi.Q8_KINDS)

    def __call__(self, tokens: list[int], positions: list[int], documents: list[AttentionSource],
                 own: list[AttentionSource], merge=None) -> torch.Tensor:
        """tokens[i] at global position positions[i] -> the last layer's outputs [B, dim] (model
        dtype, before the final norm). documents: the shared caches (never written); own: at most
        one source per batch row, each with that one row. merge(out, lse) -> float32 [B, Hq, D] (or
        (out, lse [Hq, B]), which a model with sink logits needs), or None when these sources hold
        every key of every row. B must be 1 .. selection.MAX_BATCH.

        A layer with a span (window, chunk) reads, for each row, the rows of each source at the
        positions it sees: a cache's rows carry their positions (`KVCache.positions`, else row i is
        position i), in any order (searched in runs of increasing positions, `_segments`), and a
        cache that dropped rows a layer no longer sees (`KVCache.kept_from`) is read through that
        rule."""
        model = self.model
        B = len(tokens)
        if not 1 <= B <= selection.MAX_BATCH or len(positions) != B:
            raise ValueError(f"a fused batch step takes 1..{selection.MAX_BATCH} tokens, one position each "
                             f"(got {B} tokens, {len(positions)} positions)")
        vocab = model.config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"a token id is outside the vocabulary [0, {vocab}): tokenize with this model's tokenizer")
        self._prepare(B)
        sources, keep = self._sources(documents, own, B)
        x = model.embed(torch.tensor(tokens, dtype=torch.long)).contiguous()  # a new tensor: the kernel writes it
        at = torch.tensor(positions, dtype=torch.long)
        rope = model.rope(at, sequence_end=at + 1)  # each row is its own sequence's step (LongRoPE)
        # one cos/sin table per distinct RoPE of the layers (DecoderLayer.rope indexes them)
        tables = rope.angles if _per_layer(rope) else [rope]
        tables = [(t.cos.contiguous(), t.sin.contiguous()) for t in tables]
        cos = (ctypes.c_void_p * max(1, len(tables)))(*(c.data_ptr() for c, _ in tables))
        sin = (ctypes.c_void_p * max(1, len(tables)))(*(s.data_ptr() for _, s in tables))
        self._merge, self._merge_error = merge, None
        try:
            status = self.lib.ringctx_decode_step_batch(
                ctypes.byref(self.shape), self.layers, len(self.layers), x.data_ptr(), B, at.data_ptr(), cos, sin,
                len(tables), sources, len(sources), len(documents), self.work.data_ptr(), self.threads,
                self._callback if merge is not None else abi.MERGE_FN())
        finally:
            self._merge = None
            del keep, tables
        if self._merge_error is not None:  # a lost rank, say: the kernel finished on garbage
            raise self._merge_error
        if status == -3:
            raise ValueError("a windowed or chunked layer's query would see cache rows that layer no longer "
                             "stores (KVCache.kept_from): keep the rows every row's position still sees")
        if status != 0:
            raise RuntimeError(f"ringctx_decode_step_batch failed with status {status} (a source the kernel "
                               "refuses: check `takes` and that each own source has one row)")
        return x

    def _sources(self, documents: list[AttentionSource], own: list[AttentionSource], batch: int):
        """The kernel's source array, and what must stay alive while it runs (the row lists)."""
        array = (abi.AttentionSource * max(1, len(documents) + len(own)))()
        keep = []
        owned = [r for source in own for r in source.rows]
        if len(set(owned)) != len(owned):  # the kernel merges a row's own partial from one thread only
            raise ValueError(f"own attention sources name a batch row twice ({sorted(owned)}): one own cache per row")
        for slot, source in zip(array, list(documents) + list(own)):
            if not self.takes(source.cache):
                raise ValueError(f"the fused batch step cannot read a {source.cache.k[0].dtype} cache of a "
                                 f"{self.model.dtype} model")
            room = source.cache.max_tokens - source.first_row
            tables = self._layer_pointers(source.cache, source.first_row)
            room = min(room, tables.rows_held - source.first_row)
            if (not 0 <= source.first_row <= source.cache.max_tokens or any(not 0 <= r < batch for r in source.rows) or len(set(source.rows)) != len(source.rows)
                    or not 0 <= source.keys <= room
                    or (source.write_row is not None and not 0 <= source.write_row < min(source.keys, room))):
                raise ValueError(f"an attention source names rows {source.rows} (each once, inside the batch of "
                                 f"{batch}), {source.keys} keys or write row {source.write_row} outside its cache "
                                 f"of {room} rows from row {source.first_row} (the written row must be one of the "
                                 "keys attended)")
            rows = (ctypes.c_int64 * len(source.rows))(*source.rows)
            keep.append(rows)
            slot.k, slot.v = ctypes.addressof(tables.k), ctypes.addressof(tables.v)
            slot.k_scale = tables.k_scale and ctypes.addressof(tables.k_scale)
            slot.v_scale = tables.v_scale and ctypes.addressof(tables.v_scale)
            slot.stored_from = tables.stored_from and ctypes.addressof(tables.stored_from)
            positions = source.cache.positions
            if positions is not None:  # a slice: each row's position (a span layer's query reads them)
                slot.positions = positions.data_ptr() + source.first_row * positions.element_size()
                if self._spans:
                    segments = _segments(positions[source.first_row:source.first_row + source.keys])
                    keep.append(segments)
                    slot.segments, slot.n_segments = segments.data_ptr(), segments.numel()
            else:
                slot.positions, slot.first_position = None, source.first_row
            slot.rows, slot.n_rows, slot.keys = ctypes.addressof(rows), len(source.rows), source.keys
            slot.write_row = -1 if source.write_row is None else source.write_row
            slot.kv_q8 = abi.Q8_KINDS.get(source.cache.k[0].dtype, -1)
        return array, keep

    def _layer_pointers(self, cache: KVCache, first_row: int) -> "_LayerTables":
        """The [n_layers] pointer tables of a cache's k, v (and scales) from row `first_row`, built
        once per cache, start row and kept rows, and rebuilt if its buffers were replaced.

        Row i of layer l lives in slot i - kept_from(l) of its buffers, so layer l's entry points
        where row `first_row` is (before the buffer when rows were dropped: the kernel reads only
        rows from stored_from[l] = kept_from(l) - first_row on, and refuses a step needing others)."""
        n = len(cache.k)
        kept_rows = tuple(cache.kept_from(layer) for layer in range(n))
        key = (first_row, kept_rows, tuple(t.data_ptr() for t in cache.k))
        per_cache = self._pointers.setdefault(cache, {})
        tables = per_cache.get(first_row)
        if tables is None or tables.key != key:

            def table(tensors):
                return (ctypes.c_void_p * n)(*(t.data_ptr() + (first_row - kept) * t.stride(0) * t.element_size()
                                               for t, kept in zip(tensors, kept_rows)))

            scales = (table(cache.k_scale), table(cache.v_scale)) if cache.quantized else (None, None)
            stored = (ctypes.c_int64 * n)(*(kept - first_row for kept in kept_rows)) if any(kept_rows) else None
            held = min(t.shape[0] + kept for t, kept in zip(cache.k, kept_rows))  # rows past it have no slot
            tables = per_cache[first_row] = _LayerTables(key, table(cache.k), table(cache.v), *scales, stored, held)
        return tables

    def _prepare(self, rows: int) -> None:
        """The work buffer and its views sized for `rows` (reallocated only when B or the thread
        count changes)."""
        threads = torch.get_num_threads()
        if rows == self.rows and threads == self.threads:
            return
        self.rows, self.threads = rows, threads
        config, shape = self.model.config, ctypes.byref(self.shape)
        hq, d = config.n_heads, config.head_dim
        self.work = torch.empty(self.lib.ringctx_decode_batch_work_floats(shape, rows, threads))
        offsets = (ctypes.c_int64 * 4)()
        self.lib.ringctx_decode_batch_offsets(shape, rows, offsets)
        self._attn = self.work[offsets[1]:offsets[1] + rows * hq * d].view(rows, hq, d)
        self._out = self.work[offsets[2]:offsets[2] + rows * hq * d].view(rows, hq, d)
        self._lse = self.work[offsets[3]:offsets[3] + hq * rows].view(hq, rows)

    def _on_merge(self, layer: int) -> None:
        """The kernel's callback: the caller's merge of this layer's partials, its sinks applied
        (`LayerSoftmax.finish`, on the merged lse), rounded into attn (errors kept for __call__)."""
        if self._merge_error is not None:
            return
        try:
            merged = self._merge(self._out, self._lse)
            out, lse = merged if isinstance(merged, tuple) else (merged, None)
            softmax = self._softmax[layer]
            if softmax.sinks is not None:
                if lse is None:
                    raise ValueError("a layer with sink logits needs the merged lse: merge(out, lse) must return "
                                     "(out, lse) for this model")
                out = softmax.finish(out, lse)
            self._attn.copy_(out.to(self.model.dtype) if self.model.dtype != torch.float32 else out)
        except BaseException as exc:  # no exception may cross back into C
            self._merge_error = exc


class FusedPrefill:
    """A short prefill's layers on one rank in one C call (ringctx_prefill_rows, csrc/cpu_decode.c):
    a question's T tokens over the rows a cache already holds (its document's), with the bits of
    `Block.forward` run layer by layer, where that path's kernels are the ones the call is made of
    (`build` and `takes`, which ask kernels/selection.py what that path asks it): a bf16 model on a
    CPU without bf16 units (computing in float32), T rows in the range `linear` gives small_linear
    and whose blocks attention_block gives the float32 flash kernel. From Python such a prefill
    spent ~0.45 ms a layer between its kernels (a 15-token question over an 8K-token document,
    SmolLM2, 2 cores: 14 of its 100 ms).

        fused = FusedPrefill.build(model)                   # None where the kernel does not apply
        if fused is not None and fused.takes(T, cache, cached, backend):
            x = fused(x, rope, cache, cached, first, end)    # layers [first, end): [T, dim] model dtype

    The tokens' k, v go to cache rows cached .. cached + T - 1 of each layer run, as
    `KVCache.update` writes them; the caller advances the cache's length.
    """

    def __init__(self, model, lib: ctypes.CDLL, weights: tuple[int, ...]):
        # no reference to the model: _PREFILLS keeps this per model, and a value that held its key
        # would keep the model alive
        self.dtype, self.lib, self.weights = model.dtype, lib, weights
        self.shape, self.layers, _ = _shape_and_layers(model)
        # ring_attention's scale (1 / sqrt(D)), the Python path's
        self.shape.softmax_scale = 1.0 / math.sqrt(model.config.head_dim)
        self.group = model.config.n_heads // model.config.n_kv_heads

    @classmethod
    def build(cls, model) -> "FusedPrefill | None":
        """The fused prefill for this model, or None where it cannot apply: the fused batch step's
        conditions (`_layers_fit`), and a bf16 model on a CPU computing it in float32
        (`selection.fused_prefill_applies`: elsewhere `linear` and attention_block take other
        kernels at a question's rows). Kept per model while its weights stay where they are
        (building one took ~3 ms, once per question)."""
        if not selection.fused_prefill_applies(model.dtype, computes_in_float32(model.layers[0].attention_norm.weight),
                                               model.config.head_dim) or model.config.has_experts:
            return None  # experts: the layer path's products (grouped, or PyTorch's for an expert's many rows) differ
        lib = build.library()
        if lib is None:
            return None
        weights = tuple(t.data_ptr() for block in model.layers for t in _block_tensors(block))
        kept = _PREFILLS.get(model)
        if kept is not None and kept.lib is lib and kept.weights == weights:
            return kept
        if not _layers_fit(model) or not model.config.has_plain_attention:  # its kernel: plain causal layers
            return None
        _PREFILLS[model] = fused = cls(model, lib, weights)
        return fused

    def takes(self, rows: int, cache: KVCache, cached: int, backend: str) -> bool:
        """Whether `rows` tokens over `cached` rows of `cache` take exactly the kernels of this call
        on the Python path (`selection.fused_prefill_takes`: small_linear's rows past the
        decode-sized ones, the flash kernel for the full block over the cached rows and for the
        causal one); a cache in the model dtype with room for the rows."""
        if not selection.fused_prefill_takes(rows, self.group, cached, backend):
            return False
        return (cache.device.type == "cpu" and cache.k[0].dtype == self.dtype
                and 0 <= cached and cached + rows <= cache.max_tokens
                and all(t.is_contiguous() for t in cache.k + cache.v))

    def __call__(self, x: torch.Tensor, rope, cache: KVCache, cached: int, first: int, end: int) -> torch.Tensor:
        """Layers [first, end) over x [T, dim] (model dtype) at positions cached .. cached + T - 1
        (`rope`: their RopeAngles); returns the new x [T, dim]."""
        rows = x.shape[0]
        x = x.contiguous().clone()  # the kernel writes its result here
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        n = end - first
        pointers = ctypes.c_void_p * n
        k = pointers(*(t.data_ptr() for t in cache.k[first:end]))
        v = pointers(*(t.data_ptr() for t in cache.v[first:end]))
        threads = torch.get_num_threads()
        work = torch.empty(self.lib.ringctx_prefill_work_floats(ctypes.byref(self.shape), rows, threads))
        layers = ctypes.cast(ctypes.byref(self.layers, first * ctypes.sizeof(abi.DecoderLayer)),
                             ctypes.POINTER(abi.DecoderLayer))
        status = self.lib.ringctx_prefill_rows(ctypes.byref(self.shape), layers, n, x.data_ptr(), rows,
                                               cos.data_ptr(), sin.data_ptr(), k, v, cached, work.data_ptr(),
                                               threads)
        if status != 0:
            raise RuntimeError(f"ringctx_prefill_rows failed with status {status} ({rows} rows over {cached})")
        return x


_PREFILLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> its FusedPrefill (see FusedPrefill.build)."""


@dataclass
class _LayerTables:
    """A cache's per-layer pointer tables from one start row (FusedBatchStep._layer_pointers)."""

    key: tuple
    """(first_row, each layer's kept_from, each layer's k buffer address): what they were built for."""
    k: ctypes.Array
    v: ctypes.Array
    k_scale: ctypes.Array | None
    v_scale: ctypes.Array | None
    stored_from: ctypes.Array | None
    """[n_layers] the first row (from first_row) each layer stores, or None: every row."""
    rows_held: int
    """Rows of the cache every layer has a slot for (rows past it cannot be read or written)."""


def step_logits(model, x: torch.Tensor) -> torch.Tensor:
    """The final norm and LM head of a decode step's rows x [B, dim]: float32 logits [B, vocab],
    selection.MAX_ROWS rows at a time, so that every row goes through the product a lone step's
    row takes (past MAX_ROWS rows `linear` may take PyTorch's matmul, whose sums depend on the row
    count) and a row's logits do not depend on how many rows share the step."""
    return torch.cat([model.head(model.norm(rows)) for rows in x.split(selection.MAX_ROWS)])


def _layers_fit(model) -> bool:
    """Whether csrc/cpu_decode.c's layer code takes this model: one CPU rank (no TP), float32 or
    bf16, Llama's block (`ModelConfig.is_llama_block`; spans, scale, soft-cap, sinks and per-layer
    RoPE are per-layer data; not Llama 4's q/k norm after RoPE or query temperature, nor dual chunk
    attention; a mixture of experts only as `_fused_experts` says), heads it takes (one shape for
    every layer, `selection.fused_step_shape_fits`: head_dim a multiple of 16 up to 256, at most 64
    query heads per KV head), every layer's weights contiguous on the CPU in the model dtype."""
    config = model.config
    if model.tp.size > 1 or model.ep.size > 1 or model.device.type != "cpu" or \
            model.dtype not in (torch.float32, torch.bfloat16):
        return False  # (under EP a rank holds some of the experts: the layer path sums the ranks')
    if not config.is_llama_block:  # nor other norms, activations, embedding scales or logit caps
        return False
    if config.has_experts and _fused_experts(config) is None:
        return False  # experts the C layer does not compute (or not one `Experts` for every sparse layer)
    kinds = [config.attention(i) for i in range(config.n_layers)]
    if any(a.qk_norm_after_rope or a.temperature_floor or a.dual_chunk is not None for a in kinds):
        return False  # Llama 4's q/k norm after RoPE and query temperature, dual chunk attention: not in C
    if not config.uniform_heads or not selection.fused_step_shape_fits(config.head_dim, config.n_heads,
                                                                       config.n_kv_heads):
        return False  # one head shape for every layer (the kernel's DecoderShape has one)
    weights = [t for block in model.layers for t in _block_tensors(block)]
    return all(t.is_contiguous() and t.device.type == "cpu" and t.dtype == model.dtype for t in weights)


def _fused_experts(config):
    """The one `Experts` of every sparse layer of `config` when csrc/cpu_decode.c's layer_experts
    computes it (a softmax top-k router, nothing else non-default: a field another family adds,
    such as shared experts, makes the layer path take it), else None; None too for a model with no
    experts. The kernel's routing arrays bound E and k (abi.MAX_EXPERTS, MAX_EXPERTS_PER_TOKEN)."""
    kinds = {e for e in config.layer_experts if e is not None}
    if len(kinds) != 1:
        return None
    (experts,) = kinds
    computed = Experts(experts.n_experts, experts.experts_per_token, experts.expert_ffn_dim,
                       renormalize=experts.renormalize, weights_in_model_dtype=experts.weights_in_model_dtype)
    if experts != computed or experts.n_experts > abi.MAX_EXPERTS or \
            experts.experts_per_token > abi.MAX_EXPERTS_PER_TOKEN:
        return None
    return experts


def _shape_and_layers(model):
    """The kernel's DecoderShape and DecoderLayer array for `model` (its caches come per step, as
    attention sources), and the float32 sink logits the layers point to (kept alive with them)."""
    config = model.config
    shape = abi.DecoderShape(
        dim=config.dim, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
        ffn_dim=config.ffn_dim, norm_eps=model.layers[0].attention_norm.eps,
        softmax_scale=config.head_dim ** -0.5, bf16=int(model.dtype == torch.bfloat16))
    experts = _fused_experts(config)
    if experts is not None:  # the routing every sparse layer shares (DecoderLayer.router marks those)
        shape.n_experts, shape.experts_per_token = experts.n_experts, experts.experts_per_token
        shape.expert_ffn_dim, shape.renormalize = experts.expert_ffn_dim, int(experts.renormalize)
        shape.weights_in_model_dtype = int(experts.weights_in_model_dtype)
    layers = (abi.DecoderLayer * config.n_layers)()
    probe = model.rope(torch.zeros(1, dtype=torch.long))  # which of a step's RoPE tables each layer takes
    rope_of = probe.of_layer if _per_layer(probe) else [0] * config.n_layers
    sinks = []
    for i, block in enumerate(model.layers):
        attention, mlp = block.attention, block.feed_forward
        softmax = block.softmax()
        if softmax.sinks is not None:
            sinks.append(softmax.sinks.float().contiguous())
        layers[i] = abi.DecoderLayer(
            attention_norm=block.attention_norm.weight.data_ptr(),
            wqkv=attention.wqkv.weight.data_ptr(), bqkv=_pointer(attention.wqkv.bias),
            wo=attention.wo.weight.data_ptr(), bo=_pointer(attention.wo.bias),
            ffn_norm=block.ffn_norm.weight.data_ptr(), w13=_ffn_weight(mlp.w13).data_ptr(),
            w2=_ffn_weight(mlp.w2).data_ptr(), router=_pointer(mlp.router.weight if _is_moe(mlp) else None),
            q_norm=_pointer(attention.q_norm.weight if attention.q_norm is not None else None),
            k_norm=_pointer(attention.k_norm.weight if attention.k_norm is not None else None),
            sinks=_pointer(sinks[-1] if softmax.sinks is not None else None), window=softmax.span.window,
            chunk=softmax.span.chunk, rotary_dim=config.rope_of(i)[2], scale=softmax.scale, softcap=softmax.softcap,
            rope=rope_of[i])
        if model.dtype == torch.bfloat16 and selection.reads_int8_weights():  # int8 weights: their codes
            ffn = () if _is_moe(mlp) else (("w13", mlp.w13), ("w2", mlp.w2))  # (experts: no int8 codes)
            for name, linear in (("wqkv", attention.wqkv), ("wo", attention.wo)) + ffn:
                codes = int8_of(linear.weight)
                if codes is not None:
                    setattr(layers[i], name + "_codes", codes.codes.data_ptr())
                    setattr(layers[i], name + "_exps", codes.exponents.data_ptr())
    return shape, layers, sinks


def _segments(positions: torch.Tensor) -> torch.Tensor:
    """The first row of each run of rows whose positions increase, int64 [n] (0 first): one for a
    cache in position order, a few for a slice written in pieces (a ring prefill's arrival order).
    The kernel finds the rows a windowed or chunked layer sees by binary search within each."""
    breaks = torch.nonzero(positions[1:] <= positions[:-1]).view(-1) + 1
    return torch.cat([torch.zeros(1, dtype=torch.long), breaks])


def _per_layer(rope) -> bool:
    """Whether `Transformer.rope` gave LayerRopes (a table per distinct RoPE, `of_layer` naming each
    layer's) rather than one RopeAngles (asked by attribute: transformer.py imports this module's
    importers, so this module does not import it)."""
    return hasattr(rope, "of_layer")


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _is_moe(mlp) -> bool:
    """Whether a block's feed-forward is a MixtureOfExperts (asked by attribute, as `_per_layer`)."""
    return hasattr(mlp, "router")


def _ffn_weight(weight) -> torch.Tensor:
    """A feed-forward's w13 or w2 tensor: the dense MLP's Linear's weight, the experts' Parameter
    ([E, 2F, dim] or [E, dim, F]) itself."""
    return weight if isinstance(weight, torch.Tensor) else weight.weight


def _block_tensors(block) -> list[torch.Tensor]:
    attention, mlp = block.attention, block.feed_forward
    tensors = [block.attention_norm.weight, attention.wqkv.weight, attention.wo.weight, block.ffn_norm.weight,
               _ffn_weight(mlp.w13), _ffn_weight(mlp.w2)] + ([mlp.router.weight] if _is_moe(mlp) else [])
    optional = (attention.wqkv.bias, attention.wo.bias, attention.q_norm and attention.q_norm.weight,
                attention.k_norm and attention.k_norm.weight)
    return tensors + [t for t in optional if t is not None]
