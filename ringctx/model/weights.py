"""Filling a Transformer's parameters: from checkpoint tensors, or random for presets.

The model is first built on the meta device (no memory), then its parameters are allocated once
in the requested dtype and device, and every checkpoint tensor is copied into its place as soon as
it is read (converted on the way). Peak memory is the model plus one checkpoint tensor, never a
second full copy.

Checkpoint readers (weights_gguf.py, weights_hf.py) map each checkpoint tensor name to a
`WeightPiece`: a parameter name of ours, an optional row range (for the fused wqkv and w13
matrices) and, under tensor parallelism, the slice of the checkpoint tensor this rank holds
(`Take`, see ringctx.model.tensor_parallel). Readers read only that slice from the file, so a TP
rank's peak memory while loading is its shard plus one slice. `WeightFiller` checks names and
shapes, copies, and names whatever never arrived.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import NamedTuple

import torch
from torch import nn

from .config import ModelConfig
from ..host_memory import place_in_host_arena
from .expert_parallel import NO_EP, ExpertParallel
from .tensor_parallel import NO_TP, TensorParallel, linear_param, linear_rows
from .transformer import Transformer


class Take(NamedTuple):
    """The part of a checkpoint tensor one tensor-parallel rank holds: indices [start, stop) of
    dimension `dim` (PyTorch order) out of `full`."""

    dim: int
    start: int
    stop: int
    full: int

    def index(self) -> tuple[slice, ...]:
        """The indexing tuple that cuts this part out of the whole tensor."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


class WeightPiece(NamedTuple):
    """One checkpoint tensor and where it goes."""

    param: str
    """Name of our parameter, e.g. 'layers.3.attention.wqkv.weight'."""
    rows: tuple[int, int] | None
    """Row range [start, stop) inside that parameter, or None for the whole parameter."""
    source_name: str
    """The tensor's name in the checkpoint (for error messages)."""
    take: Take | None = None
    """The slice of the checkpoint tensor this rank holds (tensor parallelism), or None: all of it."""
    expert: int | None = None
    """The expert whose slab of a 3-D expert parameter ([E, ...], model/moe.py) the tensor fills
    (`rows` then index within that slab), or None: a 2-D parameter."""


def tp_take(config: ModelConfig, tp: TensorParallel, kind: str, layer: int | None = None) -> Take | None:
    """Which slice of a checkpoint tensor of `kind` TP rank `tp.rank` holds (None: all of it).

    kind: "q", "k", "v" (projection weights and biases, by heads), "o" (its input columns), "sinks" (by
    query heads),
    "gate", "up" (rows), "down" (input columns), "expert_gate", "expert_up", "expert_down" (one
    expert's, likewise, of layer `layer`'s expert width), "shared_gate", "shared_up", "shared_down"
    (its shared expert's, likewise), "vocab" (embedding or head rows), or
    anything else (norms, the o bias, a router): replicated. `config` is the whole model's; layer:
    the layer of an attention or expert tensor (its head shape may be its own), None for the model's.
    """
    if tp.size == 1:
        return None
    D = config.head_dim if layer is None else config.head_dim_of(layer)
    if kind == "q":
        a, b = tp.q_heads(config)
        return Take(0, a * D, b * D, config.n_heads * D)
    if kind in ("k", "v"):
        a, b = tp.kv_heads(config, layer)
        return Take(0, a * D, b * D, (config.n_kv_heads if layer is None else config.kv_heads_of(layer)) * D)
    if kind == "sinks":  # one logit per query head [Hq]
        a, b = tp.q_heads(config)
        return Take(0, a, b, config.n_heads)
    if kind == "o":
        a, b = tp.q_heads(config)
        return Take(1, a * D, b * D, config.n_heads * D)
    if kind in ("gate", "up"):
        return Take(0, *tp.ffn(config), config.ffn_dim)
    if kind == "down":
        return Take(1, *tp.ffn(config), config.ffn_dim)
    if kind == "vocab":
        return Take(0, *tp.vocab(config), config.vocab_size)
    if kind in ("expert_gate", "expert_up"):  # one expert's [F, dim]: rows, as the MLP's gate and up
        return Take(0, *tp.expert_ffn(config, layer), config.experts(layer).expert_ffn_dim)
    if kind == "expert_down":  # one expert's [dim, F]: input columns, as the MLP's down
        return Take(1, *tp.expert_ffn(config, layer), config.experts(layer).expert_ffn_dim)
    if kind in ("shared_gate", "shared_up"):  # the shared expert's [S, dim]: rows, as the MLP's gate and up
        return Take(0, *tp.shared_ffn(config, layer), config.experts(layer).shared_ffn_dim)
    if kind == "shared_down":  # its [dim, S]: input columns
        return Take(1, *tp.shared_ffn(config, layer), config.experts(layer).shared_ffn_dim)
    return None


