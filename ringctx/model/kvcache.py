"""Static KV cache for decoding, and the default single-device `attend`.

Per layer, K and V live in preallocated buffers [max_tokens, Hkv, D] (token-major, KV heads never
expanded). Shapes never change while decoding, so a decode step allocates no cache memory and
attention reads a prefix view of the buffers. The prefill engine hands its gathered K/V over with
`KVCache.from_tensors`.

Two variations serve caches larger than one device:
- `kv_dtype` "int8" or "fp8" stores every row in 8 bits with a float32 scale per token and KV head
  (ringctx.attention.quant): rows are quantized as they are written and attention dequantizes
  them block by block (`attend_rows`), never the whole cache at once.
- `positions` (a slice of a sequence): the rows are some of the sequence's tokens in any order, as
  a decode rank holds them when the cache is split by token over several ranks; `positions[i]` is
  the global position of row i. Attention over cached tokens does not depend on their order (RoPE
  is already applied to the keys), so a slice is attended exactly like a whole cache.

A windowed or chunked layer needs only the rows its later queries can see (the last W, or the
current chunk). `drop_unseen` frees the others: layer l then stores rows kept_from(l) .. of the
shared row numbering, row i in slot i - kept_from(l) of buffers [max_tokens - kept_from(l), Hkv, D].
Every read and write goes through that rule; a full layer never drops a row. A 1M-token document
of a 3:1 windowed:full model so keeps about a quarter of the rows of the same model all full.

    cache = KVCache.for_model(model.config, max_tokens=4096, dtype=model.dtype)
    logits = forward_with_cache(model, token_ids, cache)     # prefill: positions 0..T-1
    logits = forward_with_cache(model, next_token, cache)    # decode: position T
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..attention import PartialAccumulator, attention_block, attention_with_cache
from ..attention import quant
from ..attention.spans import KeyRows, LayerSoftmax, Run, Span, is_plain, query_heads, runs_of, span_attention
from ..attention.quant import check_kv_dtype, dequantize_rows, is_quantized, quantize_rows, storage_dtype
from .config import LinearShape, ModelConfig
from .gated_deltanet import LinearState
from ..host_memory import collapse_steps, host_tensors, release_pages


class KVCache:
    """Per-layer K and V buffers [max_tokens, Hkv, D] of one sequence, filled up to `length`.

    Attributes:
        k, v: lists (one per layer) of [max_tokens, Hkv, D] tensors in the storage dtype (the
            model's dtype, or int8 / float8_e4m3fn for the 8-bit formats).
        k_scale, v_scale: lists of [max_tokens, Hkv] float32 scales (8-bit formats), else None.
        kv_dtype: "model" (rows stored in `dtype`), another float dtype's name, "int8" or "fp8".
        length: number of valid rows (rows 0 .. length-1). `update` writes rows but does not move
            it (every layer writes the same rows); `forward_with_cache` advances it once per step.
        positions: None when row i holds position i (a whole sequence in order), else a [max_tokens]
            long tensor of each row's global position (a slice of a sequence split over ranks).
    """

    def __init__(
        self,
        n_layers: int,
        max_tokens: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_dtype: str = "model",
        sliced: bool = False,
        small_pages: bool = False,
        kept: Sequence[int] | None = None,
        shapes: Sequence[tuple[int, int]] | None = None,
        linear: Sequence[LinearShape | None] | None = None,
    ):
        """dtype: what reads return and writes take (the model's dtype); kv_dtype: how rows are
        stored (see the class docstring); sliced: keep a `positions` index (rows in any order);
        small_pages: on a CPU, in ordinary pages, not 2 MiB ones (a prefill's cache, written chunk by
        chunk: see ringctx.host_memory); kept: per layer, the first row it stores (default 0: all);
        shapes: per layer, (KV heads, head width) of its rows when layers differ (Gemma 4 31B's
        full layers; `ModelConfig.kv_shapes`), default (n_kv_heads, head_dim) for every layer;
        linear: per layer, its linear-attention shape or None (`ModelConfig.layer_linear`: those
        layers keep a `LinearState`, zero to start, instead of rows; their shapes give 0 heads)."""
        if max_tokens <= 0:
            raise ValueError(f"KVCache: max_tokens must be positive, got {max_tokens}")
        kept = [0] * n_layers if kept is None else [int(r) for r in kept]
        shapes = [(n_kv_heads, head_dim)] * n_layers if shapes is None else [(int(h), int(d)) for h, d in shapes]
        if len(shapes) != n_layers:
            raise ValueError(f"KVCache: shapes must give each of the {n_layers} layers its (KV heads, head dim), "
                             f"got {len(shapes)}")
        if len(kept) != n_layers or any(not 0 <= r <= max_tokens for r in kept):
            raise ValueError(f"KVCache: kept must give each of the {n_layers} layers a first row in "
                             f"[0, {max_tokens}], got {kept}")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.compute_dtype = dtype
        stored = storage_dtype(kv_dtype, dtype)
        # empty, not zeros: rows at or past `length` are never read, and pages never written cost
        # no memory, so a cache sized for prompt + decode room fills in as the hand-off writes it.
        # On a CPU they share one mapping in 2 MiB pages (ringctx.host_memory), layer by layer, K
        # then V (then their scales): a decode step reads the whole cache, and faster from there
        # (small_pages: the same mapping in ordinary pages).
        quantized = is_quantized(kv_dtype)
        specs = []
        for first, (heads, width) in zip(kept, shapes):
            shape = (max_tokens - first, heads, width)
            specs += [(shape, stored)] * 2 + ([(shape[:2], torch.float32)] * 2 if quantized else [])
        buffers = _empty_buffers(specs, device, small_pages=small_pages)
        self.small_pages = small_pages
        stride = 4 if quantized else 2
        self.k, self.v = buffers[0::stride], buffers[1::stride]
        self.k_scale = self.v_scale = None
        if quantized:
            self.k_scale, self.v_scale = buffers[2::stride], buffers[3::stride]
        self.positions = torch.empty(max_tokens, dtype=torch.long) if sliced else None
        self.length = 0
        self.max_tokens = max_tokens
        self.kept = kept
        self.spans: list[Span] | None = None  # set by drop_unseen: what each layer's rows are kept for
        self.linear_states: list[LinearState | None] | None = None
        self.linear_shapes: list[LinearShape | None] | None = list(linear) if linear else None
        """Per layer, the linear-attention shape of the layers that keep a state (None for the
        others); None for a cache of attention layers only."""
        if linear:
            self.linear_states = [None if shape is None else LinearState.zeros(shape, dtype, device)
                                  for shape in linear]

    def kept_from(self, layer: int) -> int:
        """The first row this layer still stores: rows below it were dropped (a windowed or chunked
        layer keeps only what later tokens can see). Row i of the layer lives in slot
        i - kept_from(layer) of its buffers."""
        return self.kept[layer]

    @classmethod
    def for_model(
        cls, config: ModelConfig, max_tokens: int, *, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", kv_dtype: str = "model", sliced: bool = False,
        small_pages: bool = False, kept: Sequence[int] | None = None,
    ) -> "KVCache":
        """An empty cache with this model's layer count and each layer's KV heads and head width."""
        return cls(config.n_layers, max_tokens, config.n_kv_heads, config.head_dim, dtype=dtype, device=device,
                   kv_dtype=kv_dtype, sliced=sliced, small_pages=small_pages, kept=kept,
                   shapes=None if config.uniform_heads else config.kv_shapes, linear=config.layer_linear)

    def empty_like(self, max_tokens: int, *, sliced: bool, kept: Sequence[int] | None = None,
                   small_pages: bool = False) -> "KVCache":
        """An empty cache with this one's layers, row shapes, dtypes and device, room for `max_tokens`
        (linear layers' states zero)."""
        return KVCache(self.n_layers, max_tokens, *self.shapes[0], dtype=self.dtype, device=self.device,
                       kv_dtype=self.kv_dtype, sliced=sliced, small_pages=small_pages, kept=kept,
                       shapes=self.shapes, linear=self.linear_shapes)

    @classmethod
    def from_tensors(
        cls,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        *,
        length: int | None = None,
        max_tokens: int | None = None,
    ) -> "KVCache":
        """A cache holding the K/V handed over by the prefill engine.

        Args:
            k, v: one tensor per layer, [P, Hkv, D] each (the same P, dtype and device; a layer's
                Hkv and D may be its own).
            length: valid tokens; defaults to P.
            max_tokens: capacity. None: use the given tensors as the buffers, without copying
                (allocate them with room to decode into). Otherwise new buffers of this size
                are allocated and the first `length` rows copied in.
        """
        if len(k) != len(v) or not k:
            raise ValueError(f"KVCache.from_tensors: need one K and one V per layer, got {len(k)} and {len(v)}")
        shape, dtype, device = k[0].shape, k[0].dtype, k[0].device
        for i, (ki, vi) in enumerate(zip(k, v)):
            if ki.dim() != 3 or ki.shape[0] != shape[0] or vi.shape != ki.shape:
                raise ValueError(f"KVCache.from_tensors: layer {i} has K {tuple(ki.shape)} and V {tuple(vi.shape)}, "
                                 f"expected both [{shape[0]}, Hkv, D] (tokens, KV heads, head dim)")
            if ki.dtype != dtype or vi.dtype != dtype or ki.device != device or vi.device != device:
                raise ValueError(f"KVCache.from_tensors: layer {i} differs in dtype or device from layer 0")
        length = shape[0] if length is None else length
        if not 0 <= length <= shape[0]:
            raise ValueError(f"KVCache.from_tensors: length {length} outside [0, {shape[0]}]")
        cache = cls.__new__(cls)
        cache.kv_dtype, cache.compute_dtype = "model", dtype
        cache.k_scale = cache.v_scale = cache.positions = None
        cache.small_pages = False
        cache.kept, cache.spans = [0] * len(k), None
        cache.linear_states = cache.linear_shapes = None  # a hybrid's: the caller sets both
        cache.max_tokens = shape[0] if max_tokens is None else max_tokens
        if max_tokens is None:
            cache.k, cache.v = list(k), list(v)
        else:
            if max_tokens < length:
                raise ValueError(f"KVCache.from_tensors: max_tokens={max_tokens} cannot hold the {length} given tokens")
            buffers = _empty_buffers([((max_tokens, *t.shape[1:]), dtype) for t in k for _ in "kv"], device, zero=True)
            cache.k, cache.v = buffers[0::2], buffers[1::2]
            for dst, src in zip(cache.k + cache.v, list(k) + list(v)):
                dst[:length].copy_(src[:length])
        cache.length = length
        return cache

    # -- shape -------------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.k)

    def state_bytes(self) -> int:
        """Bytes of the linear layers' states (0 without them)."""
        return sum(st.nbytes for st in self.linear_states or () if st is not None)

    def _check_rewind(self, length: int, what: str) -> None:
        """A linear layer's state stands after the cache's last token and cannot go back."""
        if self.linear_states is not None and length != self.length:
            raise ValueError(f"{what}: this cache's linear-attention layers keep a state after its {self.length} tokens, "
                             f"not a row per token, so it cannot stand at {length} tokens; prefill those tokens into "
                             "a new cache instead")

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Per layer, (KV heads, head width) of its rows."""
        return [(t.shape[1], t.shape[2]) for t in self.k]

    @property
    def n_kv_heads(self) -> int:
        """KV heads of every layer (a ValueError when layers differ: read `shapes`)."""
        return self._uniform()[0]

    @property
    def head_dim(self) -> int:
        """Head width of every layer (a ValueError when layers differ: read `shapes`)."""
        return self._uniform()[1]

    def _uniform(self) -> tuple[int, int]:
        shapes = set(self.shapes)
        if len(shapes) > 1:
            raise ValueError(f"this KV cache's layers differ in (KV heads, head dim): {sorted(shapes)}; "
                             "read KVCache.shapes per layer")
        return shapes.pop()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype rows are read and written in (the model's); see `kv_dtype` for storage."""
        return self.compute_dtype

    @property
    def quantized(self) -> bool:
        """True when rows are stored in 8 bits with scales."""
        return self.k_scale is not None

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers (capacity, not just the valid prefix), scales and linear states included."""
        return sum(t.numel() * t.element_size() for t in self.storage_tensors()) + self.state_bytes()

    def huge_page_steps(self):
        """A small-pages cache's memory moved into 2 MiB pages, one page per step (a generator, see
        ringctx.host_memory.collapse_steps); once exhausted the cache counts as in 2 MiB pages."""
        try:
            yield from collapse_steps(self.storage_tensors())
        finally:
            self.small_pages = False

    def storage_tensors(self, layer: int | None = None) -> list[torch.Tensor]:
        """The buffers as stored, [k, v] or [k, v, k_scale, v_scale] (of one layer, or of all)."""
        layers = range(self.n_layers) if layer is None else (layer,)
        out = []
        for i in layers:
            out += [self.k[i], self.v[i]] + ([self.k_scale[i], self.v_scale[i]] if self.quantized else [])
        return out

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes of one token over all layers (K, V and their scales)."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.storage_tensors())

    @property
    def stored_bytes(self) -> int:
        """Bytes of the valid rows each layer stores (K, V and scales; not the room after them)."""
        return sum((self.length - min(self.kept[i], self.length)) * math.prod(t.shape[1:]) * t.element_size()
                   for i in range(self.n_layers) for t in self.storage_tensors(i))

    @property
    def trimmed(self) -> bool:
        """Whether some layer dropped rows (`drop_unseen`)."""
        return any(self.kept)

    def stored_rows(self, layer: int, start: int, stop: int) -> list[torch.Tensor]:
        """Views of rows start..stop-1 of one layer as stored, [k, v] or [k, v, k_scale, v_scale]
        (a ValueError when the layer dropped some of them)."""
        a, b = self._slots(layer, start, stop)
        return [t[a:b] for t in self.storage_tensors(layer)]

    def rows_as_sent(self, layer: int, start: int, stop: int) -> list[torch.Tensor]:
        """Rows start..stop-1 of one layer as stored ([k, v] or with scales), those the layer
        dropped as zeros: views when it holds them all, else copies. A hand-off sends a shard's
        rows so, and the receiver skips the dropped ones."""
        first = self.kept[layer]
        if start >= first:
            return self.stored_rows(layer, start, stop)
        out = []
        for t in self.storage_tensors(layer):
            rows = t.new_zeros((stop - start, *t.shape[1:]))
            if stop > first:
                rows[first - start:] = t[:stop - first]
            out.append(rows)
        return out

    def _slots(self, layer: int, start: int, stop: int) -> tuple[int, int]:
        first = self.kept[layer]
        if start < first and stop > start:
            raise ValueError(f"KV cache layer {layer} dropped its rows below {first} (a windowed or chunked "
                             f"layer keeps what later tokens see); rows {start}..{stop - 1} were asked for")
        return start - first, stop - first

    def check_model(self, config: ModelConfig) -> None:
        """Raise a ValueError unless this cache's shapes fit `config`."""
        if self.shapes != config.kv_shapes:
            have, want = _describe_shapes(self.shapes), _describe_shapes(config.kv_shapes)
            raise ValueError(f"KV cache has (layers, KV heads, head dim) = {have} but model {config.name!r} "
                             f"needs {want}")

    # -- contents ----------------------------------------------------------------------------

    def update(self, layer: int, positions: torch.Tensor | int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, Hkv, D] of one layer at `positions` (quantized here for 8-bit caches).

        positions: [T] long tensor of cache rows, or an int `start` for rows start..start+T-1
        (a slice copy: the fast path for prefill and decode).
        """
        first = self.kept[layer]
        if isinstance(positions, int):
            rows = slice(*self._slots(layer, positions, positions + k.shape[0]))
        else:
            if first and positions.numel() and int(positions.min()) < first:
                self._slots(layer, int(positions.min()), first)  # raises: a write below the kept rows
            rows = positions - first if first else positions
        if self.quantized:
            for data, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                q, s = quantize_rows(x, self.kv_dtype)
                write_rows(data[layer], rows, q)
                write_rows(scale[layer], rows, s)
            return
        write_rows(self.k[layer], rows, k.to(self.k[layer].dtype))
        write_rows(self.v[layer], rows, v.to(self.v[layer].dtype))

    def read_rows(self, layer: int, start: int, stop: int, dtype: torch.dtype | None = None):
        """(k, v) of rows start..stop-1 of one layer in `dtype` (default: the cache's dtype): views
        of the buffers when nothing needs converting, else copies (dequantized); read 8-bit caches
        in blocks."""
        return self._read(self.k, self.k_scale, layer, start, stop, dtype), \
            self._read(self.v, self.v_scale, layer, start, stop, dtype)

    def keys(self, layer: int) -> torch.Tensor:
        """Valid keys of one layer [length, Hkv, D] (a view; a dequantized copy for 8-bit caches)."""
        return self._read(self.k, self.k_scale, layer, 0, self.length)

    def values(self, layer: int) -> torch.Tensor:
        """Valid values of one layer [length, Hkv, D] (a view; a dequantized copy for 8-bit caches)."""
        return self._read(self.v, self.v_scale, layer, 0, self.length)

    def _read(self, data, scale, layer: int, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        start, stop = self._slots(layer, start, stop)
        if scale is not None:
            return dequantize_rows(data[layer][start:stop], scale[layer][start:stop], dtype)
        return data[layer][start:stop].to(dtype)

    def attend_rows(self, layer: int, q: torch.Tensor, stop: int | None = None, *, backend: str = "auto",
                    softmax_scale: float | None = None, softmax: LayerSoftmax | None = None,
                    q_positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [T, Hq, D] over rows 0..stop-1 (default: the valid rows): (out [T, Hq, D],
        lse [Hq, T] float32), a partial (sinks not applied). 8-bit rows are dequantized block by
        block inside the attention.

        Plain layers (softmax None or plain): every query sees every row (a full block). Otherwise
        query t at position q_positions[t] sees the rows its layer's span and causality allow, by
        the rows' positions (`row_positions`), and softmax's scale and soft-cap apply."""
        stop = self.length if stop is None else stop
        if not is_plain(softmax):
            return self._attend_span(layer, q, stop, softmax, q_positions, backend)
        self._slots(layer, 0, stop)  # a full layer keeps every row
        if softmax is not None:
            softmax_scale = softmax.scale
        if self.quantized:
            return quant.attention_block_quantized(q, self.k[layer][:stop], self.k_scale[layer][:stop],
                                                   self.v[layer][:stop], self.v_scale[layer][:stop],
                                                   softmax_scale=softmax_scale, backend=backend)
        return attention_block(q, self.k[layer][:stop], self.v[layer][:stop], softmax_scale=softmax_scale,
                               backend=backend)

    def _attend_span(self, layer, q, stop, softmax, q_positions, backend):
        """attend_rows for a layer with a span or a soft-cap: each query against the rows it sees."""
        if q_positions is None or len(q_positions) != q.shape[0]:
            raise ValueError("a windowed, chunked or soft-capped layer's attention over a cache needs "
                             "each query's position (q_positions)")
        # Rows past `length` were written for this step (their positions set by the writer first).
        first_row = self.kept[layer]  # rows below it are ones no query here sees
        k_runs = runs_of(torch.arange(first_row, stop) if self.positions is None else self.positions[first_row:stop],
                         row=first_row)
        q_runs = [Run(t, p, 1) for t, p in enumerate(q_positions)]
        first = min(softmax.span.first_visible(p) for p in q_positions)
        wanted = [r for r in k_runs if r.position + r.length > first]  # rows any query may see
        if not wanted:
            heads = query_heads(q, softmax)  # a dual chunk layer's q holds three versions of each head
            return (q.new_zeros(q.shape[0], heads, q.shape[2]),
                    torch.full((heads, q.shape[0]), float("-inf"), device=q.device))
        lo, hi = min(r.row for r in wanted), max(r.row + r.length for r in wanted)
        k, v = self.read_rows(layer, lo, hi, q.dtype)  # views; dequantized rows of 8-bit caches
        runs = [Run(r.row - lo, r.position, r.length) for r in wanted]
        return span_attention(q, q_runs, [KeyRows(k, v, runs)], softmax, backend=backend, one_sequence=False)

    def grown(self, max_tokens: int) -> "KVCache":
        """A cache with room for `max_tokens` rows holding this one's valid rows (self if it has the room)."""
        if max_tokens <= self.max_tokens:
            return self
        out = self.empty_like(max_tokens, sliced=self.positions is not None, small_pages=self.small_pages,
                              kept=self.kept)
        out.spans = self.spans
        copy_rows(out, 0, self, 0, self.length)
        if self.linear_states is not None:
            out.linear_states = [None if st is None else st.clone() for st in self.linear_states]
            out.linear_shapes = list(self.linear_shapes)
        if self.positions is not None:
            out.positions[:self.length] = self.positions[:self.length]
        out.length = self.length
        return out

    def reset(self) -> None:
        """Forget all tokens (buffers are kept, not cleared)."""
        if self.trimmed:
            raise ValueError("a cache whose windowed or chunked layers dropped rows has shorter buffers for them: "
                             "make a new cache (KVCache.for_model) instead of resetting this one")
        self.length = 0
        for st in self.linear_states or ():
            if st is not None:
                st.zero_()

    def truncate(self, length: int, linear_states: "list[LinearState | None] | None" = None) -> None:
        """Keep only the first `length` tokens (e.g. to reuse a shared prompt prefix). A cache with
        linear-attention layers needs their states at `length` (`linear_states`, taken as they are):
        they cannot be recovered from the rows; without them only its own length is allowed."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length {length} outside [0, {self.length}]")
        if self.linear_states is not None and linear_states is not None:
            if len(linear_states) != self.n_layers:
                raise ValueError(f"KVCache.truncate: {len(linear_states)} linear states for {self.n_layers} layers")
            self.linear_states = list(linear_states)
        else:
            self._check_rewind(length, "KVCache.truncate")
        if length < max(self.kept):
            raise ValueError(f"KVCache.truncate: a windowed or chunked layer dropped rows below "
                             f"{max(self.kept)}, so the cache cannot be cut back to {length} rows")
        self.length = length

    def ensure_room(self, n_new: int, what: str = "input") -> None:
        """Raise a ValueError if n_new more tokens do not fit."""
        if self.length + n_new > self.max_tokens:
            raise ValueError(
                f"{what} of {n_new} tokens does not fit the KV cache: {self.length} cached + {n_new} new > "
                f"max_tokens={self.max_tokens}; create the cache with max_tokens >= {self.length + n_new} "
                "(prompt plus max_new_tokens), or shorten the input")

    def row_positions(self) -> torch.Tensor:
        """Global positions [length] of the valid rows."""
        if self.positions is None:
            return torch.arange(self.length)
        return self.positions[:self.length]

    def in_position_order(self) -> bool:
        """Whether the valid rows lie in increasing position order (a cache in sequence order does)."""
        if self.positions is None or self.length < 2:
            return True
        positions = self.positions[:self.length]
        return bool((positions[1:] > positions[:-1]).all())

    def sorted_by_position(self) -> "KVCache":
        """This cache with its valid rows in position order: self when they are, else a sorted copy
        (the same rows and room; attention over them gives the same result up to summation order)."""
        if self.in_position_order():
            return self
        if self.trimmed:
            raise ValueError("a cache whose layers dropped rows keeps them in position order; this one is not")
        order = torch.argsort(self.positions[:self.length])
        out = self.empty_like(self.max_tokens, sliced=True, small_pages=self.small_pages)
        for dst, src in zip(out.storage_tensors(), self.storage_tensors()):
            torch.index_select(src[:self.length], 0, order.to(src.device), out=dst[:self.length])
        out.positions[:self.length] = self.positions[:self.length][order]
        out.length = self.length
        return out

    def view_below(self, tokens: int) -> "KVCache":
        """A cache over the same storage whose valid rows are this one's at positions below `tokens`
        (its rows must be in position order: they are then its first rows). Nothing is copied but
        the positions: a write past the view's rows lands in this cache's storage, which whoever
        writes must put back (runtime/batch.py: a question's join on a borrowed document)."""
        if not self.in_position_order():
            raise ValueError("a view of a cache needs its rows in position order (sorted_by_position)")
        if not self.serves_prefix(tokens):
            raise ValueError(f"a view below {tokens} tokens needs rows a windowed or chunked layer dropped")
        if self.linear_states is not None:
            raise ValueError("a view of a cache with linear-attention layers: their states stand after the whole "
                             "cache, not at a prefix; copy the cache instead")
        positions = self.row_positions()
        rows = int(torch.searchsorted(positions, torch.tensor(int(tokens))))
        out = KVCache.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        out.kept = list(self.kept)
        out.k, out.v = list(self.k), list(self.v)
        if self.quantized:
            out.k_scale, out.v_scale = list(self.k_scale), list(self.v_scale)
        out.positions = self.positions.clone() if self.positions is not None else None
        out.small_pages = False  # its storage is the other cache's: moved into huge pages with it, not alone
        out.length = rows
        return out

    def serves_prefix(self, tokens: int) -> bool:
        """Whether this cache's rows below position `tokens` are a whole cache of those tokens: a
        layer that dropped rows must still hold every row that a token at `tokens` sees. Rows in
        position order (`view_below`)."""
        if not self.trimmed:
            return True
        positions = self.row_positions()
        rows = int(torch.searchsorted(positions, torch.tensor(int(tokens))))
        for first, span in zip(self.kept, self.spans):
            # the view's rows of this layer start at `first`, and no dropped row is one it sees
            if first and (rows < first or int(positions[first - 1]) >= span.first_visible(int(tokens))):
                return False
        return True

    def drop_unseen(self, spans: Sequence[Span], next_position: int, *, least: int = 1,
                    in_place: bool = False) -> int:
        """Free the rows that no token at `next_position` or later sees in a windowed or chunked
        layer (spans[l]: layer l's; a full layer keeps everything), when a layer can drop at least
        `least` more rows. The kept rows move into new, smaller buffers (one arena, as allocated),
        in position order (a slice whose rows were not is sorted on the way: attention does not
        depend on their order); returns the rows dropped over all layers (0: nothing changed).

        in_place (rows in position order only): nothing moves; each layer's buffers become views
        that start at its first kept row, and the whole memory pages under the dropped rows go back
        to the system (a CPU cache: `release_pages`). A prefill's shard does this after every chunk,
        so a windowed layer's memory stays about its window however long the prompt.

        Who owns the cache calls it: after a document's prefill (next_position = its length), and
        every so often while decoding one sequence (a ring buffer in steps of `least` rows)."""
        if len(spans) != self.n_layers:
            raise ValueError(f"drop_unseen: {len(spans)} spans for a cache of {self.n_layers} layers")
        if in_place:
            return self._drop_in_place(spans, next_position, least)
        # ordinary tensors, not inference ones, even when called under inference_mode (a prefill's
        # hand-off): the cache is written outside it later (positions of a question's rows)
        with torch.inference_mode(False):
            return self._drop_unseen(spans, next_position, least)

    def _kept_for(self, spans, next_position, positions) -> list[int]:
        """Per layer, the first row a token at `next_position` or later still sees (rows in position
        order, `positions` theirs); never below what the layer already dropped."""
        kept = list(self.kept)
        for layer, span in enumerate(spans):
            if not span.sees_everything:
                horizon = torch.tensor(span.first_visible(int(next_position)), device=positions.device)
                kept[layer] = max(kept[layer], int(torch.searchsorted(positions, horizon)))
        return kept

    def _drop_in_place(self, spans, next_position, least) -> int:
        if not self.in_position_order():
            raise ValueError("drop_unseen(in_place=True) needs the rows in position order")
        kept = self._kept_for(spans, next_position, self.row_positions())
        self.spans = list(spans)
        if all(new - old < least for new, old in zip(kept, self.kept)):
            return 0
        dropped = 0
        for layer, (new, old) in enumerate(zip(kept, self.kept)):
            if new == old:
                continue
            for buffers in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ()):
                release_pages(buffers[layer][:new - old])
                buffers[layer] = buffers[layer][new - old:]
            dropped += new - old
        self.kept = kept
        return dropped

    def _drop_unseen(self, spans, next_position, least) -> int:
        in_order = self.in_position_order()
        positions = self.row_positions()
        order = None if in_order else torch.argsort(positions)
        if order is not None:
            positions = positions[order]
        kept = self._kept_for(spans, next_position, positions)
        self.spans = list(spans)
        if all(new - old < least for new, old in zip(kept, self.kept)):
            return 0
        dropped = sum(kept) - sum(self.kept)
        out = self.empty_like(self.max_tokens, sliced=self.positions is not None, small_pages=self.small_pages,
                              kept=kept)
        if order is None:
            copy_rows(out, 0, self, 0, self.length)
        else:
            # Sorted, a layer keeps rows order[kept:]; rows it had dropped (below its kept_from,
            # all under the earlier horizon, so under this one too) are never among them. (A decode
            # rank's shard that dropped rows chunk by chunk, then received other ranks' rows.)
            for layer in range(self.n_layers):
                first = self.kept[layer]
                rows = (order[kept[layer]:] - first).to(self.device)
                for dst, src in zip(out.storage_tensors(layer), self.storage_tensors(layer)):
                    torch.index_select(src[:self.length - first], 0, rows, out=dst[:rows.numel()])
            out.positions[:self.length] = positions
            self.positions = out.positions
        self.k, self.v, self.k_scale, self.v_scale, self.kept = out.k, out.v, out.k_scale, out.v_scale, out.kept
        return dropped

    def attend(self, start: int, backend: str = "auto", softmax_of=None) -> "CachedAttend":
        """The default single-device `attend` for new tokens at positions start, start+1, ...
        (softmax_of(layer) -> LayerSoftmax: the model's `layer_softmax`; None: plain layers)."""
        return CachedAttend(self, start, backend, softmax_of)


class CachedAttend:
    """attend(layer, q, k, v) for T new tokens of one sequence at positions start..start+T-1.

    Writes the new k, v into the cache, then the new tokens attend to the `start` cached tokens and
    causally to themselves. Three cases, cheapest first:
        start == 0  a causal diagonal block over the new tokens only (prefill);
        T == 1      one full block over cache rows 0..start (decode: the new row is already there);
        otherwise   `attention_with_cache` (a full block over the cache merged with a diagonal one).
    """

    __slots__ = ("cache", "start", "backend", "softmax_of")

    def mix_linear(self, layer: int, module, x: torch.Tensor) -> torch.Tensor:
        """A linear-attention layer's output [T, dim] for the new tokens' normed rows x [T, dim], from
        the cache's state of that layer (after the `start` cached tokens), which it then replaces."""
        states = self.cache.linear_states
        if states is None or states[layer] is None:
            raise ValueError(f"layer {layer} is a linear-attention layer and this KV cache keeps no state for it: "
                             "make the cache with KVCache.for_model(model.config, ...)")
        y, states[layer] = module.forward(x, states[layer])
        return y

    def __init__(self, cache: KVCache, start: int, backend: str = "auto", softmax_of=None):
        self.cache, self.start, self.backend, self.softmax_of = cache, start, backend, softmax_of

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, T, cache = self.start, q.shape[0], self.cache
        cache.update(layer, start, k, v)
        softmax = None if self.softmax_of is None else self.softmax_of(layer)
        if not is_plain(softmax):  # a span, soft-cap or sinks: the cache's rows by position, then ours
            positions = list(range(start, start + T))
            out, lse = cache.attend_rows(layer, q, start + T, softmax=softmax, q_positions=positions,
                                         backend=self.backend)
            return softmax.finish(out, lse)
        if softmax is not None and softmax.scale != q.shape[-1] ** -0.5:
            return self._scaled(layer, q, k, v, softmax.scale)
        if start == 0:
            return attention_block(q, k, v, causal=True, backend=self.backend)[0]
        if T == 1:  # the new row is written: one full block over rows 0..start
            return cache.attend_rows(layer, q, start + 1, backend=self.backend)[0]
        if not cache.quantized:
            return attention_with_cache(q, k, v, cache.k[layer][:start], cache.v[layer][:start],
                                        backend=self.backend)[0]
        # 8-bit: the new tokens see the cache (dequantized in blocks) and themselves as computed
        acc = PartialAccumulator(T, q.shape[1], q.shape[2], device=q.device)
        acc.add(*cache.attend_rows(layer, q, start, backend=self.backend), owned=True)
        acc.add(*attention_block(q, k, v, causal=True, backend=self.backend))
        return acc.result(q.dtype)[0]


    def _scaled(self, layer, q, k, v, scale):
        """A plain layer with its own softmax scale (Gemma's query_pre_attn_scalar)."""
        start, cache = self.start, self.cache
        acc = PartialAccumulator(q.shape[0], q.shape[1], q.shape[2], device=q.device)
        if start:
            acc.add(*cache.attend_rows(layer, q, start, backend=self.backend, softmax_scale=scale), owned=True)
        acc.add(*attention_block(q, k, v, causal=True, softmax_scale=scale, backend=self.backend))
        return acc.result(q.dtype)[0]


def _describe_shapes(shapes: Sequence[tuple[int, int]]):
    """(layers, KV heads, head dim), or (layers, [per layer...]) when layers differ, for error lines."""
    return (len(shapes), *shapes[0]) if len(set(shapes)) == 1 else (len(shapes), list(shapes))


def _empty_buffers(specs, device, *, zero: bool = False, small_pages: bool = False) -> list[torch.Tensor]:
    """New tensors of the given (shape, dtype)s on `device`: on a CPU, one (huge-page) arena."""
    if torch.device(device).type == "cpu":
        return host_tensors(specs, zero=zero, small_pages=small_pages)
    make = torch.zeros if zero else torch.empty
    return [make(shape, dtype=dtype, device=device) for shape, dtype in specs]


def copy_rows(dst: KVCache, dst_start: int, src: KVCache, src_start: int, n: int) -> None:
    """Rows dst_start.. of `dst` = rows src_start.. of `src` (n rows, every layer, as stored: the
    same kv_dtype and shapes). Rows a layer of `dst` dropped are not written; `src` must hold every
    other one (positions are the caller's)."""
    for layer in range(src.n_layers):
        skip = max(0, dst.kept[layer] - dst_start)
        if n - skip <= 0:
            continue
        for d, s in zip(dst.stored_rows(layer, dst_start + skip, dst_start + n),
                        src.stored_rows(layer, src_start + skip, src_start + n)):
            d.copy_(s)


def write_rows(buffer: torch.Tensor, rows, values: torch.Tensor) -> None:
    """buffer[rows] = values for a slice or a [T] long tensor of rows, any dtype (PyTorch's
    index_copy_ has no float8 kernel on the CPU: 1-byte types are copied as bytes)."""
    if isinstance(rows, slice):
        buffer[rows].copy_(values)
    elif buffer.element_size() == 1 and values.dtype == buffer.dtype:
        buffer.view(torch.uint8).index_copy_(0, rows, values.view(torch.uint8))
    else:
        buffer.index_copy_(0, rows, values)


def forward_with_cache(model, token_ids: torch.Tensor, cache: KVCache, *, logits="last", backend: str = "auto",
                       sequence_end: int | None = None):
    """Run `model` on the next T tokens of the cached sequence and advance `cache.length` by T.

    token_ids [T] long; positions are cache.length .. cache.length+T-1. Returns what
    `Transformer.forward` returns for `logits` (float32 [1, vocab] for "last"). sequence_end:
    the whole prompt's end when it is prefilled in pieces (`Transformer.rope`).
    """
    T = token_ids.shape[0]
    cache.ensure_room(T)
    start = cache.length
    positions = torch.arange(start, start + T, device=token_ids.device)
    out = model(token_ids, positions, cache.attend(start, backend, model.layer_softmax), logits=logits,
                sequence_end=sequence_end)
    cache.length = start + T
    return out
