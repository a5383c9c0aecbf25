"""Tensor parallelism of the Llama block (Megatron-style): which slice of every weight a TP rank
holds, and the two collectives that put the slices back together.

With T tensor-parallel ranks, TP rank t holds (D = head_dim, G = query heads per KV head):

    wq, wk, wv   column-parallel by heads: query heads [t*Hq/T, (t+1)*Hq/T) and their KV heads;
                 when T > Hkv a KV head is replicated on T/Hkv ranks (as vLLM does), so every
                 rank's query heads still find their KV head locally
    wo           row-parallel: the input columns of its query heads; the partial outputs of the
                 T ranks are summed by an all-reduce (the bias, if any, is added once after it)
    w_gate, w_up column-parallel: rows [t*F/T, (t+1)*F/T) of the MLP's hidden units
    w_down       row-parallel: the matching input columns, then an all-reduce
    experts      each expert's hidden units split as the MLP's (its w13 rows [E, 2F/T, D], its w2
                 columns [E, D, F/T]); the router is replicated, so every rank routes every token
                 alike, and the experts' partial outputs join the MLP's all-reduce
    embedding    vocab-parallel: token ids [t*V/T, (t+1)*V/T); a rank looks up the ids it holds,
                 zeros elsewhere, and an all-reduce gives every rank the full rows (one per chunk)
    output head  vocab-parallel: the logits of its ids, all-gathered when logits are wanted (one
                 row per prompt or decode step); tied heads share the embedding's slice
    norms        replicated (a few KiB)

So a block runs as: norm (replicated) -> local q/k/v heads -> attention over the local heads ->
partial wo -> all-reduce -> norm -> partial MLP -> all-reduce: two all-reduces of the block's
activations per layer, each moving 2(T-1)/T of their bytes per rank (ring all-reduce). Attention
needs no communication between TP ranks: each runs the ring of its context-parallel group over
its own heads (ringctx.parallel.mesh).

A TP rank's model is an ordinary `Transformer` built from `shard_config(config)`: the same layers
with Hq/T query heads, max(Hkv/T, 1) KV heads and F/T hidden units, so caches, kernels and the
ring see ordinary shapes. `model.tp` is the TensorParallel below; `model.full_config` is the
whole model's config (`model.config` the shard's).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import LinearShape, ModelConfig


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `total` items are cut into `parts` near-equal runs."""
    return index * total // parts, (index + 1) * total // parts


