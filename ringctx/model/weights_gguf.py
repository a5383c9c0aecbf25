"""GGUF checkpoints (llama.cpp): header -> ModelConfig, tensors -> dequantized parameters.

Dequantization is the `gguf` package's (`gguf.quants.dequantize`): every type it supports works,
including F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants (Q2_K..Q6_K) and the
I-quants. Float types are viewed directly without a float32 detour.

llama.cpp's converter permutes the rows of the Q and K projections of Llama-architecture models
so that each head's rotary pairs are adjacent (GPT-J "interleaved" order); ringctx, like
transformers, uses the rotate-half order, so those rows are permuted back. Qwen2, Qwen3,
Seed-OSS, Phi-3 and Gemma 3 files keep the Hugging Face order (llama.cpp runs them with NeoX-style
RoPE) and are not touched. Phi-3 files hold fused tensors, as its checkpoints do: attn_qkv (q, k, v heads) and
ffn_up (gate, then up); each part is read from its rows (`GGUFPart.first_row`). Gemma 4 files
(gemma4) keep the Hugging Face order too, each layer at its own head shape; a layer without
attn_v (Gemma 4's attention_k_eq_v full layers) takes its keys as values (`gguf_keys_as_values`).
Mixtures of experts (llama's Mixtral, qwen3moe) hold each layer's experts as 3-D tensors,
ffn_gate_exps / ffn_up_exps [E, F, dim] and ffn_down_exps [E, dim, F] (PyTorch order), beside the
router ffn_gate_inp [E, dim]; Gemma 4 26B-A4B's (gemma4) fuse gate and up as ffn_gate_up_exps
[E, 2F, dim] and add the router's scales ffn_gate_inp.scale [dim] and ffn_down_exps.scale [E]
(llama.cpp's converter's names); a file converted with --fuse-gate-up-exps holds ffn_gate_up_exps
on any architecture. Each expert's slab is read alone and cut to the TP rank's share
(`_fill_gguf_experts`).

The linear-attention hybrids (qwen35, qwen35moe, qwen3next) are stored as llama.cpp's converter
transforms their checkpoints: each norm but the Gated DeltaNet's as 1 + w (`gguf_norm_shift`), the
gated attention's attn_q with each head's query and gate rows, and the linear layers' tensors
(`hybrid_gguf_parts`), which weights_hybrid.HybridTensors.take_gguf reads back into the
checkpoint's layout; blocks past the trunk (multi-token prediction) are not read.

Split files (model-00001-of-00003.gguf, from gguf-split) are read shard by shard.
"""

from __future__ import annotations

import gc
import os
import re
from typing import NamedTuple

import numpy as np
import torch