def qkv_rows(config: ModelConfig, which: str, layer: int | None = None) -> tuple[int, int]:
    """Row range of 'q', 'k' or 'v' inside the fused wqkv weight (or bias) of layer `layer` (None:
    a layer of the model's head shape)."""
    D, hq, hkv = config.head_dim, config.n_heads, config.n_kv_heads
    if layer is not None:
        D, hkv = config.head_dim_of(layer), config.kv_heads_of(layer)
    return {"q": (0, hq * D), "k": (hq * D, (hq + hkv) * D), "v": ((hq + hkv) * D, (hq + 2 * hkv) * D)}[which]


def mlp_rows(config: ModelConfig, which: str, layer: int | None = None) -> tuple[int, int]:
    """Row range of 'gate' or 'up' inside the fused w13 weight (of each expert of layer `layer`'s
    mixture of experts when it has one: [2F, dim] per expert)."""
    experts = None if layer is None else config.experts(layer)
    ffn = config.ffn_dim if experts is None else experts.expert_ffn_dim
    return (0, ffn) if which == "gate" else (ffn, 2 * ffn)


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, interleaved rotary pairs -> rotate-half halves: each head's D rows (0, D/2, 1,
    D/2+1, ...) as llama.cpp's Llama conversion and Llama 4's checkpoints order them (pair i in
    rows 2i, 2i+1) become (0..D/2-1 | D/2..D-1), transformers' Llama order (pair i in rows i, i + D/2).
    w: [n_heads * D, ...] (a weight or a bias) -> same shape, rows in Hugging Face order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@contextlib.contextmanager
def _no_parameter_init():
    """Skip nn.Linear / nn.Embedding's random init while building: every value is overwritten.

    Their init on the meta device runs PyTorch's Python reference kernels, whose first use imports
    torch._dynamo, sympy and Triton: about 90 MiB resident in every rank, for values nobody reads.
    """
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def empty_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                tp: TensorParallel = NO_TP, ep: ExpertParallel = NO_EP) -> Transformer:
    """A Transformer (this TP rank's shard of it under `tp`, holding its EP rank's experts under
    `ep`) with uninitialised parameters in `dtype` on `device` (no memory on 'meta')."""
    with torch.device("meta"), _no_parameter_init():
        model = Transformer(config, tp, ep)
    model = model.to(dtype=dtype)
    if torch.device(device).type == "cpu":  # a decode step reads every weight: faster from 2 MiB pages
        place_in_host_arena(model)
    elif torch.device(device).type != "meta":
        model = model.to_empty(device=device)
    model.tie_weights()  # to_empty allocates tied parameters once, but re-tie to be explicit
    model.requires_grad_(False)
    return model


