"""The tensors of a linear-attention hybrid's checkpoint (Qwen3.5 / 3.6, Qwen3-Next) that do not
map one to one onto ringctx's parameters, and which rows of them a tensor-parallel rank holds.

    self_attn.q_proj.weight     [Hq * 2D, dim]   per head its D query rows, then its D gate rows:
                                                 the query rows go to wqkv, the gate rows to wgate
    linear_attn.conv1d.weight   [C, 1, K]        -> conv_weight [C, K]
    linear_attn.norm.weight     [Dv]             -> norm_weight
    linear_attn.in_proj_qkvz    [Hk * (2Dk + 2G Dv), dim]   Qwen3-Next: per key head its q, k, G value
    linear_attn.in_proj_ba      [Hk * 2G, dim]              heads' v and z rows; b then a rows
                                                 -> in_proj_qkv (q | k | v), in_proj_z, in_proj_b, in_proj_a
    mlp.shared_expert_gate      [1, dim]         -> feed_forward.shared_gate

llama.cpp's GGUF files of these models (qwen35, qwen35moe, qwen3next) hold them transformed
once more by its converter; `HybridTensors.take_gguf` undoes that (`HYBRID_GGUF_TENSORS`).

Under tensor parallelism a rank holds whole key heads and the G = Hv / Hk value heads each serves
(`linear_rows`), so its Gated DeltaNet is an ordinary one of Hk / T key heads; the out-projection's
partial outputs are summed. These tensors are read whole and cut here (a few MB each).
"""

from __future__ import annotations

import re

import torch

from .config import LinearShape, ModelConfig
from .tensor_parallel import TensorParallel, linear_param, linear_rows
from .weights import WeightFiller, WeightPiece, qkv_rows

def hybrid_pieces(config: ModelConfig, local: ModelConfig, i: int, hf: str, ours: str) -> dict[str, WeightPiece]:
    """Layer i's tensors that `HybridTensors.take` fills (its checkpoint names -> pieces of this
    rank's parameters, `local` its shard's config; the TP cut is HybridTensors'): a linear layer's,
    or a gated attention layer's q_proj (its query rows of wqkv; the gate rows go to wgate)."""
    pieces: dict[str, WeightPiece] = {}

    def add(hf_name: str, param: str, rows=None) -> None:
        pieces[hf_name] = WeightPiece(param, rows, hf_name)

    if config.linear(i) is None:
        add(f"{hf}.self_attn.q_proj.weight", f"{ours}.attention.wqkv.weight", qkv_rows(local, "q", i))
        return pieces
    la, mine = f"{hf}.linear_attn", f"{ours}.linear_attn"
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        add(f"{la}.{name}.weight", f"{mine}.{name}.weight")
    add(f"{la}.conv1d.weight", f"{mine}.conv_weight")
    add(f"{la}.norm.weight", f"{mine}.norm_weight")
    add(f"{la}.dt_bias", f"{mine}.dt_bias")
    add(f"{la}.A_log", f"{mine}.A_log")
    return pieces


_QKVZ = re.compile(r"(model\.layers\.(\d+)\.linear_attn)\.in_proj_(qkvz|ba)\.weight$")

HYBRID_GGUF_TENSORS = {"attn_qkv.weight": "in_proj_qkv", "attn_gate.weight": "in_proj_z",
                       "ssm_beta.weight": "in_proj_b", "ssm_alpha.weight": "in_proj_a",
                       "ssm_conv1d.weight": "conv_weight", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log",
                       "ssm_norm.weight": "norm_weight", "ssm_out.weight": "out_proj"}
"""A Gated DeltaNet layer's tensors in llama.cpp's qwen35 files (blk.N.<name>) -> the parameter
each holds (layers.N.linear_attn.<param>), as its converter transforms it (`HybridTensors.take_gguf`);
qwen3next files hold ssm_ba (b then a rows of each key head) in place of ssm_beta / ssm_alpha,
and older ones ssm_in (the checkpoint's grouped in_proj_qkvz) in place of attn_qkv / attn_gate."""