def tp_problem(config: ModelConfig, tp_size: int) -> str | None:
    """Why `config` cannot be split over `tp_size` ranks (one line naming what to use), or None."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        return f"tp must be a positive integer, got {tp_size!r}"
    if tp_size == 1:
        return None
    hq, kv_counts = config.n_heads, sorted({h for h, _ in config.kv_shapes if h})  # a layer may have its own
    divisors = [t for t in range(1, hq + 1)
                if hq % t == 0 and all(hkv % t == 0 or t % hkv == 0 for hkv in kv_counts)]
    if hq % tp_size:
        return (f"tp={tp_size} does not divide the {hq} query heads of {config.name}; "
                f"use one of {', '.join(map(str, divisors))}")
    for hkv in kv_counts:
        if hkv % tp_size and tp_size % hkv:
            return (f"tp={tp_size} neither divides nor is a multiple of the {hkv} KV heads of "
                    f"{config.name}{'' if len(kv_counts) == 1 else ' (some of its layers)'}; "
                    f"use one of {', '.join(map(str, divisors))}")
    if config.ffn_dim < tp_size or config.vocab_size < tp_size:
        return f"tp={tp_size} is larger than the MLP width or vocabulary of {config.name}"
    if any(e is not None and e.expert_ffn_dim < tp_size for e in config.layer_experts):
        return f"tp={tp_size} is larger than the expert width of {config.name}"
    for shape in {s for s in config.layer_linear if s is not None}:
        if shape.key_heads % tp_size:
            return (f"tp={tp_size} does not divide the {shape.key_heads} key heads of {config.name}'s linear-attention "
                    f"layers (each TP rank holds whole key heads and their value heads); use one of "
                    f"{', '.join(str(t) for t in divisors if shape.key_heads % t == 0)}")
    if any(e is not None and 0 < e.shared_ffn_dim < tp_size for e in config.layer_experts):
        return f"tp={tp_size} is larger than the shared expert's width of {config.name}"
    return None


@dataclass
class TensorParallel:
    """This rank's place in its tensor-parallel group and the group's collectives.

    The default (size 1) is "no tensor parallelism": every method is then a no-op.
    """

    size: int = 1
    """T: ranks that share one copy of the weights (consecutive ranks of one host)."""
    rank: int = 0
    """This rank's index in the TP group, 0 .. T-1."""
    group: object | None = None
    """The TP group's torch.distributed ProcessGroup (None when size is 1)."""
    stats: object | None = None
    """A CommStats that records each collective's bytes on the wire while set (the prefill sets it)."""
    reducer: object | None = None
    """The all-reduce the engine hands in (parallel/allreduce.py's `make_all_reduce`: shared or
    symmetric memory, chosen by size), a callable x -> bytes sent; None: the group's all_reduce."""

    # -- which slice this rank holds ---------------------------------------------------------
    def q_heads(self, config: ModelConfig) -> tuple[int, int]:
        """[start, stop) of this rank's query heads."""
        return split_range(config.n_heads, self.size, self.rank)

    def kv_heads(self, config: ModelConfig, layer: int | None = None) -> tuple[int, int]:
        """[start, stop) of this rank's KV heads (of layer `layer`, which may have its own count;
        None: the model's): its share, or the one KV head its query heads use when T > Hkv
        (replicated on T / Hkv ranks)."""
        n_kv = config.n_kv_heads if layer is None else config.kv_heads_of(layer)
        if self.size <= n_kv:
            return split_range(n_kv, self.size, self.rank)
        head = self.q_heads(config)[0] // (config.n_heads // n_kv)
        return head, head + 1

    def ffn(self, config: ModelConfig) -> tuple[int, int]:
        """[start, stop) of this rank's MLP hidden units."""
        return split_range(config.ffn_dim, self.size, self.rank)

    def expert_ffn(self, config: ModelConfig, layer: int) -> tuple[int, int]:
        """[start, stop) of this rank's hidden units of each expert of layer `layer` (a mixture of experts)."""
        return split_range(config.experts(layer).expert_ffn_dim, self.size, self.rank)

    def shared_ffn(self, config: ModelConfig, layer: int) -> tuple[int, int]:
        """[start, stop) of this rank's hidden units of layer `layer`'s shared expert (split as the MLP's)."""
        return split_range(config.experts(layer).shared_ffn_dim, self.size, self.rank)

    def vocab(self, config: ModelConfig) -> tuple[int, int]:
        """[start, stop) of the token ids whose embedding rows and logits this rank holds."""
        return split_range(config.vocab_size, self.size, self.rank)

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: its heads, MLP and expert widths (vocabulary and layers as is)."""
        if self.size == 1:
            return config
        q0, q1 = self.q_heads(config)
        k0, k1 = self.kv_heads(config)
        f0, f1 = self.ffn(config)
        layers = tuple(dataclasses.replace(kind, n_kv_heads=-operator.sub(*self.kv_heads(config, i)))
                       if kind.n_kv_heads else kind for i, kind in enumerate(config.layer_attention))
        experts = tuple(None if e is None else dataclasses.replace(
            e, expert_ffn_dim=-operator.sub(*self.expert_ffn(config, i)),
            shared_ffn_dim=-operator.sub(*self.shared_ffn(config, i))) for i, e in enumerate(config.layer_experts))
        linear = tuple(None if s is None else dataclasses.replace(  # whole key heads and their value heads
            s, key_heads=s.key_heads // self.size, value_heads=s.value_heads // self.size) for s in config.layer_linear)
        return dataclasses.replace(config, name=f"{config.name} [TP {self.rank}/{self.size}]", n_heads=q1 - q0,
                                   n_kv_heads=k1 - k0, ffn_dim=f1 - f0, head_dim=config.head_dim,
                                   layer_attention=layers, layer_experts=experts, layer_linear=linear)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, what: str = "all-reduce") -> torch.Tensor:
        """Sum `x` over the TP group in place (row-parallel outputs); returns x."""
        if self.size == 1:
            return x
        if self.reducer is not None:
            sent = self.reducer(x)  # what its algorithm moved (one-shot: (T-1) x; two-shot as a ring)
        else:
            dist.all_reduce(x, group=self.group)
            sent = 2 * (self.size - 1) * x.numel() * x.element_size() // self.size  # a ring: 2(T-1)/T of x
        if self.stats is not None:
            self.stats.record(what, 0, sent)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's `x` (the same shape on each), in rank order ([x] without TP)."""
        if self.size == 1:
            return [x]
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(pieces, x, group=self.group)
        return pieces

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """This rank's logits [N, V_t] of its ids -> every id's logits [N, vocab_size] (all ranks)."""
        if self.size == 1:
            return logits
        width = -(-vocab_size // self.size)  # all_gather wants equal pieces: pad to the widest
        padded = logits.new_zeros(logits.shape[0], width)
        padded[:, :logits.shape[1]] = logits
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(pieces, padded, group=self.group)
        if self.stats is not None:
            self.stats.record("tp-logits", 0, (self.size - 1) * padded.numel() * padded.element_size())
        widths = [b - a for a, b in (split_range(vocab_size, self.size, r) for r in range(self.size))]
        return torch.cat([p[:, :w] for p, w in zip(pieces, widths)], dim=1)


NO_TP = TensorParallel()
"""No tensor parallelism (the default of every model)."""


def gather_kv_heads(cache, model):
    """Every KV head of a TP-sharded cache, on TP rank 0 (None on the others); call on every TP rank.

    Each rank holds the same rows for its KV heads; they are all-gathered layer by layer (as raw
    bytes, so 8-bit caches and their scales travel as stored) and TP rank 0 assembles a cache of
    the whole model's heads, taking a replicated head from the first rank that holds it. The
    positions of a sliced cache are the same on every TP rank. Without TP: the cache itself.
    """
    from .kvcache import KVCache

    tp, full = model.tp, model.full_config
    if tp.size == 1:
        return cache
    n = cache.length
    out = None
    if tp.rank == 0:
        out = KVCache.for_model(full, n, dtype=cache.dtype, device=cache.device, kv_dtype=cache.kv_dtype,
                                sliced=cache.positions is not None, kept=cache.kept)
        out.spans = cache.spans
        if cache.positions is not None:
            out.positions[:n] = cache.positions[:n]
    for layer in range(cache.n_layers):
        ranges = [TensorParallel(tp.size, r).kv_heads(full, layer) for r in range(tp.size)]
        m = n - min(cache.kept_from(layer), n)  # the layer's stored rows (a windowed layer's last ones)
        for j, mine in enumerate(cache.storage_tensors(layer)):
            local = mine[:m].contiguous()
            per_head = math.prod(local.shape[2:])  # D values, or one scale
            raw = local.view(m, local.shape[1], per_head).view(torch.uint8)  # [rows, heads, bytes per head]
            pieces = [torch.empty_like(raw) for _ in range(tp.size)]
            dist.all_gather(pieces, raw, group=tp.group)
            if out is None:
                continue
            target = out.storage_tensors(layer)[j]
            target_raw = target.view(target.shape[0], target.shape[1], per_head).view(torch.uint8)
            for head in range(full.kv_heads_of(layer)):
                r = next(r for r, (a, b) in enumerate(ranges) if a <= head < b)
                target_raw[:m, head] = pieces[r][:, head - ranges[r][0]]
    if out is not None:
        out.length = n
    return out


LINEAR_PARAMS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv_weight", "dt_bias", "A_log",
                 "norm_weight", "out_proj")