class WeightFiller:
    """Copies checkpoint tensors into a model's parameters, checking names, shapes and coverage.

    expected: every checkpoint tensor name the model needs -> its WeightPiece (from the reader's
    name mapping). `put` takes them in any order; `finish` names what never arrived.
    """

    def __init__(self, model: Transformer, source: str, expected: dict[str, WeightPiece]):
        self.model, self.source, self.expected = model, source, expected
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.seen: set[str] = set()

    def piece(self, source_name: str) -> WeightPiece:
        """The WeightPiece for a checkpoint tensor name; a clear error for a tensor we have no place for."""
        try:
            return self.expected[source_name]
        except KeyError:
            raise ValueError(f"{self.source}: unexpected tensor {source_name!r}: ringctx's Llama-family "
                             "decoder has no place for it, so the checkpoint is of an unsupported "
                             "architecture or variant") from None

    def expected_shape(self, piece: WeightPiece) -> tuple[int, ...]:
        """The shape the whole checkpoint tensor must have to fill `piece` (before any TP slice)."""
        shape = list(self.params[piece.param].shape)
        if piece.expert is not None:  # one expert's slab of [E, ...]
            shape = shape[1:]
        if piece.rows is not None:
            shape[0] = piece.rows[1] - piece.rows[0]
        if piece.take is not None:
            shape[piece.take.dim] = piece.take.full
        return tuple(shape)

    def check_shape(self, piece: WeightPiece, shape: tuple[int, ...]) -> None:
        want = self.expected_shape(piece)
        if tuple(shape) != want:
            raise ValueError(f"{self.source}: tensor {piece.source_name!r} has shape {tuple(shape)}, but the "
                             f"model config needs {want}; the weights do not match the config")

    def holds(self, piece: WeightPiece) -> bool:
        """Whether this rank keeps `piece`: False for an expert another EP rank holds (the reader
        then skips reading it and calls `skip`), so an EP rank loads only its experts."""
        return piece.expert is None or self._local_expert(piece) is not None

    def skip(self, piece: WeightPiece) -> None:
        """Account for a piece this rank does not hold (`holds` False): it arrived, for `finish`."""
        self.seen.add(piece.source_name)

    def _local_expert(self, piece: WeightPiece) -> int | None:
        """The slab of `piece.expert` in this rank's expert parameter (model/expert_parallel.py)."""
        layer = int(piece.param.split(".")[1])
        return self.model.ep.local_expert(self.model.full_config.experts(layer).n_experts, piece.expert)

    def put(self, piece: WeightPiece, tensor: torch.Tensor) -> None:
        """Copy `tensor` (any dtype, any device; already cut to `piece.take`) into its place,
        converting to the model's dtype (an expert another EP rank holds: nothing)."""
        param = self.params[piece.param]
        if piece.expert is not None:
            if not self.holds(piece):
                return self.skip(piece)
            param = param[self._local_expert(piece)]
        target = param if piece.rows is None else param[piece.rows[0]:piece.rows[1]]
        with torch.no_grad():
            target.copy_(tensor)
        self.seen.add(piece.source_name)

    def finish(self) -> None:
        """Raise a ValueError naming the checkpoint tensors that never arrived."""
        # by source name: the per-expert pieces of one fused tensor (Gemma 4's) are named as that tensor
        missing = list(dict.fromkeys(p.source_name for p in self.expected.values() if p.source_name not in self.seen))
        if missing:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ValueError(f"{self.source}: {len(missing)} weight tensor(s) missing: {shown}; the checkpoint "
                             "is incomplete (truncated download?) or does not match its config")