class HybridTensors:
    """Fills a hybrid's special tensors (module docstring) into `filler`'s model, each cut to its
    TP rank's rows. `take` returns True for a tensor it consumed."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, filler: WeightFiller):
        self.config, self.tp, self.filler = config, tp, filler

    def take(self, handle, path: str, name: str, shape: tuple[int, ...], file_name: str) -> bool:
        """Fill tensor `file_name` of an open safetensors file (`name`: its causal LM name, see
        weights_hf.text_tensor_name) if it is one of these; False: the reader fills it as usual."""
        match = _QKVZ.match(name)
        if match is not None:  # Qwen3-Next's grouped projections: reorder into Qwen3.5's four
            stem = match.group(1)
            self.grouped(name, int(match.group(2)), match.group(3), _get(handle, path, file_name),
                         lambda param: f"{stem}.{param}.weight")
            return True
        piece = self.filler.expected.get(name)
        if piece is None or piece.take is not None:
            return False
        if name.endswith(".self_attn.q_proj.weight") and self.config.attn_output_gate:
            self.query_and_gate(name, int(name.split(".")[2]), _get(handle, path, file_name))
            return True
        param = linear_param(piece.param)
        if param is None:
            return False
        layer = int(name.split(".")[2])
        value = _get(handle, path, file_name)
        if param == "conv_weight":
            value = _reshape(value, name, (shape[0], shape[-1]), self.filler)
        self.put(name, layer, param, value)
        return True

    def take_gguf(self, name: str, arch: str, read) -> bool:
        """Fill GGUF tensor `name` of a file of `arch` (qwen35, qwen35moe, qwen3next) if its
        llama.cpp layout is not ours (weights_gguf.hybrid_gguf_parts names them), undoing what the
        converter (convert_hf_to_gguf.py's Qwen3NextModel and, for qwen35 / qwen35moe, its
        _LinearAttentionVReorderBase) did; read() -> the whole tensor dequantized, float32. False:
        the reader fills it as usual.

        - attn_q [Hq * 2D, dim] of an attention layer: each head's query rows, then its gate rows;
        - ssm_a = -exp(A_log) -> A_log = log(-ssm_a), in float64 (exp(A_log) gives ssm_a back to a
          rounding); ssm_dt.bias -> dt_bias; ssm_conv1d [C, K] (the checkpoint's [C, 1, K]
          squeezed) -> conv_weight;
        - qwen35 / qwen35moe: every value-head axis in llama.cpp's tiled order, back to the
          checkpoint's (`untile_value_heads`);
        - qwen3next: attn_qkv and attn_gate are the checkpoint's in_proj_qkvz reordered into q | k |
          v and z, value heads grouped as ours; ssm_ba, and an older file's ssm_in, are the
          checkpoint's grouped in_proj_ba / in_proj_qkvz, split as `grouped` splits them.
        The norms' stored 1 + w: weights_gguf.gguf_norm_shift."""
        match = re.match(r"blk\.(\d+)\.(.+)$", name)
        if match is None or int(match.group(1)) >= self.config.n_layers:
            return False
        layer, rest = int(match.group(1)), match.group(2)
        shape = self.config.linear(layer)
        if shape is None:
            if rest != "attn_q.weight" or not self.config.attn_output_gate:
                return False
            self.query_and_gate(name, layer, read())
            return True
        blk, grouped = f"blk.{layer}", arch == "qwen3next"
        if rest == "ssm_ba.weight" and grouped:
            self.grouped(name, layer, "ba", read(), lambda param: f"{blk}.ssm_ba.weight:{param[-1]}")
        elif rest == "ssm_in.weight" and grouped:
            names = {"in_proj_qkv": f"{blk}.attn_qkv.weight", "in_proj_z": f"{blk}.attn_gate.weight"}
            self.grouped(name, layer, "qkvz", read(), names.__getitem__)
        elif rest in HYBRID_GGUF_TENSORS:
            param, value = HYBRID_GGUF_TENSORS[rest], read()
            if param == "A_log":
                value = torch.log(-value.double()).float()
            if not grouped:
                value = untile_value_heads(value, shape, param)
            self.put(name, layer, param, value)
        else:
            return False
        return True

    def put(self, source: str, layer: int, param: str, value: torch.Tensor) -> None:
        """A linear layer's whole parameter `param` (tensor `source`'s piece) -> this rank's rows of it."""
        piece = self.filler.piece(source)
        dim, index = linear_rows(self.config.linear(layer), self.tp, param)
        want = self.filler.expected_shape(piece)
        if tuple(value.shape) != tuple(self._whole_shape(layer, param, want)):
            raise ValueError(f"{self.filler.source}: tensor {source!r} has shape {tuple(value.shape)}, but the "
                             f"model config needs {tuple(self._whole_shape(layer, param, want))}; the weights do "
                             "not match the config")
        self.filler.put(piece, value if index is None else value.index_select(dim, index))

    def _whole_shape(self, layer: int, param: str, local: tuple[int, ...]) -> list[int]:
        """The whole layer's shape of `param` whose TP shard has shape `local`."""
        dim, index = linear_rows(self.config.linear(layer), self.tp, param)
        shape = list(local)
        if index is not None:
            shape[dim] = shape[dim] * self.tp.size
        return shape

    def query_and_gate(self, name: str, layer: int, value: torch.Tensor) -> None:
        """q_proj `value` [Hq * 2D, dim] (tensor `name`: each head's D query rows, then its D gate
        rows) -> this rank's query heads' rows of wqkv and of wgate."""
        c = self.config
        D, hq, shape = c.head_dim_of(layer), c.n_heads, tuple(value.shape)
        if tuple(shape) != (hq * 2 * D, c.dim):
            raise ValueError(f"{self.filler.source}: tensor {name!r} has shape {tuple(shape)}, but the model config "
                             f"needs {(hq * 2 * D, c.dim)} (each query head's rows, then its output gate's); the "
                             "weights do not match the config")
        a, b = self.tp.q_heads(c)
        heads = value.view(hq, 2, D, c.dim)[a:b]
        query, gate = heads[:, 0].reshape(-1, c.dim), heads[:, 1].reshape(-1, c.dim)
        self.filler.put(self.filler.piece(name), query)
        self.filler.put(WeightPiece(f"layers.{layer}.attention.wgate.weight", None, name), gate)

    def grouped(self, name: str, layer: int, which: str, value: torch.Tensor, target) -> None:
        """Qwen3-Next's grouped projection `value` (tensor `name`; which: "qkvz" [Hk * (2Dk + 2G Dv),
        dim] or "ba" [Hk * 2G, dim], per key head its rows of each part) -> this rank's rows of
        in_proj_qkv and in_proj_z, or in_proj_b and in_proj_a; target(param) names the piece each
        fills (the tensor's parts' names in the expected pieces)."""
        s = self.config.linear(layer) if layer < self.config.n_layers else None
        shape = tuple(value.shape)
        if s is None:
            raise ValueError(f"{self.filler.source}: tensor {name!r} belongs to a linear-attention layer, but the "
                             f"config's layer {layer} attends; layer_types do not match the weights")
        group, dim = s.value_heads // s.key_heads, self.config.dim
        per_head = 2 * s.key_dim + 2 * group * s.value_dim if which == "qkvz" else 2 * group
        if tuple(shape) != (s.key_heads * per_head, dim):
            raise ValueError(f"{self.filler.source}: tensor {name!r} has shape {tuple(shape)}, but the model config "
                             f"needs {(s.key_heads * per_head, dim)}; the weights do not match the config")
        heads = value.view(s.key_heads, per_head, dim)
        if which == "ba":
            b, a = heads.split([group, group], dim=1)
            self.put(target("in_proj_b"), layer, "in_proj_b", b.reshape(-1, dim))
            self.put(target("in_proj_a"), layer, "in_proj_a", a.reshape(-1, dim))
            return
        q, k, v, z = heads.split([s.key_dim, s.key_dim, group * s.value_dim, group * s.value_dim], dim=1)
        self.put(target("in_proj_qkv"), layer, "in_proj_qkv",
                 torch.cat([q.reshape(-1, dim), k.reshape(-1, dim), v.reshape(-1, dim)]))
        self.put(target("in_proj_z"), layer, "in_proj_z", z.reshape(-1, dim))


