"""Static KV cache for single-host decoding, and the default single-device `attend`.

Per layer, K and V live in preallocated buffers [max_tokens, Hkv, D] (token-major, KV heads never
expanded). Shapes never change while decoding, so a decode step allocates no cache memory and
attention reads a prefix view of the buffers. The prefill engine hands its gathered K/V over with
`KVCache.from_tensors`.

    cache = KVCache.for_model(model.config, max_tokens=4096, dtype=model.dtype)
    logits = forward_with_cache(model, token_ids, cache)     # prefill: positions 0..T-1
    logits = forward_with_cache(model, next_token, cache)    # decode: position T
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..attention import attention_block, attention_with_cache
from ..config import ModelConfig


class KVCache:
    """Per-layer K and V buffers [max_tokens, Hkv, D] of one sequence, filled up to `length`.

    Attributes:
        k, v: lists (one per layer) of [max_tokens, Hkv, D] tensors.
        length: number of valid tokens (positions 0 .. length-1). `update` writes rows but does
            not move it (every layer writes the same rows); `forward_with_cache` advances it once
            per step.
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
    ):
        if max_tokens <= 0:
            raise ValueError(f"KVCache: max_tokens must be positive, got {max_tokens}")
        shape = (max_tokens, n_kv_heads, head_dim)
        # empty, not zeros: rows at or past `length` are never read, and pages never written cost
        # no memory, so a cache sized for prompt + decode room fills in as the hand-off writes it.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0

    @classmethod
    def for_model(
        cls, config: ModelConfig, max_tokens: int, *, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> "KVCache":
        """An empty cache with this model's layer count, KV heads and head width."""
        return cls(config.n_layers, max_tokens, config.n_kv_heads, config.head_dim, dtype=dtype, device=device)

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
            k, v: one tensor per layer, [P, Hkv, D] each (all the same shape, dtype, device).
            length: valid tokens; defaults to P.
            max_tokens: capacity. None: use the given tensors as the buffers, without copying
                (allocate them with room to decode into). Otherwise new buffers of this size
                are allocated and the first `length` rows copied in.
        """
        if len(k) != len(v) or not k:
            raise ValueError(f"KVCache.from_tensors: need one K and one V per layer, got {len(k)} and {len(v)}")
        shape, dtype, device = k[0].shape, k[0].dtype, k[0].device
        for i, (ki, vi) in enumerate(zip(k, v)):
            if ki.dim() != 3 or ki.shape != shape or vi.shape != shape:
                raise ValueError(f"KVCache.from_tensors: layer {i} has K {tuple(ki.shape)} and V {tuple(vi.shape)}, "
                                 f"expected both {tuple(shape)} = [tokens, Hkv, D]")
            if ki.dtype != dtype or vi.dtype != dtype or ki.device != device or vi.device != device:
                raise ValueError(f"KVCache.from_tensors: layer {i} differs in dtype or device from layer 0")
        length = shape[0] if length is None else length
        if not 0 <= length <= shape[0]:
            raise ValueError(f"KVCache.from_tensors: length {length} outside [0, {shape[0]}]")
        cache = cls.__new__(cls)
        if max_tokens is None:
            cache.k, cache.v = list(k), list(v)
        else:
            if max_tokens < length:
                raise ValueError(f"KVCache.from_tensors: max_tokens={max_tokens} cannot hold the {length} given tokens")
            cache.k = [torch.zeros((max_tokens, *shape[1:]), dtype=dtype, device=device) for _ in k]
            cache.v = [torch.zeros((max_tokens, *shape[1:]), dtype=dtype, device=device) for _ in v]
            for dst, src in zip(cache.k + cache.v, list(k) + list(v)):
                dst[:length].copy_(src[:length])
        cache.length = length
        return cache

    # -- shape -------------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def max_tokens(self) -> int:
        return self.k[0].shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.k[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers (capacity, not just the valid prefix)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def check_model(self, config: ModelConfig) -> None:
        """Raise a ValueError unless this cache's shapes fit `config`."""
        want = (config.n_layers, config.n_kv_heads, config.head_dim)
        have = (self.n_layers, self.n_kv_heads, self.head_dim)
        if want != have:
            raise ValueError(f"KV cache has (layers, KV heads, head dim) = {have} but model {config.name!r} "
                             f"needs {want}")

    # -- contents ----------------------------------------------------------------------------

    def update(self, layer: int, positions: torch.Tensor | int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, Hkv, D] of one layer at `positions`.

        positions: [T] long tensor of cache rows, or an int `start` for rows start..start+T-1
        (a slice copy: the fast path for prefill and decode).
        """
        if isinstance(positions, int):
            self.k[layer][positions:positions + k.shape[0]].copy_(k)
            self.v[layer][positions:positions + v.shape[0]].copy_(v)
        else:
            self.k[layer].index_copy_(0, positions, k.to(self.dtype))
            self.v[layer].index_copy_(0, positions, v.to(self.dtype))

    def keys(self, layer: int) -> torch.Tensor:
        """Valid keys of one layer, a view [length, Hkv, D]."""
        return self.k[layer][: self.length]

    def values(self, layer: int) -> torch.Tensor:
        """Valid values of one layer, a view [length, Hkv, D]."""
        return self.v[layer][: self.length]

    def reset(self) -> None:
        """Forget all tokens (buffers are kept, not cleared)."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (e.g. to reuse a shared prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length {length} outside [0, {self.length}]")
        self.length = length

    def ensure_room(self, n_new: int, what: str = "input") -> None:
        """Raise a ValueError if n_new more tokens do not fit."""
        if self.length + n_new > self.max_tokens:
            raise ValueError(
                f"{what} of {n_new} tokens does not fit the KV cache: {self.length} cached + {n_new} new > "
                f"max_tokens={self.max_tokens}; create the cache with max_tokens >= {self.length + n_new} "
                "(prompt plus max_new_tokens), or shorten the input")

    def attend(self, start: int, backend: str = "auto") -> "CachedAttend":
        """The default single-device `attend` for new tokens at positions start, start+1, ..."""
        return CachedAttend(self, start, backend)