"""A Gated DeltaNet's parameters (model/gated_deltanet.py), `.weight` after the nn.Linear ones."""


def linear_rows(shape: LinearShape, tp: "TensorParallel", param: str) -> tuple[int, torch.Tensor | None]:
    """(dimension, indices) of the whole layer's parameter `param` that TP rank `tp.rank` holds
    (None: all of it): key heads [a, b) of Hk and their value heads [a G, b G)."""
    if tp.size == 1 or param == "norm_weight":
        return 0, None
    a, b = split_range(shape.key_heads, tp.size, tp.rank)
    group = shape.value_heads // shape.key_heads
    keys = torch.arange(a * shape.key_dim, b * shape.key_dim)
    values = torch.arange(a * group * shape.value_dim, b * group * shape.value_dim)
    heads = torch.arange(a * group, b * group)
    if param in ("in_proj_qkv", "conv_weight"):  # the channels: q | k | v
        k_dim = shape.key_heads * shape.key_dim
        return 0, torch.cat([keys, keys + k_dim, values + 2 * k_dim])
    if param == "in_proj_z":
        return 0, values
    if param == "out_proj":
        return 1, values
    return 0, heads  # in_proj_b, in_proj_a, dt_bias, A_log: one per value head


def linear_param(name: str) -> str | None:
    """The Gated DeltaNet parameter a model parameter name is of ('layers.3.linear_attn.in_proj_z.weight'
    -> 'in_proj_z'), or None."""
    match = re.match(r"layers\.\d+\.linear_attn\.(\w+?)(?:\.weight)?$", name)
    return match.group(1) if match else None