def untile_value_heads(value: torch.Tensor, shape: LinearShape, param: str) -> torch.Tensor:
    """A whole linear layer's parameter `param` (its value heads in llama.cpp's tiled order, as its
    qwen35 converter writes them: value head g Hk + k is the g-th of key head k's G) -> the
    checkpoint's grouped order (k G + g), which ours is. The value-head axis: the v rows of
    in_proj_qkv and conv_weight (after the 2 Hk Dk q and k rows), the rows of in_proj_z (Dv per
    head), in_proj_b, in_proj_a, dt_bias and A_log (one per head), the columns of out_proj (Dv per
    head); norm_weight [Dv] has none. A tensor of another size comes back as it is (the caller's
    shape check names it)."""
    group, hk = shape.value_heads // shape.key_heads, shape.key_heads
    if group == 1 or param == "norm_weight":
        return value
    width = shape.value_dim if param in ("in_proj_qkv", "conv_weight", "in_proj_z", "out_proj") else 1
    first = 2 * hk * shape.key_dim if param in ("in_proj_qkv", "conv_weight") else 0
    dim = 1 if param == "out_proj" else 0
    if value.dim() <= dim or value.shape[dim] != first + shape.value_heads * width:
        return value
    heads = value.narrow(dim, first, shape.value_heads * width)
    sizes = heads.shape
    grouped = heads.reshape(*sizes[:dim], group, hk, width, *sizes[dim + 1:]).transpose(dim, dim + 1).reshape(sizes)
    return torch.cat([value.narrow(dim, 0, first), grouped], dim)


def _get(handle, path: str, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{path}: cannot read tensor {name!r} ({type(e).__name__}: {e}); the file is truncated "
                         "or corrupt, re-download it") from None


def _reshape(value: torch.Tensor, name: str, shape: tuple[int, ...], filler: WeightFiller) -> torch.Tensor:
    if value.numel() != shape[0] * shape[1] or value.dim() != 3 or value.shape[1] != 1:
        raise ValueError(f"{filler.source}: tensor {name!r} has shape {tuple(value.shape)}, but the model config "
                         f"needs [{shape[0]}, 1, {shape[1]}] (channels, 1, taps); the weights do not match the config")
    return value.reshape(shape)
