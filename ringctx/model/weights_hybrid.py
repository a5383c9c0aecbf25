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

Under tensor parallelism a rank holds whole key heads and the G = Hv / Hk value heads each serves
(`linear_rows`), so its Gated DeltaNet is an ordinary one of Hk / T key heads; the out-projection's
partial outputs are summed. These tensors are read whole and cut here (a few MB each).
"""

from __future__ import annotations

import re

import torch

from .config import ModelConfig
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


class HybridTensors:
    """Fills a hybrid's special tensors (module docstring) into `filler`'s model, each cut to its
    TP rank's rows. `take` returns True for a tensor it consumed."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, filler: WeightFiller):
        self.config, self.tp, self.filler = config, tp, filler

    def take(self, handle, path: str, name: str, shape: tuple[int, ...], file_name: str) -> bool:
        """Fill tensor `file_name` of an open safetensors file (`name`: its causal LM name, see
        weights_hf.text_tensor_name) if it is one of these; False: the reader fills it as usual."""
        self.file_name = file_name
        match = _QKVZ.match(name)
        if match is not None:  # Qwen3-Next's grouped projections: reorder into Qwen3.5's four
            self._grouped(handle, path, name, match.group(1), int(match.group(2)), match.group(3), shape)
            return True
        piece = self.filler.expected.get(name)
        if piece is None or piece.take is not None:
            return False
        if name.endswith(".self_attn.q_proj.weight") and self.config.attn_output_gate:
            self._query_and_gate(handle, path, name, int(name.split(".")[2]), shape)
            return True
        param = linear_param(piece.param)
        if param is None:
            return False
        layer = int(name.split(".")[2])
        value = _get(handle, path, self.file_name)
        if param == "conv_weight":
            value = _reshape(value, name, (shape[0], shape[-1]), self.filler)
        self._put(name, layer, param, value)
        return True

    def _put(self, source: str, layer: int, param: str, value: torch.Tensor) -> None:
        """A linear layer's whole parameter `param` -> this rank's rows of it."""
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

    def _query_and_gate(self, handle, path: str, name: str, layer: int, shape: tuple[int, ...]) -> None:
        """q_proj [Hq * 2D, dim] -> this rank's query heads' rows of wqkv and of wgate."""
        c = self.config
        D, hq = c.head_dim_of(layer), c.n_heads
        if tuple(shape) != (hq * 2 * D, c.dim):
            raise ValueError(f"{self.filler.source}: tensor {name!r} has shape {tuple(shape)}, but the model config "
                             f"needs {(hq * 2 * D, c.dim)} (each query head's rows, then its output gate's); the "
                             "weights do not match the config")
        a, b = self.tp.q_heads(c)
        heads = _get(handle, path, self.file_name).view(hq, 2, D, c.dim)[a:b]
        query, gate = heads[:, 0].reshape(-1, c.dim), heads[:, 1].reshape(-1, c.dim)
        self.filler.put(self.filler.piece(name), query)
        self.filler.put(WeightPiece(f"layers.{layer}.attention.wgate.weight", None, name), gate)

    def _grouped(self, handle, path: str, name: str, stem: str, layer: int, which: str,
                 shape: tuple[int, ...]) -> None:
        s = self.config.linear(layer) if layer < self.config.n_layers else None
        if s is None:
            raise ValueError(f"{self.filler.source}: tensor {name!r} belongs to a linear-attention layer, but the "
                             f"config's layer {layer} attends; layer_types do not match the weights")
        group, dim = s.value_heads // s.key_heads, self.config.dim
        per_head = 2 * s.key_dim + 2 * group * s.value_dim if which == "qkvz" else 2 * group
        if tuple(shape) != (s.key_heads * per_head, dim):
            raise ValueError(f"{self.filler.source}: tensor {name!r} has shape {tuple(shape)}, but the model config "
                             f"needs {(s.key_heads * per_head, dim)}; the weights do not match the config")
        heads = _get(handle, path, self.file_name).view(s.key_heads, per_head, dim)
        if which == "ba":
            b, a = heads.split([group, group], dim=1)
            self._put(f"{stem}.in_proj_b.weight", layer, "in_proj_b", b.reshape(-1, dim))
            self._put(f"{stem}.in_proj_a.weight", layer, "in_proj_a", a.reshape(-1, dim))
            return
        q, k, v, z = heads.split([s.key_dim, s.key_dim, group * s.value_dim, group * s.value_dim], dim=1)
        self._put(f"{stem}.in_proj_qkv.weight", layer, "in_proj_qkv",
                  torch.cat([q.reshape(-1, dim), k.reshape(-1, dim), v.reshape(-1, dim)]))
        self._put(f"{stem}.in_proj_z.weight", layer, "in_proj_z", z.reshape(-1, dim))


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