from .config import ModelConfig
from .config_gguf import GGUF_HYBRID_ARCHITECTURES as HYBRIDS, read_gguf_config, read_gguf_field
from ..telemetry import release_free_memory
from .expert_parallel import NO_EP, ExpertParallel
from .tensor_parallel import NO_TP, TensorParallel
from .weights import Take, WeightFiller, WeightPiece, mlp_rows, qkv_rows, tp_take, unpermute_rotary_rows
from .weights_hybrid import HYBRID_GGUF_TENSORS, HybridTensors

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_ONE_EXPERT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")
"""llama.cpp's first Mixtral files: one tensor per expert (blk.N.ffn_gate.E.weight), before the 3-D
ffn_*_exps tensors; the gguf package no longer names them."""


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` for `path`, with errors that name the file and say what to do."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file; name an existing .gguf file, a Hugging Face "
                                "model directory, or a preset")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); it is truncated or "
                         "corrupt, re-download or re-convert it") from None


def gguf_shards(path: str, reader) -> list:
    """All readers of a model: [reader] for a single file, every shard for a gguf-split model."""
    count = int(read_gguf_field(reader.fields["split.count"])) if "split.count" in reader.fields else 1
    if count <= 1:
        return [reader]
    m = _SPLIT_NAME.match(os.path.basename(path))
    if m is None:
        raise ValueError(f"{path}: header says the model is split into {count} files, but the name does not "
                         "follow the <name>-00001-of-000NN.gguf pattern; name the first shard")
    directory = os.path.dirname(path)
    names = [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    return [reader if os.path.basename(path) == n else open_gguf(os.path.join(directory, n)) for n in names]


class GGUFPart(NamedTuple):
    """Where (part of) a GGUF tensor goes."""

    piece: WeightPiece
    """The parameter rows it fills; piece.source_name names it for the WeightFiller (a fused
    tensor's part: the tensor's name and the part, e.g. 'blk.0.attn_qkv.weight:k')."""
    heads: int | None
    """Heads to un-permute for rotary (llama.cpp's Llama Q/K rows), or None."""
    first_row: int = 0
    """The part's first row in the GGUF tensor (a fused tensor's q/k/v or gate/up); 0 otherwise."""


FUSED_ARCHITECTURES = ("phi3",)
"""GGUF architectures whose files hold attn_qkv and a gate+up ffn_up (llama.cpp's Phi-3)."""


def expected_gguf_tensors(config: ModelConfig, arch: str, tp: TensorParallel = NO_TP,
                          fused_experts: bool = False) -> dict[str, list[GGUFPart]]:
    """GGUF tensor name -> its parts (one for a plain tensor; q, k, v or gate, up for a fused one),
    for TP rank `tp.rank` (`config` is the whole model's; heads to un-permute are those of the
    rank's slice). fused_experts: the file holds each layer's expert gate and up rows together
    (ffn_gate_up_exps, llama.cpp's converter's --fuse-gate-up-exps)."""
    unpermute = arch in ("llama", "llama4")  # llama4: its checkpoints' interleaved rows, kept by the converter
    fused = arch in FUSED_ARCHITECTURES
    local = tp.shard_config(config)
    pieces: dict[str, list[GGUFPart]] = {}

    def add(gguf_name: str, param: str, rows=None, heads=None, kind: str = "", part: str = "", first_row: int = 0,
            layer: int | None = None):
        source = f"{gguf_name}:{part}" if part else gguf_name
        pieces.setdefault(gguf_name, []).append(
            GGUFPart(WeightPiece(param, rows, source, tp_take(config, tp, kind, layer)), heads, first_row))

    add("token_embd.weight", "tok_embeddings.weight", kind="vocab")
    add("output_norm.weight", "norm.weight")
    if not config.tie_embeddings:
        add("output.weight", "output.weight", kind="vocab")
    D = config.head_dim
    for i in range(config.n_layers):
        blk, ours = f"blk.{i}", f"layers.{i}"
        add(f"{blk}.attn_norm.weight", f"{ours}.attention_norm.weight")
        # the MLP's norm: post_attention_layernorm (Seed-OSS's keeps that name), Gemma's pre_feedforward_layernorm
        add(f"{blk}.{'post_attention_norm' if arch in ('seed_oss', 'gpt-oss', *HYBRIDS) else 'ffn_norm'}.weight",
            f"{ours}.ffn_norm.weight")
        if config.post_norms:
            add(f"{blk}.post_attention_norm.weight", f"{ours}.post_attention_norm.weight")
            add(f"{blk}.post_ffw_norm.weight", f"{ours}.post_ffn_norm.weight")
        if arch in HYBRIDS:  # a Gated DeltaNet or a gated attention layer (`hybrid_gguf_parts`)
            pieces.update(hybrid_gguf_parts(config, local, arch, i))
        kinds = ("weight", "bias") if config.qkv_bias else ("weight",)
        for kind in kinds if config.linear(i) is None else ():
            if fused:
                starts = {"q": 0, "k": config.n_heads * D, "v": (config.n_heads + config.n_kv_heads) * D}
                for which in "qkv":
                    add(f"{blk}.attn_qkv.{kind}", f"{ours}.attention.wqkv.{kind}", qkv_rows(local, which),
                        kind=which, part=which, first_row=starts[which])
                continue
            if not config.attn_output_gate:  # the gated attention's attn_q: `hybrid_gguf_parts`
                add(f"{blk}.attn_q.{kind}", f"{ours}.attention.wqkv.{kind}", qkv_rows(local, "q", i),
                    local.n_heads if unpermute else None, "q", layer=i)
            add(f"{blk}.attn_k.{kind}", f"{ours}.attention.wqkv.{kind}", qkv_rows(local, "k", i),
                local.kv_heads_of(i) if unpermute else None, "k", layer=i)
            add(f"{blk}.attn_v.{kind}", f"{ours}.attention.wqkv.{kind}", qkv_rows(local, "v", i), kind="v", layer=i)
        if config.linear(i) is None:
            add(f"{blk}.attn_output.weight", f"{ours}.attention.wo.weight", kind="o", layer=i)
        if config.qk_norm and config.linear(i) is None:  # Qwen3, Gemma 3 and 4: [the layer's head_dim], replicated
            add(f"{blk}.attn_q_norm.weight", f"{ours}.attention.q_norm.weight")
            add(f"{blk}.attn_k_norm.weight", f"{ours}.attention.k_norm.weight")
        if config.attn_out_bias:
            add(f"{blk}.attn_output.bias", f"{ours}.attention.wo.bias")
        if config.layer_scalars:  # Gemma 4: [1], replicated
            add(f"{blk}.layer_output_scale.weight", f"{ours}.layer_scalar")
        if config.attention(i).sinks:  # gpt-oss: [Hq], by query heads under TP
            add(f"{blk}.attn_sinks.weight", f"{ours}.attention.sinks", kind="sinks")
        experts = config.experts(i)
        mlp = "feed_forward"
        if experts is not None:  # the router replicated; one part per expert of each 3-D tensor (TP: its share)
            pieces.update(expert_gguf_parts(config, tp, i, fused_experts))
            if not experts.beside_dense:
                continue
            # Gemma 4 26B-A4B keeps its dense MLP beside the experts, with three more norms
            for stored_norm, norm in (("post_ffw_norm_1", "post_dense_norm"), ("pre_ffw_norm_2", "pre_experts_norm"),
                                      ("post_ffw_norm_2", "post_experts_norm")):
                add(f"{blk}.{stored_norm}.weight", f"{ours}.{norm}.weight")
            mlp = "dense_mlp"
        if fused:
            for which, first in (("gate", 0), ("up", config.ffn_dim)):
                add(f"{blk}.ffn_up.weight", f"{ours}.feed_forward.w13.weight", mlp_rows(local, which), kind=which,
                    part=which, first_row=first)
        else:
            add(f"{blk}.ffn_gate.weight", f"{ours}.{mlp}.w13.weight", mlp_rows(local, "gate"), kind="gate")
            add(f"{blk}.ffn_up.weight", f"{ours}.{mlp}.w13.weight", mlp_rows(local, "up"), kind="up")
        add(f"{blk}.ffn_down.weight", f"{ours}.{mlp}.w2.weight", kind="down")
    return pieces


def hybrid_gguf_parts(config: ModelConfig, local: ModelConfig, arch: str, layer: int) -> dict[str, list[GGUFPart]]:
    """Layer `layer`'s tensors that `HybridTensors.take_gguf` fills (`local`: this TP rank's shard config;
    the TP cut is HybridTensors'): a linear layer's (`HYBRID_GGUF_TENSORS`; qwen3next's ssm_ba as
    its parts 'b' and 'a'), or a gated attention layer's attn_q (its query rows of wqkv; the gate
    rows go to wgate)."""
    blk, ours = f"blk.{layer}", f"layers.{layer}"
    parts: dict[str, list[GGUFPart]] = {}

    def add(gguf_name: str, param: str, rows=None, source: str | None = None) -> None:
        parts.setdefault(gguf_name, []).append(GGUFPart(WeightPiece(param, rows, source or gguf_name), None))

    if config.linear(layer) is None:
        add(f"{blk}.attn_q.weight", f"{ours}.attention.wqkv.weight", qkv_rows(local, "q", layer))
        return parts
    for name, param in HYBRID_GGUF_TENSORS.items():
        param = f"{ours}.linear_attn.{param}" + (".weight" if param.startswith(("in_proj", "out_proj")) else "")
        if arch == "qwen3next" and name in ("ssm_beta.weight", "ssm_alpha.weight"):  # ssm_ba's parts b and a
            add(f"{blk}.ssm_ba.weight", param, source=f"{blk}.ssm_ba.weight:{'b' if 'beta' in name else 'a'}")
        else:
            add(f"{blk}.{name}", param)
    return parts


def gguf_norm_shift(arch: str, name: str) -> bool:
    """Whether GGUF tensor `name` holds 1 + w for a zero-centred norm's w (its config multiplies by
    1 + w): llama.cpp's converter adds 1 to every norm weight of the hybrids but the Gated
    DeltaNet's output norm (ssm_norm), and its graphs multiply by the stored value. The loader
    subtracts the 1 again, exactly for stored values from 0.5 up (Sterbenz; the float32 1 + w kept
    fewer of w's bits), so the gain 1 + w the model computes in float32 is the stored value, as
    transformers' (1 + w) of the checkpoint is."""
    return arch in HYBRIDS and name.endswith("norm.weight") and not name.endswith(".ssm_norm.weight")


EXPERT_STACKS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
"""llama.cpp's stacked expert tensors -> the part of each expert they hold: weights [E, F, dim]
(gate, up) and [E, dim, F] (down), biases [E, F] and [E, dim] (gpt-oss). Gemma 4's files fuse
each expert's gate and up rows in ffn_gate_up_exps [E, 2F, dim] instead."""


def expert_gguf_parts(config: ModelConfig, tp: TensorParallel, layer: int,
                      fused: bool = False) -> dict[str, list[GGUFPart]]:
    """A mixture-of-experts layer's GGUF tensors -> their parts: the router ffn_gate_inp (weight
    [E, dim], and its bias; Gemma 4's two scales ffn_gate_inp.scale [dim] and ffn_down_exps.scale
    [E]), replicated; the shared expert ffn_{gate,up,down}_shexp of Llama 4, Qwen3.5-MoE and
    Qwen3-Next (the dense MLP's layout, its TP share) and the latter two's gate ffn_gate_inp_shexp
    [1, dim] (replicated); each stacked expert tensor (`EXPERT_STACKS`) as E parts (fused gate/up,
    Gemma 4's or any file's written `fused`: 2 E, an expert's gate rows then its up rows from
    `first_row` F), part e
    (`WeightPiece.expert`) filling expert e's slab, cut to this TP rank's share of its units (the
    down bias whole: rank 0 adds it, model/moe.py)."""
    experts, local = config.experts(layer), tp.shard_config(config)
    blk, ff = f"blk.{layer}", f"layers.{layer}.feed_forward"

    def whole(name: str, param: str) -> list[GGUFPart]:
        return [GGUFPart(WeightPiece(param, None, name), None)]

    parts = {f"{blk}.ffn_gate_inp.weight": whole(f"{blk}.ffn_gate_inp.weight", f"{ff}.router.weight")}
    if experts.router_bias:
        parts[f"{blk}.ffn_gate_inp.bias"] = whole(f"{blk}.ffn_gate_inp.bias", f"{ff}.router.bias")
    stacks = [(stack, which, 0) for stack, which in EXPERT_STACKS.items()]
    if experts.beside_dense:  # Gemma 4: the router's scales (llama.cpp's names)
        parts[f"{blk}.ffn_gate_inp.scale"] = whole(f"{blk}.ffn_gate_inp.scale", f"{ff}.router_scale")
        parts[f"{blk}.ffn_down_exps.scale"] = whole(f"{blk}.ffn_down_exps.scale", f"{ff}.per_expert_scale")
    if experts.beside_dense or fused:  # gate and up fused per expert: [E, 2F, dim], gate rows first
        stacks = [("ffn_gate_up_exps", "gate", 0), ("ffn_gate_up_exps", "up", experts.expert_ffn_dim),
                  ("ffn_down_exps", "down", 0)]
    for kind in ("weight", "bias") if experts.bias else ("weight",):
        for e in range(experts.n_experts):  # expert by expert: a fused stack's parts in expert order
            for stack, which, first in stacks:
                down = which == "down"
                name = f"{blk}.{stack}.{kind}"
                param = f"{ff}.{'w2' if down else 'w13'}" if kind == "weight" else f"{ff}.{'b2' if down else 'b13'}"
                rows = None if down else mlp_rows(local, which, layer)
                take = tp_take(config, tp, "" if down and kind == "bias" else f"expert_{which}", layer)
                parts.setdefault(name, []).append(GGUFPart(WeightPiece(param, rows, name, take, e), None, first))
    shared = local.experts(layer).shared_ffn_dim
    for which, rows in (("gate", (0, shared)), ("up", (shared, 2 * shared)), ("down", None)) if shared else ():
        name = f"{blk}.ffn_{which}_shexp.weight"  # Llama 4's shared expert: the dense MLP's layout
        parts[name] = [GGUFPart(WeightPiece(f"{ff}.shared_{'w2' if which == 'down' else 'w13'}", rows, name,
                                            tp_take(config, tp, f"shared_{which}", layer)), None)]
    if experts.shared_gate:  # Qwen3.5-MoE's / Qwen3-Next's [1, dim] gate of the shared expert, replicated
        parts[f"{blk}.ffn_gate_inp_shexp.weight"] = whole(f"{blk}.ffn_gate_inp_shexp.weight", f"{ff}.shared_gate")
    return parts


# Tensors a GGUF file may carry that are not parameters: Llama-3.1 RoPE factors are read into
# ModelConfig.rope_scaling by read_gguf_config, as are Phi-3's LongRoPE factors.
_NOT_PARAMETERS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def gguf_keys_as_values(arch: str, names: set[str], n_layers: int) -> dict[str, str]:
    """gemma4: the layers whose file has no attn_v take their keys as values, as llama.cpp's gemma4
    graph runs them (v = the k projection's output; its weightless v norm follows): Gemma 4's
    attention_k_eq_v full layers are written so. ringctx's fused projection keeps v rows, which
    such a layer's attn_k tensors fill too (an exact copy): {attn_k name: attn_v name}, weights
    and biases. Other architectures need every attn_v (a missing one is reported as missing)."""
    if arch != "gemma4":
        return {}
    return {f"blk.{i}.attn_k.{kind}": f"blk.{i}.attn_v.{kind}" for i in range(n_layers)
            for kind in ("weight", "bias") if f"blk.{i}.attn_v.weight" not in names}


def gguf_tensor_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF lists dimensions fastest-first)."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


ROWS_PER_READ = 256
"""Rows dequantized at a time when only some columns of a tensor are wanted (a TP rank's slice of
a row-parallel matrix): the whole float32 tensor is never materialized."""


def dequantize_tensor(tensor, take: Take | None = None) -> torch.Tensor:
    """A GGUF tensor (or its slice `take`, for tensor parallelism) as a CPU torch tensor in PyTorch
    shape order (float32, or F16/BF16 as is).

    GGUF stores each row (PyTorch's last dimension) as whole quantization blocks, so a slice of
    rows is read alone; a slice of columns is read and dequantized ROWS_PER_READ rows at a time.
    Rows are read with plain file reads rather than through the reader's memory map: every mapped
    page a process touches counts in its resident memory until the map is closed, so a TP rank
    that cuts columns out of every row would otherwise hold the whole file's pages."""
    expected_bytes = _tensor_bytes(tensor)
    if tensor.data.nbytes != expected_bytes:
        raise ValueError(f"tensor {tensor.name!r} has {tensor.data.nbytes} bytes of data, expected "
                         f"{expected_bytes}; the file is truncated")
    shape = gguf_tensor_shape(tensor)
    if take is None:
        return _dequantize_rows(tensor, _read_rows(tensor, 0, shape[0]), shape)
    if take.dim == 0:
        rows = _read_rows(tensor, take.start, take.stop)
        return _dequantize_rows(tensor, rows, (take.stop - take.start, *shape[1:]))
    parts = []
    for first in range(0, shape[0], ROWS_PER_READ):
        last = min(first + ROWS_PER_READ, shape[0])
        rows = _dequantize_rows(tensor, _read_rows(tensor, first, last), (last - first, shape[1]))
        parts.append(rows[:, take.start:take.stop].clone())
    return torch.cat(parts)


def _read_rows(tensor, start: int, stop: int) -> np.ndarray:
    """The stored bytes of rows [start, stop) of a GGUF tensor: [rows, bytes per row] uint8."""
    rows = gguf_tensor_shape(tensor)[0]
    row_bytes = _tensor_bytes(tensor) // rows
    path = getattr(tensor.data, "filename", None)
    if path is None:  # a reader over something other than a file: its memory map it is
        return np.array(tensor.data.reshape(rows, -1).view(np.uint8)[start:stop])
    data = np.fromfile(path, dtype=np.uint8, count=(stop - start) * row_bytes,
                       offset=int(tensor.data_offset) + start * row_bytes)
    if data.size != (stop - start) * row_bytes:
        raise ValueError(f"tensor {tensor.name!r}: the file ends inside its data; the file is truncated")
    return data.reshape(stop - start, row_bytes)


def _dequantize_rows(tensor, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Stored bytes of whole rows ([rows, bytes per row] uint8) -> a tensor of `shape`."""
    import gguf
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(data.view(np.float32).reshape(shape))
    if kind == gguf.GGMLQuantizationType.F16:
        return torch.from_numpy(data.view(np.float16).reshape(shape))
    if kind == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).reshape(shape)).view(torch.bfloat16)
    try:
        values = dequantize(data, kind)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name!r} has type {kind.name}, which the installed gguf package "
                         "cannot dequantize; upgrade gguf or re-quantize the file") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


def _tensor_bytes(tensor) -> int:
    from gguf import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    return int(tensor.n_elements) // block * type_size


def load_gguf_weights(model, path: str, tensors: list, arch: str) -> None:
    """Fill `model` (built from this file's config; a TP rank's shard reads only its slices) with
    the file's dequantized tensors (`tensors`: the readers' tensor entries, every shard's)."""
    fused = any(t.name.endswith(".ffn_gate_up_exps.weight") for t in tensors)
    expected = expected_gguf_tensors(model.full_config, arch, model.tp, fused)
    filler = WeightFiller(model, path, {part.piece.source_name + ("" if part.piece.expert is None else
                                                                  f"[{part.piece.expert}]+{part.first_row}"): part.piece
                                        for parts in expected.values() for part in parts})
    as_values = gguf_keys_as_values(arch, {t.name for t in tensors}, model.full_config.n_layers)
    hybrid = HybridTensors(model.full_config, model.tp, filler) if arch in HYBRIDS else None
    for tensor in tensors:
        if tensor.name in _NOT_PARAMETERS or hybrid is not None and _past_trunk(tensor.name, model.full_config):
            continue  # the hybrids' multi-token-prediction blocks follow the trunk's (config_gguf._nextn_layers)
        if hybrid is not None and hybrid.take_gguf(tensor.name, arch, lambda: _dequantized(tensor, path)):
            continue
        if tensor.name not in expected and _ONE_EXPERT.match(tensor.name):
            raise ValueError(f"{path}: tensor {tensor.name!r} is one expert's matrix, the layout of llama.cpp's first "
                             "Mixtral files; ringctx reads the experts stacked as ffn_{gate,up,down}_exps (the gguf "
                             "package's names): re-convert the model with a current llama.cpp")
        parts = expected.get(tensor.name) or [GGUFPart(filler.piece(tensor.name), None)]  # unknown: raises
        shape = gguf_tensor_shape(tensor)
        if parts[0].piece.expert is not None:  # a layer's experts [E, ...]: one slab each
            _fill_gguf_experts(tensor, shape, parts, filler, path)
            continue
        if len(parts) > 1:  # a fused tensor: its parts' rows, stacked
            rows = [filler.expected_shape(part.piece)[0] for part in parts]
            want = (sum(rows), *filler.expected_shape(parts[0].piece)[1:])
            if shape != want:
                raise ValueError(f"{path}: tensor {tensor.name!r} has shape {shape}, but the model config needs "
                                 f"{want}; the weights do not match the config")
        for part in parts:
            piece, take = part.piece, part.piece.take
            if len(parts) > 1:
                n = filler.expected_shape(piece)[0]
                take = Take(0, part.first_row + (take.start if take else 0),
                            part.first_row + (take.stop if take else n), shape[0])
            else:
                filler.check_shape(piece, shape)
            try:
                value = dequantize_tensor(tensor, take)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            if part.heads is not None:
                value = unpermute_rotary_rows(value, part.heads)
            if gguf_norm_shift(arch, tensor.name):
                value = value.float() - 1
            filler.put(piece, value)
            if tensor.name in as_values:  # the same rows, TP slice included (k's and v's are both by KV heads)
                filler.put(filler.piece(as_values[tensor.name]), value)
            del value  # one dequantized tensor alive at a time
    filler.finish()


def _dequantized(tensor, path: str) -> torch.Tensor:
    """A whole GGUF tensor in float32, errors naming the file."""
    try:
        return dequantize_tensor(tensor).float()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _past_trunk(name: str, config: ModelConfig) -> bool:
    """Whether tensor `name` is of a block past the config's layers (blk.N, N >= n_layers)."""
    match = re.match(r"blk\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= config.n_layers


def _fill_gguf_experts(tensor, shape: tuple[int, ...], parts: list[GGUFPart], filler: WeightFiller,
                       path: str) -> None:
    """Fill every expert's slab of a 3-D parameter from a GGUF expert tensor of `shape` (parts: each
    expert's, in expert order; Gemma 4's ffn_gate_up_exps has two per expert, its gate rows then
    its up rows from `first_row`): each expert's matrix is read alone (dequantized one expert at
    a time), its parts' rows cut out and cut to the TP rank's share (`WeightPiece.take`)."""
    n_experts = parts[-1].piece.expert + 1
    per_expert = [part for part in parts if part.piece.expert == 0]
    whole = [filler.expected_shape(part.piece) for part in per_expert]  # each part's rows before TP
    want = (n_experts, sum(rows for rows, *_ in whole), *whole[0][1:])
    if shape != want:
        raise ValueError(f"{path}: tensor {tensor.name!r} has shape {shape}, but the model config needs {want} "
                         "(experts, then each expert's matrix); the expert count or widths in the header do not "
                         "match the tensors")
    for e in range(n_experts):
        try:
            value = dequantize_tensor(tensor, Take(0, e, e + 1, n_experts))[0]
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        for part, (rows, *_) in zip(parts[e * len(per_expert):(e + 1) * len(per_expert)], whole):
            piece = part.piece
            mine = value[part.first_row:part.first_row + rows]
            filler.put(piece, mine if piece.take is None else mine[piece.take.index()])
        del value


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype, device, name: str | None = None,
              tp: TensorParallel = NO_TP, adjust_config=None, ep: ExpertParallel = NO_EP):
    """Config and model (this TP rank's shard under `tp`) from a GGUF file: (ModelConfig,
    Transformer with the file's weights). adjust_config(config) -> the config the model is built
    with (loader.py's --rope-scaling), or None."""
    from .weights import empty_model

    path = os.fspath(path)
    reader = open_gguf(path)
    config = read_gguf_config(reader, name=name or os.path.basename(path))
    if adjust_config is not None:
        config = adjust_config(config)
    arch = read_gguf_field(reader.fields["general.architecture"])
    meta = torch.device(device).type == "meta"
    tensors = [] if meta else [t for shard in gguf_shards(path, reader) for t in shard.tensors]
    # The reader's parsed metadata (the tokenizer's vocabulary, ~150 MiB of objects for a 49K
    # vocabulary) goes before the weights arrive: the peak is the larger of the two, not their sum.
    del reader
    gc.collect()
    release_free_memory()  # hand the freed objects' pages back to the OS (malloc_trim)
    model = empty_model(config, dtype=dtype, device=device, tp=tp, ep=ep)
    if not meta:
        load_gguf_weights(model, path, tensors, arch)
    return config, model