def init_random(model: Transformer, seed: int = 0) -> None:
    """Deterministic random weights: N(0, 0.02) matrices and biases, unit norm gains.

    Every parameter of the whole model is drawn in blocks of rows, each block from a CPU generator
    seeded by (seed, parameter name, block), in float32, then copied into place. So the values do
    not depend on the device, the dtype (beyond rounding) or tensor parallelism: a TP rank draws
    only the blocks that hold its rows, and its shard equals the same slice of the whole model.
    """
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=True):
            if name.endswith("norm.weight"):  # a unit gain: 0 where norms multiply by (1 + w) (Gemma)
                param.fill_(0.0 if model.config.norm_plus_one else 1.0)
                continue
            if name.endswith(("router_scale", "per_expert_scale")):  # Gemma 4's router scales: 1, as transformers
                param.fill_(1.0)
                continue
            if name.endswith("layer_scalar"):  # Gemma 4's block output scalars: 1, as transformers initialises them
                param.fill_(1.0)
                continue
            full_shape, rows, cols = _full_rows(model, name, param)
            if model.ep.size > 1 and name.endswith(("feed_forward.w13", "feed_forward.w2")):
                # this EP rank's experts: their slabs of the whole [E, ...] parameter
                first, last = model.ep.experts(model.full_config.experts(int(name.split(".")[1])).n_experts)
                full_shape, rows = (full_shape[0] * model.ep.size, *full_shape[1:]), torch.arange(first, last)
            row_numel = math.prod(full_shape[1:])
            block = max(1, (1 << 20) // max(row_numel, 1))
            for first in range(0, full_shape[0], block):
                wanted = ((rows >= first) & (rows < first + block)).nonzero().flatten()
                if wanted.numel() == 0:
                    continue
                digest = hashlib.sha256(f"{seed}/{name}/{first}".encode()).digest()
                gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
                n = min(block, full_shape[0] - first)
                values = torch.empty((n, *full_shape[1:]), dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                values = values[rows[wanted] - first]
                values = values if cols is None else values[keep_index(cols)]
                param[wanted.to(param.device)] = values.to(param.device, param.dtype)


def keep_index(cols: "slice | torch.Tensor | tuple") -> tuple:
    """The indexing tuple of `_full_rows`' cols: a slice or LongTensor of dimension 1, or a tuple
    (an expert parameter's index of dimensions 1 and on)."""
    return (slice(None), *cols) if isinstance(cols, tuple) else (slice(None), cols)


def _full_rows(model: Transformer, name: str,
               param: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor, "slice | torch.Tensor | tuple | None"]:
    """Where parameter `name` (`param`) of this (possibly TP-sharded) model comes from in the whole
    model: (the whole parameter's shape, the whole parameter's row of each of our rows, the columns
    we keep or None for all: a slice of dimension 1, or for an expert parameter [E, ...] a tuple
    indexing dimensions 1 and on, see `keep_index`)."""
    full, tp = model.full_config, model.tp
    if tp.size == 1:
        return tuple(param.shape), torch.arange(param.shape[0]), None
    shape = list(param.shape)
    kind = name.rsplit(".", 2)[-2] if "layers." in name else name.split(".")[0]
    layer = int(name.split(".")[1]) if name.startswith("layers.") else None
    param = linear_param(name)
    if param is not None:  # a Gated DeltaNet's: whole key heads and their value heads (weights_hybrid.py)
        dim, index = linear_rows(full.linear(layer), tp, param)
        if index is None:
            return tuple(shape), torch.arange(shape[0]), None
        shape[dim] *= tp.size
        return (tuple(shape), index, None) if dim == 0 else (tuple(shape), torch.arange(shape[0]), index)
    if name.endswith("attention.wgate.weight"):  # the output gate: rows by query heads, as q's
        t = tp_take(full, tp, "q", layer)
        shape[0] = t.full
        return tuple(shape), torch.arange(t.start, t.stop), None
    if name.endswith("attention.sinks"):  # [Hq]: this rank's query heads
        t = tp_take(full, tp, "sinks")
        return (t.full,), torch.arange(t.start, t.stop), None
    if name.endswith(("feed_forward.shared_w13", "feed_forward.shared_w2")):  # the shared expert: as the MLP's
        t = tp_take(full, tp, "shared_down", layer)
        if name.endswith("w2"):
            shape[1] = t.full
            return tuple(shape), torch.arange(shape[0]), slice(t.start, t.stop)
        shape[0] = 2 * t.full
        return tuple(shape), torch.cat([torch.arange(first + t.start, first + t.stop) for first in (0, t.full)]), None
    # experts [E, 2F, dim] / [E, dim, F] (and the gate/up biases [E, 2F]): every expert
    if name.endswith(("feed_forward.w13", "feed_forward.w2", "feed_forward.b13")):
        t = tp_take(full, tp, "expert_down", layer)
        if name.endswith("w2"):
            shape[2] = t.full
            return tuple(shape), torch.arange(shape[0]), (slice(None), slice(t.start, t.stop))
        shape[1] = 2 * t.full
        ours = [torch.arange(first + t.start, first + t.stop) for first in (0, t.full)]  # its gate, its up rows
        return tuple(shape), torch.arange(shape[0]), (torch.cat(ours),)  # (a tuple: see keep_index)
    if kind == "wqkv":  # rows: this rank's q heads, then its k heads, then its v heads
        shape[0] = qkv_rows(full, "v", layer)[1]
        rows = [torch.arange(qkv_rows(full, w, layer)[0] + t.start, qkv_rows(full, w, layer)[0] + t.stop)
                for w in "qkv" for t in [tp_take(full, tp, w, layer)]]
        return tuple(shape), torch.cat(rows), None
    if kind == "w13":
        shape[0] = 2 * full.ffn_dim
        rows = [torch.arange(mlp_rows(full, w)[0] + t.start, mlp_rows(full, w)[0] + t.stop)
                for w in ("gate", "up") for t in [tp_take(full, tp, w)]]
        return tuple(shape), torch.cat(rows), None
    if kind in ("wo", "w2") and name.endswith("weight"):
        t = tp_take(full, tp, "o" if kind == "wo" else "down", layer)
        shape[1] = t.full
        return tuple(shape), torch.arange(shape[0]), slice(t.start, t.stop)
    if kind in ("tok_embeddings", "output"):
        t = tp_take(full, tp, "vocab")
        shape[0] = t.full
        return tuple(shape), torch.arange(t.start, t.stop), None
    return tuple(shape), torch.arange(shape[0]), None  # replicated: the o bias