class CachedAttend:
    """attend(layer, q, k, v) for T new tokens of one sequence at positions start..start+T-1.

    Writes the new k, v into the cache, then the new tokens attend to the `start` cached tokens and
    causally to themselves. Three cases, cheapest first:
        start == 0  a causal diagonal block over the new tokens only (prefill);
        T == 1      one full block over cache rows 0..start (decode: the new row is already there);
        otherwise   `attention_with_cache` (a full block over the cache merged with a diagonal one).
    """

    __slots__ = ("cache", "start", "backend")

    def __init__(self, cache: KVCache, start: int, backend: str = "auto"):
        self.cache, self.start, self.backend = cache, start, backend

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, T = self.start, q.shape[0]
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        ck[start:start + T].copy_(k)
        cv[start:start + T].copy_(v)
        if start == 0:
            return attention_block(q, k, v, causal=True, backend=self.backend)[0]
        if T == 1:
            return attention_block(q, ck[: start + 1], cv[: start + 1], backend=self.backend)[0]
        return attention_with_cache(q, k, v, ck[:start], cv[:start], backend=self.backend)[0]


def forward_with_cache(model, token_ids: torch.Tensor, cache: KVCache, *, logits="last", backend: str = "auto"):
    """Run `model` on the next T tokens of the cached sequence and advance `cache.length` by T.

    token_ids [T] long; positions are cache.length .. cache.length+T-1. Returns what
    `Transformer.forward` returns for `logits` (float32 [1, vocab] for "last").
    """
    T = token_ids.shape[0]
    cache.ensure_room(T)
    start = cache.length
    positions = torch.arange(start, start + T, device=token_ids.device)
    out = model(token_ids, positions, cache.attend(start, backend), logits=logits)
    cache.length = start + T
    return out
