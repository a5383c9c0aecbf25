"""A Llama-family decoder whose attention is a pluggable call.

Layout is token-major with no batch dimension (docs/ARCHITECTURE.md): activations are [T, dim] for the T
tokens of one step, which may be one sequence or several packed ones; only the `attend` callable
knows how tokens relate to each other and to a KV cache. Everything else (embedding, RMSNorm,
RoPE at explicit global positions, SwiGLU MLP, output head) is per token.

    x = embed(token_ids)                       [T, dim]
    rope = model.rope(positions)               cos/sin [T, 1, head_dim] for the given positions
    for i, block in enumerate(model.layers):
        x = block(x, rope, attend, i)           attend(i, q, k, v) -> out, q/k after RoPE
    logits = model.head(model.norm(x))         float32 [T, vocab]

The prefill engine can drive these pieces layer by layer; `Transformer.forward` runs them all.

Numerics follow Hugging Face transformers' Llama / Mistral / Qwen2 / Qwen3 ForCausalLM (RMSNorm accumulated
in float32, rotate-half RoPE with cos/sin cast to the activation dtype, SwiGLU and residual adds in
the activation dtype, logits cast to float32): float32 logits agree to ~1e-5 relative. The same
holds for the blocks ModelConfig describes beyond Llama's (Seed-OSS, Phi-3, Gemma 3: GeGLU, (1 + w)
norms, post-norms, scaled embeddings, a soft-capped head; Gemma 4: v norms, block scalars) and for
Llama 4's attention (q/k norms after RoPE, query temperatures). The rotary
angles are computed in float64, more accurate than transformers' float32 at long positions.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.dual_chunk import DualChunk
from ..attention.spans import LayerSoftmax
from .config import ModelConfig
from ..kernels import cpu, selection
from ..kernels.cpu_features import computes_in_float32
from .int8_weights import int8_of
from .expert_parallel import NO_EP, ExpertParallel
from .gated_deltanet import GatedDeltaNet
from .moe import MixtureOfExperts
from .tensor_parallel import NO_TP, TensorParallel

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attend(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> out [T, Hq, D] in q's dtype.

q and k arrive after RoPE at the tokens' global positions. A dual chunk layer (Dual Chunk Attention)
gets q [T, 3 * Hq, D], its three rotations side by side (intra heads [0, Hq), succ [Hq, 2Hq), inter
[2Hq, 3Hq): `DualChunkAngles`) and k rotated at position mod chunk_len, and still returns [T, Hq, D]
(`span_attention` and the ring read the layer's `LayerSoftmax.span`). They may be non-contiguous
views of one fused projection; an implementation that keeps them beyond the call must copy them.
The returned tensor belongs to the caller (a block may overwrite it), so it must not be one the
implementation keeps or a view of its inputs.

A model with linear-attention layers (`ModelConfig.layer_linear`: Qwen3.5's Gated DeltaNet) needs
an attend that also has a method `mix_linear(layer_idx, layer: GatedDeltaNet, x [T, dim]) -> y
[T, dim]`: x is the layer's normed input, y its output before the residual add. The sequence's
state lives with whoever implements it (a cache's `LinearState`s, the ranks' exchanges of
runtime/linear_layers.py); T == 0 is allowed (a rank without tokens still joins collectives)."""

class HybridAttend(NamedTuple):
    """An `attend` for a model with linear-attention layers: attention layers call `attend`, linear
    ones `mix_linear(layer_idx, layer, x) -> y` (see Attend)."""

    attend: Attend
    mix_linear: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend(layer, q, k, v)


LogitsSpec = Union[str, torch.Tensor]
"""Which rows to compute logits for: "last", "all", "none" or a LongTensor of row indices."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [T, in] @ weight[out, in]^T (+ bias) -> [T, out] in x's dtype.

    On a CPU without bf16 units a half-precision matmul runs in float32 and is rounded back (see
    ringctx/kernels/cpu_features.py): the same result as a native bf16 GEMM up to summation order,
    1.5-4x faster there; below UPCAST_MIN_ROWS rows in the decode kernels' product, over the weight
    in place (the rows each product takes: kernels/selection.py's `linear_kernel`).
    """
    half_in_float32 = computes_in_float32(x)
    kernel = selection.linear_kernel(x.shape[0], x.device.type == "cpu", half_in_float32)
    if kernel == selection.SMALL_LINEAR:
        # Decode-sized inputs (and, without bf16 units, any below UPCAST_MIN_ROWS): a kernel that
        # streams the weights at memory speed (PyTorch's bf16 GEMV ran at half of it, with bf16
        # units or without; its float32 one at 0.8-1x); int8 weights' codes where the model has
        # them (the same result from half the bytes).
        codes = int8_of(weight)
        y = None if codes is None else cpu.small_linear_int8(x, codes.codes, codes.exponents, bias)
        if y is None:
            y = cpu.small_linear(x, weight, bias, max_rows=selection.UPCAST_MIN_ROWS - 1)
        if y is not None:
            return y
    elif kernel == selection.AMX_LINEAR:
        # A question's or a short prompt's rows, bf16 on AMX: the weights read once, in place
        # (PyTorch's bf16 matmul took 1.2-1.4x the time at 9-16 rows: csrc/cpu_attention_amx.c).
        y = cpu.amx_linear(x, weight, bias)
        if y is not None:
            return y
    if half_in_float32:  # what the kernels did not take (float16, no kernels, many rows)
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    rows = x.shape[0]
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 \
            and (padded := selection.padded_gemm_rows(rows)) != rows:
        # Row counts that repeat: oneDNN builds and keeps a kernel per row count (selection.py says
        # what that cost); the zero rows' outputs are dropped.
        return F.linear(torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]), weight, bias)[:rows]
    return F.linear(x, weight, bias)


class RopeAngles(NamedTuple):
    """cos and sin of the rotary angles of T tokens, laid out for `apply_rotary`.

    cos: [T, 1, head_dim] = cat(cos θ, cos θ), sin: [T, 1, head_dim] = cat(-sin θ, sin θ), both
    in the activation dtype; θ [T, head_dim/2] = position * inv_freq.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def rows(self, start: int, stop: int) -> "RopeAngles":
        """The angles of tokens start..stop-1."""
        return RopeAngles(self.cos[start:stop], self.sin[start:stop])

    def for_layer(self, layer: int) -> "RopeAngles":
        """The angles layer `layer` rotates with: these (every layer shares the model's RoPE)."""
        return self

    def query_temperature(self, layer: int) -> None:
        """No layer scales its queries by position (see LayerRopes)."""
        return None


class DualChunkAngles(NamedTuple):
    """The angles of a Dual Chunk Attention layer for T tokens (attention/dual_chunk.py): the keys'
    (at position mod chunk_len) and the queries' three rotations, each a RopeAngles whose cos and
    sin carry the length factor (1 up to original_max_position)."""

    key: RopeAngles
    intra: RopeAngles
    succ: RopeAngles
    inter: RopeAngles

    def rows(self, start: int, stop: int) -> "DualChunkAngles":
        return DualChunkAngles(*(a.rows(start, stop) for a in self))

    def for_layer(self, layer: int) -> "DualChunkAngles":
        return self

    def query_temperature(self, layer: int) -> None:
        """A dual chunk layer scales no query by position (its length factor is in the angles)."""
        return None

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] (k a buffer the caller owns) -> (q [T, 3 * Hq, D]: the three
        rotations side by side, k rotated in place)."""
        q3 = torch.cat([apply_rotary(q, a) for a in (self.intra, self.succ, self.inter)], dim=1)
        return q3, apply_rotary_(k, self.key)


class LayerRopes:
    """RoPE angles of T tokens for a model whose layers rotate differently (their own base or
    scaling, partial rotary, NoPE layers): one RopeAngles per distinct RoPE, shared by the layers
    that use it; `for_layer` gives a layer's (None for a NoPE layer). Sliced like RopeAngles.

    The other per-token quantity a layer may need rides along: `query_temperature(layer)`, the
    factors [T] its queries are multiplied by (Llama 4's NoPE layers), or None."""

    def __init__(self, angles: list[RopeAngles], of_layer: list[int],
                 temperatures: "list[torch.Tensor | None] | None" = None):
        self.angles, self.of_layer = angles, of_layer  # of_layer[i]: index into angles, -1: NoPE
        self.temperatures = temperatures or [None] * len(of_layer)  # per layer: float32 [T] or None

    def rows(self, start: int, stop: int) -> "LayerRopes":
        return LayerRopes([a.rows(start, stop) for a in self.angles], self.of_layer,
                          [None if t is None else t[start:stop] for t in self.temperatures])

    def for_layer(self, layer: int) -> RopeAngles | None:
        index = self.of_layer[layer]
        return None if index < 0 else self.angles[index]

    def query_temperature(self, layer: int) -> torch.Tensor | None:
        """float32 [T]: what layer `layer` multiplies each token's query by; None: nothing."""
        return self.temperatures[layer]


def apply_rotary(x: torch.Tensor, rope: RopeAngles) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout: pairs are (i, i + R/2)) of x [T, H, D] -> [T, H, D],
    over the first R dims (R = rope's width: D, or fewer for partial rotary; the rest pass through).

    The same formula as transformers' `x * cos + rotate_half(x) * sin` in three ops instead of six:
    rolling x by R/2 gives (x2, x1), and the sign of rotate_half's -x2 lives in `rope.sin`.
    """
    width = rope.cos.shape[-1]
    if width != x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :width], rope), x[..., width:]], dim=-1)
    return torch.addcmul(x * rope.cos, x.roll(x.shape[-1] // 2, dims=-1), rope.sin)


def apply_rotary_(x: torch.Tensor, rope: RopeAngles) -> torch.Tensor:
    """`apply_rotary` in place (x must be a buffer the caller owns); returns x. On the CPU one pass
    of ringctx's kernel (csrc/cpu_token_ops.c), the same roundings."""
    if rope.cos.shape[-1] != x.shape[-1]:  # partial rotary: the rotating dims only
        x[..., :rope.cos.shape[-1]] = apply_rotary(x[..., :rope.cos.shape[-1]], rope)
        return x
    if not cpu.rope_(x, rope.cos, rope.sin):
        x.copy_(apply_rotary(x, rope))
    return x


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, as one fused op that accumulates in float32; with
    plus_one (Gemma), x / sqrt(mean(x^2) + eps) * (1 + weight).

    transformers normalises in float32, rounds to the activation dtype, then multiplies by the
    weight; the fused op rounds once at the end instead. In float32 the two agree to the last
    bits; in bf16 the fused op is, if anything, closer to the exact value.

    plus_one keeps the stored weight w and adds the 1 in float32 at each use, as transformers'
    Gemma3RMSNorm does ((x * (1 + w.float())).to(dtype), the whole norm in float32). Converting w
    to 1 + w at load would be exact in float32 but not in bf16: 1 + w rounded to bf16 keeps only
    ~2^-8 of w's absolute precision (w is small), a 0.4% error in every norm.
    """

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim] in x's dtype (on the CPU in one pass of ringctx's kernel)."""
        if self.plus_one:
            normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
            return normed.mul_(self.weight.float() + 1.0).to(x.dtype)
        out = cpu.rms_norm(x, self.weight, self.eps) if x.device.type == "cpu" else None
        return out if out is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with a fused q/k/v projection; the attention itself is `attend`.

    wqkv.weight: [(Hq + 2*Hkv) * D, dim], rows ordered q heads, k heads, v heads (each head's D
    rows in Hugging Face rotate-half order). wo.weight: [dim, Hq * D]. Under tensor parallelism
    `config` is this rank's shard (its heads) and wo's partial outputs are summed over `tp`.
    With `config.qk_norm` (Qwen3), q_norm and k_norm (weights [D], the same for every head, so
    every TP rank holds them whole) RMS-normalise each head's q and k before RoPE; a layer with
    `qk_norm_after_rope` (Llama 4's RoPE layers; set by Block) normalises them after RoPE, without
    weights; with `config.v_norm` (Gemma 4) each head's v is normalised without weights too.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = NO_TP, layer: int = 0):
        super().__init__()
        self.tp = tp
        # a layer may have its own head shape (Gemma 4 31B's full layers: `LayerAttention.head_dim`)
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads_of(layer), config.head_dim_of(layer)
        self.wqkv = nn.Linear(config.dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=config.attn_out_bias)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        # Learned sink logits [Hq] (gpt-oss) of this layer, when it has them (set by Block).
        self.sinks: nn.Parameter | None = None
        # Weightless RMS norm of q and k after RoPE (Llama 4), with this eps; None: none (set by Block).
        self.norm_after_rope_eps: float | None = None
        # Weightless RMS norm of v (Gemma 4), with this eps; None: none.
        self.v_norm_eps: float | None = config.norm_eps if config.v_norm else None
        # The output gate (Qwen3.5, Qwen3-Next): rows [Hq * D, dim], sigmoid(x W^T) per query head dim
        self.wgate = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False) if config.attn_output_gate \
            else None

    def project(self, x: torch.Tensor, rope: "RopeAngles | DualChunkAngles | None",
                temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> q [T, Hq, D], k [T, Hkv, D] (both after RoPE; rope None: a NoPE layer;
        DualChunkAngles: q [T, 3 * Hq, D], see `DualChunkAngles.rotate`), v [T, Hkv, D].

        temperature: float32 [T] or None, the factors each token's q is multiplied by last."""
        T = x.shape[0]
        qkv = linear(x, self.wqkv.weight, self.wqkv.bias).view(T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        split = self.n_heads + self.n_kv_heads
        if self.q_norm is not None:  # per head, before RoPE (Qwen3); rows of [T * H, D] for the kernel
            for norm, heads in ((self.q_norm, qkv[:, : self.n_heads]), (self.k_norm, qkv[:, self.n_heads : split])):
                heads.copy_(norm.forward(heads.reshape(-1, self.head_dim)).view(heads.shape))
        if isinstance(rope, DualChunkAngles):  # no norm after RoPE, temperature or v norm (ModelConfig refuses them)
            return (*rope.rotate(qkv[:, : self.n_heads], qkv[:, self.n_heads : split]), qkv[:, split:])
        qk = qkv[:, :split] if rope is None else apply_rotary_(qkv[:, :split], rope)  # q and k heads together
        if self.norm_after_rope_eps is not None:  # transformers' Llama4TextL2Norm: float32, rounded once
            qk.copy_(F.rms_norm(qk.float(), (self.head_dim,), None, self.norm_after_rope_eps))
        if temperature is not None:  # as transformers: (q * float32 factor) rounded once to q's dtype
            q = qk[:, : self.n_heads]
            q.copy_(q.float().mul_(temperature.view(T, 1, 1)))
        v = qkv[:, split:]
        if self.v_norm_eps is not None:  # transformers' Gemma4RMSNorm(with_scale=False): float32, rounded once
            v.copy_(F.rms_norm(v.float(), (self.head_dim,), None, self.v_norm_eps))
        return qk[:, : self.n_heads], qk[:, self.n_heads :], v

    def output(self, out: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [T, Hq * D] projected back to [T, dim] (summed over the TP ranks' heads).
        With an output gate, normed [T, dim] is the block's normed input the gate reads: out is
        multiplied by sigmoid(normed W_gate^T) in the model's dtype first, as transformers does."""
        if self.wgate is not None:
            out = out * torch.sigmoid(linear(normed, self.wgate.weight))
        if self.tp.size == 1:
            return linear(out, self.wo.weight, self.wo.bias)
        y = self.tp.all_reduce(linear(out, self.wo.weight))
        return y if self.wo.bias is None else y.add_(self.wo.bias)


ROWS_PER_SLICE = 1024
"""Everything in a block except attention is per token, and runs over at most this many tokens
at a time in float32 (twice as many in 2-byte dtypes: the same bytes): the temporaries of the
norms, the fused projections, RoPE and the MLP ([T, 2*ffn], 24 KiB per token for SmolLM2 in
float32) then stay bounded, while such GEMMs are as efficient as whole-chunk ones (measured: float32
1K-row slices as fast as 8K rows; bf16 on an AMX CPU 1K-row slices 1.35x slower than 2K-4K, whose
per-call weight packing they amortize). Only x, q, k, v and the attention output span a chunk."""


def rows_per_slice(dtype: torch.dtype) -> int:
    """Rows of one slice for activations of `dtype` (ROWS_PER_SLICE float32 rows' worth of bytes)."""
    return ROWS_PER_SLICE * 4 // dtype.itemsize


def row_slices(rows: int, dtype: torch.dtype = torch.float32) -> list[tuple[int, int]]:
    """[(start, stop)] covering 0..rows-1 in slices of rows_per_slice(dtype)."""
    size = rows_per_slice(dtype)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def head_major_rows(rows: int, heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [rows, heads, head_dim] tensor whose memory is head-major ([heads, rows, head_dim]):
    attention kernels read each head's rows contiguously (PyTorch's float32 CPU op ran 3-6% faster
    on such operands than on token-major ones); indexing and results are those of any tensor."""
    return like.new_empty(heads, rows, head_dim).transpose(0, 1)


class FeedForward(nn.Module):
    """Gated MLP: w2(act(x W_gate^T) * (x W_up^T)); w13.weight = cat(W_gate, W_up) [2*ffn, dim];
    act is silu (SwiGLU) or, with config.mlp_activation "gelu_tanh", GELU's tanh form (GeGLU, Gemma).
    Under tensor parallelism `config.ffn_dim` is this rank's hidden units and w2's partial outputs
    are summed over `tp`."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp
        self.ffn_dim = config.ffn_dim
        self.gelu = config.mlp_activation == "gelu_tanh"
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim]."""
        gate_up = linear(x, self.w13.weight)
        gate, up = gate_up[:, : self.ffn_dim], gate_up[:, self.ffn_dim :]
        if self.gelu:  # GeGLU: transformers' act_fn(gate) * up in the activation dtype
            gate.copy_(F.gelu(gate, approximate="tanh")).mul_(up)
            return self.tp.all_reduce(linear(gate, self.w2.weight))
        # In place over the gate half: no [T, ffn] temporaries (w2 reads the strided view as is);
        # on the CPU one pass of ringctx's kernel instead of two PyTorch ops.
        if not (gate_up.device.type == "cpu" and cpu.swiglu_(gate_up, self.ffn_dim)):
            F.silu(gate, inplace=True).mul_(up)
        return self.tp.all_reduce(linear(gate, self.w2.weight))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then h + mlp(norm(h)) (mlp: the gated MLP, or the
    layer's mixture of experts, `ModelConfig.experts`); with config.post_norms
    (Gemma) x + post_attention_norm(attn(norm(x))), then h + post_ffn_norm(mlp(norm(h))), times
    the block's layer_scalar with config.layer_scalars (Gemma 4). A layer whose experts sit beside
    its dense MLP (Gemma 4 26B-A4B, `Experts.beside_dense`) computes, as Gemma4TextDecoderLayer:

        h + post_ffn_norm(post_dense_norm(dense_mlp(ffn_norm(h)))
                          + post_experts_norm(experts(pre_experts_norm(h), router reading h)))"""

    def __init__(self, config: ModelConfig, tp: TensorParallel = NO_TP, layer: int = 0, ep: ExpertParallel = NO_EP):
        super().__init__()
        self.layer = layer
        self.kind = kind = config.attention(layer)
        plus_one = config.norm_plus_one
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, plus_one)
        shape = config.linear(layer)  # a linear-attention layer (Qwen3.5's Gated DeltaNet) in place of attention
        self.linear_attn = None if shape is None else GatedDeltaNet(config.dim, shape, config.norm_eps, linear,
                                                                     None if tp.size == 1 else tp)
        self.attention = Attention(config, tp, layer) if shape is None else None
        if shape is None and plus_one and config.qk_norm:  # Gemma 3's (and Qwen3.5's) q/k norms multiply by (1 + w) too
            self.attention.q_norm = RMSNorm(self.attention.head_dim, config.norm_eps, plus_one)
            self.attention.k_norm = RMSNorm(self.attention.head_dim, config.norm_eps, plus_one)
        if kind.sinks and shape is None:
            self.attention.sinks = nn.Parameter(torch.zeros(config.n_heads, dtype=torch.float32))
        if kind.qk_norm_after_rope and shape is None:
            self.attention.norm_after_rope_eps = config.norm_eps
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, plus_one)
        experts = config.experts(layer)  # a mixture of experts in place of the dense MLP (model/moe.py)
        self.feed_forward = (FeedForward(config, tp) if experts is None
                             else MixtureOfExperts(config, experts, linear, tp, ep))
        # Gemma 4 26B-A4B: the dense MLP stays beside the experts, with its output norm and the experts' two
        beside = experts is not None and experts.beside_dense
        self.dense_mlp = FeedForward(config, tp) if beside else None
        self.post_dense_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if beside else None
        self.pre_experts_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if beside else None
        self.post_experts_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if beside else None
        # Experts spread over ranks (model/expert_parallel.py): every rank of the EP group must make
        # the same all-to-all calls per layer whatever its rows (another rank may have more row
        # slices, or none: T = 0), so forward runs the rest of the block over all rows at once
        self.experts_across_ranks = experts is not None and ep.size > 1
        # Gemma's norms of the attention and MLP outputs (under TP after the all-reduce: whole rows)
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if config.post_norms else None
        self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps, plus_one) if config.post_norms else None
        # Gemma 4: the block's output times a stored scalar [1] (transformers' layer_scalar)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalars else None
        self.span = kind.span
        self.scale = kind.scale or config.head_dim_of(layer) ** -0.5

    def softmax(self) -> LayerSoftmax:
        """This layer's softmax settings (scale, soft-cap, span, sinks) for whoever computes its
        attention (`attend` implementations ask `Transformer.layer_softmax`; a linear layer's are
        plain and unused)."""
        sinks = None if self.attention is None else self.attention.sinks
        return LayerSoftmax(self.scale, self.kind.softcap, self.span, None if sinks is None else sinks.detach())

    def forward(self, x: torch.Tensor, rope: RopeAngles, attend: Attend, layer_idx: int) -> torch.Tensor:
        """x [T, dim] -> [T, dim]: h = x + wo(attend(q, k, v)) with q, k, v from norm(x); h + mlp(norm(h)).

        Long inputs run everything but `attend` in row slices (see ROWS_PER_SLICE), and hand
        `attend` q, k, v with head-major memory (see head_major_rows).
        """
        # .forward directly: nn.Module.__call__'s hook machinery costs microseconds per call, and a
        # decode step makes ~150 such calls for a 30-layer model. (Module hooks are not supported.)
        T = x.shape[0]
        if self.linear_attn is not None:
            return self._linear_forward(x, attend, layer_idx)
        attention = self.attention
        temperature = rope.query_temperature(layer_idx)
        rope = rope.for_layer(layer_idx)
        width = attention.n_heads * attention.head_dim  # explicit: reshape(0, -1) is ambiguous for 0 rows
        slices = row_slices(T, x.dtype)
        if len(slices) == 1:  # one slice: no q/k/v buffers to fill (decode steps stay lean)
            out = attend(layer_idx, *self._qkv(x, rope, temperature))
            return self._after_attention(x, out.reshape(T, width))

        q = head_major_rows(T, attention.n_heads * self.span.query_versions, attention.head_dim, x)
        k = head_major_rows(T, attention.n_kv_heads, attention.head_dim, x)
        v = head_major_rows(T, attention.n_kv_heads, attention.head_dim, x)
        for start, stop in slices:
            q[start:stop], k[start:stop], v[start:stop] = self._qkv(
                x[start:stop], None if rope is None else rope.rows(start, stop),
                None if temperature is None else temperature[start:stop])
        out = attend(layer_idx, q, k, v).reshape(T, width)
        del q, k, v  # attend copied what it keeps
        # Each slice's result depends on its own rows of x and out only, so when shapes allow it the
        # results overwrite the attention output they were computed from: one [T, dim] buffer less.
        reusable = out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        result = out if reusable else torch.empty_like(x)
        for start, stop in [(0, T)] if self.experts_across_ranks else slices:  # (see __init__)
            result[start:stop] = self._after_attention(x[start:stop], out[start:stop])
        return result

    def _linear_forward(self, x: torch.Tensor, attend: Attend, layer_idx: int) -> torch.Tensor:
        """A linear-attention layer: h = x + mix_linear(norm(x)) over all rows at once (the layer's
        state runs through them in order), then the feed-forward in row slices."""
        mix = getattr(attend, "mix_linear", None)
        if mix is None:
            raise ValueError(f"layer {layer_idx} is a linear-attention layer (Gated DeltaNet), and this attend "
                             f"({type(attend).__name__}) computes attention only: the path does not run hybrid "
                             "models yet")
        h = x + mix(layer_idx, self.linear_attn, self.attention_norm.forward(x))
        if self.experts_across_ranks:
            return self._feed_forward(h)
        result = torch.empty_like(h)
        for start, stop in row_slices(h.shape[0], h.dtype):
            result[start:stop] = self._feed_forward(h[start:stop])
        return result

    def _feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """Rows h [n, dim] after the sequence mixing -> h + mlp(norm(h)) (a linear layer's block has
        no post-norms: Qwen3.5's)."""
        h = h + self.feed_forward.forward(self.ffn_norm.forward(h))
        return h if self.layer_scalar is None else h.mul_(self.layer_scalar)

    def _qkv(self, x: torch.Tensor, rope: RopeAngles | None,
             temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows x [n, dim] (and their query temperatures [n] or None) -> q, k (after RoPE), v of those rows."""
        return self.attention.project(self.attention_norm.forward(x), rope, temperature)

    def _after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows x [n, dim] and their attention output [n, Hq * D] -> the block's output rows."""
        if self.post_attention_norm is None:
            gate_input = self.attention_norm.forward(x) if self.attention.wgate is not None else None
            h = x + self.attention.output(out, gate_input)
            h = h + self.feed_forward.forward(self.ffn_norm.forward(h))
        elif self.dense_mlp is None:
            h = x + self.post_attention_norm.forward(self.attention.output(out))
            h = h + self.post_ffn_norm.forward(self.feed_forward.forward(self.ffn_norm.forward(h)))
        else:  # Gemma 4's experts beside the dense MLP; the router reads the residual h
            h = x + self.post_attention_norm.forward(self.attention.output(out))
            dense = self.post_dense_norm.forward(self.dense_mlp.forward(self.ffn_norm.forward(h)))
            moe = self.post_experts_norm.forward(self.feed_forward.forward(self.pre_experts_norm.forward(h), h))
            h = h + self.post_ffn_norm.forward(dense + moe)
        return h if self.layer_scalar is None else h.mul_(self.layer_scalar)


class Transformer(nn.Module):
    """The decoder: token embedding, `n_layers` blocks, final RMSNorm, output head.

    Attributes:
        config: the ModelConfig of the weights this process holds (under tensor parallelism this
            rank's shard: its heads and MLP width, see ringctx.model.tensor_parallel).
        full_config: the whole model's ModelConfig (the same object as `config` without TP).
        tp: the TensorParallel this model is a shard of (size 1: none).
        ep: the ExpertParallel whose share of every MoE layer's experts this model holds (size 1: all).
        tok_embeddings: weight [vocab, dim] (under TP: this rank's ids, [V/T, dim]).
        layers: ModuleList of `Block`.
        norm: final RMSNorm.
        output: head, weight [vocab, dim] (under TP [V/T, dim]); the same Parameter as
            tok_embeddings.weight when tied.
        tokenizer: the transformers tokenizer, or None for random-weight presets (set by load_model).
        source: where the weights came from (preset name, GGUF file or directory).
        weights_format: "model", or "int8" once ringctx.model.int8_weights quantized it.

    `load_model` builds it; `Transformer(config)` alone gives an uninitialised model (or use the
    meta device to plan without memory).
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = NO_TP, ep: ExpertParallel = NO_EP):
        super().__init__()
        self.full_config, self.tp, self.ep = config, tp, ep
        self.config = config = tp.shard_config(config)
        vocab = tp.vocab(config)
        self.tok_embeddings = nn.Embedding(vocab[1] - vocab[0], config.dim)
        self.layers = nn.ModuleList(Block(config, tp, i, ep) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_plus_one)
        self.output = nn.Linear(config.dim, vocab[1] - vocab[0], bias=False)
        self.tie_weights()
        self.source: str = config.name
        self.weights_format = "model"
        self._tokenizer = None
        self._tokenizer_loader: Callable[[], object] | None = None
        # float64 so that angles stay exact at million-token positions; not a registered buffer,
        # so dtype casts of the module leave it alone and meta-device construction costs nothing.
        # One table per distinct RoPE among the layers ((inv_freq, YaRN's or LongRoPE's cos/sin
        # factor)); _rope_of_layer[i] indexes it, -1 for a NoPE layer. A LongRoPE table has a twin
        # with the long factors: _long_tables[table] = (its index in _rope_tables, original length).
        self._rope_tables: list[tuple[torch.Tensor, float]] = []
        self._long_tables: dict[int, tuple[int, int]] = {}
        self._dual_chunk_tables: dict[int, DualChunk] = {}  # a dual chunk layer's table: its rotations
        self._rope_of_layer: list[int] = []
        keys: dict = {}
        for i in range(config.n_layers):
            if not config.attention(i).rope:
                self._rope_of_layer.append(-1)
                continue
            dual_chunk = config.attention(i).dual_chunk
            key = (*config.rope_of(i), dual_chunk)
            if key not in keys:
                keys[key] = len(self._rope_tables)
                if dual_chunk is not None:
                    self._dual_chunk_tables[keys[key]] = dual_chunk
                self._rope_tables.append((torch.tensor(config.rope_inv_freq(i), dtype=torch.float64, device="cpu"),
                                          config.rope_attention_factor(i)))
            self._rope_of_layer.append(keys[key])
        for key, table in keys.items():
            scaling = key[1]
            if scaling is not None and scaling.switches_factors:
                layer = self._rope_of_layer.index(table)
                self._long_tables[table] = (len(self._rope_tables), scaling.original_max_position)
                self._rope_tables.append((torch.tensor(config.rope_inv_freq(layer, long=True), dtype=torch.float64,
                                                       device="cpu"), config.rope_attention_factor(layer)))
        # Layers whose queries are scaled by their position (Llama 4's NoPE layers): their factors
        # ride in LayerRopes, computed once per distinct temperature.
        self._temperature_layers = [i for i in range(config.n_layers) if config.attention(i).temperature_floor]
        self._one_rope = self._rope_of_layer == [0] * config.n_layers and not self._temperature_layers

    # -- pieces ------------------------------------------------------------------------------

    def tie_weights(self) -> None:
        """Make the head share the embedding matrix when the config says so (after any reload)."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights and activations."""
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] long -> x [T, dim]; a clear error for ids outside the vocabulary.

        Under TP each rank looks up the ids of its vocabulary slice (zero rows for the others) and
        an all-reduce sums the T ranks' rows: exact, as every row has one non-zero term.
        config.embed_scale (Gemma's sqrt(dim)) multiplies the rows, rounded to the weights' dtype
        first as transformers' Gemma3TextScaledWordEmbedding does."""
        check_token_ids(token_ids, self.config.vocab_size)
        if self.tp.size == 1:
            return self._scale_embedding(F.embedding(token_ids, self.tok_embeddings.weight))
        lo, hi = self.tp.vocab(self.config)
        elsewhere = (token_ids < lo) | (token_ids >= hi)
        x = F.embedding((token_ids - lo).masked_fill_(elsewhere, 0), self.tok_embeddings.weight)
        return self._scale_embedding(self.tp.all_reduce(x.masked_fill_(elsewhere[:, None], 0), "tp-embed"))

    def _scale_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] (a tensor of ours) times config.embed_scale in x's dtype, in place."""
        scale = self.config.embed_scale
        return x if scale == 1.0 else x.mul_(torch.tensor(scale, dtype=x.dtype, device=x.device))

    def rope(self, positions: torch.Tensor, sequence_end: "int | torch.Tensor | None" = None) -> "RopeAngles | LayerRopes":
        """Rotary cos/sin for positions [T] long (global positions), in the activation dtype: one
        RopeAngles when every layer rotates alike, else LayerRopes (a RopeAngles per layer, and
        the query temperatures of the layers that have one, also by global position).

        Global positions make ring attention exact with any scaling: a rank holding tokens past
        the original context gets the angles one device would. A ValueError for positions the
        scaling cannot compute exactly (dynamic RoPE past its original context, see RopeScaling).

        sequence_end: one past the last position of the whole prompt these positions belong to
        (default: the largest position + 1). LongRoPE layers rotate with their long factors iff
        sequence_end > their original_max_position (see RopeScaling), so every chunk of a prompt
        prefilled in pieces, and every ring rank's share, rotates as one call over it would. A
        LongTensor [T]: each row's own end (a batched decode step, whose rows are different
        sequences: positions + 1, each as its sequence's step alone would choose).

        Dual chunk layers get DualChunkAngles, whose length factor is that of a sequence of
        sequence_end tokens (per row for a tensor), as vLLM scales a prompt's keys and queries by
        its whole length and a decoded token's by position + 1 (attention/dual_chunk.py).
        """
        check_rope_positions(self.config, positions)
        angles = []
        if self._long_tables or self._dual_chunk_tables:
            end = sequence_end if sequence_end is not None else (
                int(positions.max()) + 1 if positions.numel() else 0)
        for i in range(len(self._rope_tables) - len(self._long_tables)):
            long, original = self._long_tables.get(i, (i, 0))
            if i in self._dual_chunk_tables:
                angles.append(self._dual_chunk_angles(positions, i, self._dual_chunk_tables[i], end))
            elif not original:
                angles.append(self._angles(positions, i))
            elif isinstance(end, torch.Tensor):  # per row: a batch step's sequences each decide
                short_angles, long_angles = self._angles(positions, i), self._angles(positions, long)
                pick = (end > original).to(positions.device).view(-1, 1, 1)
                angles.append(RopeAngles(torch.where(pick, long_angles.cos, short_angles.cos),
                                         torch.where(pick, long_angles.sin, short_angles.sin)))
            else:
                angles.append(self._angles(positions, long if end > original else i))
        if self._one_rope:
            return angles[0]
        temperatures: list[torch.Tensor | None] = [None] * self.config.n_layers
        computed: dict[tuple[int, float], torch.Tensor] = {}
        for layer in self._temperature_layers:
            kind = self.config.attention(layer)
            key = (kind.temperature_floor, kind.temperature_scale)
            if key not in computed:
                computed[key] = kind.query_temperature(positions)
            temperatures[layer] = computed[key]
        return LayerRopes(angles, self._rope_of_layer, temperatures)

    def _dual_chunk_angles(self, positions: torch.Tensor, table: int, dca: DualChunk,
                           end: "int | torch.Tensor") -> DualChunkAngles:
        """A dual chunk layer's angles: keys at position mod chunk_len, the queries' three
        rotations (DualChunk.query_positions), all times the length factor of `end` tokens."""
        factor = dca.length_factor(end.cpu() if isinstance(end, torch.Tensor) else end)
        key = self._angles(dca.key_positions(positions), table, factor)
        return DualChunkAngles(key, *(self._angles(p, table, factor) for p in dca.query_positions(positions)))

    def _angles(self, positions: torch.Tensor, table: int,
                row_factor: "float | torch.Tensor" = 1.0) -> RopeAngles:
        """RopeAngles of `positions` [T] with table `table`; cos and sin times row_factor (a float
        or a float64 [T] tensor: dual chunk attention's length factor)."""
        device = positions.device
        math_device = torch.device("cpu") if device.type == "mps" else device  # MPS has no float64
        inv_freq, factor = self._rope_tables[table]
        if inv_freq.device != math_device:
            inv_freq = inv_freq.to(math_device)
            self._rope_tables[table] = (inv_freq, factor)
        angles = positions.to(math_device, torch.float64)[:, None] * inv_freq[None, :]  # [T, R/2]
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        if isinstance(row_factor, torch.Tensor):
            row_factor = row_factor.to(math_device, torch.float64).view(-1, 1)
            cos, sin = cos * row_factor, sin * row_factor
        elif row_factor != 1.0:
            cos, sin = cos * row_factor, sin * row_factor
        cos = torch.cat((cos, cos), dim=-1).to(device, self.dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(device, self.dtype)
        return RopeAngles(cos[:, None, :], sin[:, None, :])

    @property
    def has_spans(self) -> bool:
        """True when some layer sees only part of the earlier keys (a sliding window or chunks)."""
        return any(not block.span.is_full for block in self.layers)

    def layer_softmax(self, layer: int) -> LayerSoftmax:
        """Layer `layer`'s softmax settings: its scale, soft-cap, span and sinks."""
        return self.layers[layer].softmax()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [N, dim] -> float32 logits [N, vocab] (under TP: on every TP rank,
        each computing its vocabulary slice, then one all-gather)."""
        logits = self.tp.gather_vocab(linear(x, self.output.weight).float(), self.config.vocab_size)
        cap = self.config.final_softcap
        if cap:  # Gemma's final_logit_softcapping (transformers: in the logits' dtype; here float32)
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        *,
        logits: LogitsSpec = "last",
        sequence_end: int | None = None,
    ) -> torch.Tensor | None:
        """Run all blocks over T tokens and return float32 logits of the requested rows.

        Args:
            token_ids: [T] long.
            positions: [T] long, each token's global position (RoPE angle), in any order.
            attend: attend(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D].
            logits: "last" -> [1, vocab] for the last row; "all" -> [T, vocab]; "none" -> None;
                a LongTensor of row indices [N] -> [N, vocab].
            sequence_end: one past the last position of the whole prompt (see `rope`; default:
                the largest position + 1). A prompt prefilled in pieces passes its end.
        """
        if token_ids.dim() != 1 or positions.shape != token_ids.shape:
            raise ValueError(f"token_ids and positions must both be 1-D [T]; got {tuple(token_ids.shape)} "
                             f"and {tuple(positions.shape)} (ringctx has no batch dimension)")
        x = self.embed(token_ids)
        rope = self.rope(positions, sequence_end)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, rope, attend, i)
        if isinstance(logits, str):
            if logits == "none":
                return None
            if logits == "last":
                x = x[-1:]
            elif logits != "all":
                raise ValueError(f"logits must be 'last', 'all', 'none' or a LongTensor of rows, got {logits!r}")
        else:
            x = x[logits]
        return self.head(self.norm(x))

    # -- conveniences (implemented in generate.py, loader.py) ----------------------------------

    @property
    def tokenizer(self):
        """The tokenizer (loaded on first use, it takes seconds), or None for random-weight presets."""
        if self._tokenizer is None and self._tokenizer_loader is not None:
            self._tokenizer = self._tokenizer_loader()
            self._tokenizer_loader = None
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer, self._tokenizer_loader = value, None

    def logits(self, token_ids) -> torch.Tensor:
        """float32 logits [T, vocab] of one sequence of token ids (or text) starting at position 0."""
        from .generate import sequence_logits

        return sequence_logits(self, token_ids)

    def generate(self, prompt, **kwargs):
        """Generate text from a prompt; see `ringctx.model.generate.generate` for the arguments."""
        from .generate import generate

        return generate(self, prompt, **kwargs)

    def stream(self, prompt, **kwargs):
        """Like `generate`, as an iterator of text pieces; see `ringctx.model.generate.stream`."""
        from .generate import stream

        return stream(self, prompt, **kwargs)


def rope_position_problem(config: ModelConfig, length: int) -> str | None:
    """Why a sequence of `length` tokens cannot run with this config's RoPE, or None when it can."""
    limit = config.rope_scaling.position_limit if config.rope_scaling else None
    if limit is None or length <= limit:
        return None
    return (f"{length} tokens go past position {limit}, where rope_type "
            f"{config.rope_scaling.rope_type!r} makes every angle depend on the sequence's total length "
            "(transformers recomputes it per length); ringctx runs such a model up to that length only")


def check_rope_positions(config: ModelConfig, positions: torch.Tensor) -> None:
    """Raise rope_position_problem's ValueError when a position is past the scaling's limit."""
    if config.rope_scaling is None or config.rope_scaling.position_limit is None or positions.numel() == 0:
        return
    problem = rope_position_problem(config, int(positions.max()) + 1)
    if problem:
        raise ValueError(problem)


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a ValueError naming the offending id unless all ids lie in [0, vocab_size)."""
    if token_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"token ids must be an integer tensor, got dtype {token_ids.dtype}")
    if token_ids.numel() == 0:
        return
    lo, hi = torch.aminmax(token_ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}); "
                         "tokenize with this model's tokenizer")
