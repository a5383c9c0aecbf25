"""A Gated DeltaNet layer (Qwen3.5 / Qwen3.6's linear-attention layers), on one device, with its
state explicit so that a prefill can stop after any chunk and a question can start from a copy.

For T tokens x [T, dim] (Hk key heads and Hv value heads, Dk and Dv their widths, K the
convolution's width, C = 2 Hk Dk + Hv Dv its channels):

    mixed = x W_qkv^T                                       [T, C]   (q | k | v channels)
    mixed = silu(causal depthwise conv(mixed, K))           the K-1 inputs before x from the state
    q, k, v = split(mixed); q, k L2-normalised in float32; q *= Dk^-0.5; q, k repeated to Hv heads
    beta = sigmoid(x W_b^T)                                 [T, Hv]
    g    = -exp(A_log) softplus(x W_a^T + dt_bias)          [T, Hv]  (float32; the log decay, <= 0)
    o    = the gated delta rule over (q, k, v, g, beta) from the recurrent state (attention/gated_delta.py)
    y    = (rmsnorm(o) * weight * silu(x W_z^T)) W_out^T    the norm per value head, then the gate

as transformers 5.25's Qwen3_5GatedDeltaNet computes it (its torch fallbacks, the oracle): the
convolution in the weights' dtype, the rule in float32, the norm in float32 then scaled by its
weight in the model's dtype, the gate in float32 (the convolution as K float32 multiply-adds rounded
once: F.conv1d's result up to summation order). One token takes the recurrence on its state in
place (decode: ringctx's CPU kernel reads and writes the state once); more take `chunked_from`
(prefill: fla's chunked kernel on CUDA, the CPU kernel token by token, else the chunked form).

The state (`LinearState`): the convolution's last K-1 inputs [K-1, C] in the model's dtype and
the recurrent state [Hv, Dk, Dv] in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.gated_delta import recurrent, recurrent_step
from ..attention.gated_delta_gpu import chunked_from
from .config import LinearShape


def step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          recurrent_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's recurrence (q, k [1, Hv, Dk], v [1, Hv, Dv], g, beta [1, Hv]) on a recurrent state
    [Hv, Dk, Dv] float32: (o [1, Hv, Dv] float32, the state after). In place where it may be (the
    state read and written once, a decode step's floor: ringctx's kernel); a copy for an inference
    tensor outside inference mode, which cannot be written there."""
    if recurrent_state.is_contiguous() and (torch.is_inference_mode_enabled() or not recurrent_state.is_inference()):
        o = recurrent_step(q.float(), k.float(), v.float(), g.float(), beta.float(), recurrent_state[None])
        return o, recurrent_state
    return recurrent(q, k, v.float(), g, beta.float(), recurrent_state)


@dataclass
class LinearState:
    """Where a sequence's linear layer stands after its last token."""

    conv: torch.Tensor
    """[K-1, C] the convolution's last inputs (oldest first), in the model's dtype."""
    recurrent: torch.Tensor
    """[Hv, Dk, Dv] float32."""

    @classmethod
    def zeros(cls, shape: LinearShape, dtype: torch.dtype, device=None) -> "LinearState":
        """The state before a sequence's first token (conv inputs in `dtype`, the model's)."""
        return cls(torch.zeros(shape.conv_width - 1, shape.channels, dtype=dtype, device=device),
                   torch.zeros(shape.value_heads, shape.key_dim, shape.value_dim, device=device))

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def zero_(self) -> "LinearState":
        self.conv.zero_()
        self.recurrent.zero_()
        return self

    def clone(self) -> "LinearState":
        return LinearState(self.conv.clone(), self.recurrent.clone())


class GatedDeltaNet(nn.Module):
    """forward(x [T, dim], state or None) -> (y [T, dim], the state after x). Parameter names are
    transformers' (linear_attn.*), but for conv_weight [C, K] (checkpoints: conv1d.weight [C, 1, K])
    and norm_weight [Dv] (checkpoints: norm.weight).

    Under tensor parallelism `shape` is this rank's shard (its key heads and their value heads, see
    model/tensor_parallel.py) and the out-projection's partial outputs are summed over `tp`.
    `linear` is the model's matmul (transformer.linear: ringctx's CPU kernels where they apply)."""

    def __init__(self, dim: int, shape: LinearShape, norm_eps: float, linear=F.linear, tp=None):
        super().__init__()
        self.shape, self.norm_eps, self.linear, self.tp = shape, norm_eps, linear, tp
        s = shape
        self.in_proj_qkv = nn.Linear(dim, s.channels, bias=False)
        self.in_proj_z = nn.Linear(dim, s.value_heads * s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, s.value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.channels, s.conv_width))  # checkpoint conv1d.weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm_weight = nn.Parameter(torch.ones(s.value_dim))
        self.out_proj = nn.Linear(s.value_heads * s.value_dim, dim, bias=False)

    def empty_state(self, device=None, dtype=None) -> LinearState:
        """The state before a sequence's first token: zeros."""
        s = self.shape
        return LinearState(torch.zeros(s.conv_width - 1, s.channels, dtype=dtype or self.conv_weight.dtype,
                                       device=device),
                           torch.zeros(s.value_heads, s.key_dim, s.value_dim, device=device))

    # -- the steps, in order (context parallelism runs them with exchanges between) -------------------
    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> the convolution's inputs [T, C] (they depend on these tokens alone)."""
        return self.linear(x, self.in_proj_qkv.weight)

    def convolve(self, mixed: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The causal convolution of mixed [T, C] after its previous inputs before [K-1, C], SiLU, the
        split, the L2 norms and q's scale: (q [T, Hv, Dk] float32, k [T, Hv, Dk] float32, v [T, Hv, Dv]
        in the model's dtype)."""
        s, T = self.shape, mixed.shape[0]
        w = self.conv_weight
        # The depthwise convolution as K shifted multiply-adds in float32, rounded once to the
        # weights' dtype, then SiLU there: F.conv1d's result (transformers' causal_conv1d_fn and
        # _update) up to summation order, without oneDNN's depthwise kernel, which took 27 ms for
        # one bf16 decode token of 8K channels.
        window = torch.cat([before.to(w.dtype), mixed.to(w.dtype)]).float()        # [K-1+T, C]
        taps = w.float().t()                                                        # [K, C]
        acc = window[:T] * taps[0]
        for j in range(1, s.conv_width):
            acc.addcmul_(window[j:j + T], taps[j])
        out = F.silu(acc.to(w.dtype)).to(mixed.dtype)                               # [T, C]
        q, k, v = out.split([s.key_heads * s.key_dim, s.key_heads * s.key_dim, s.value_heads * s.value_dim], -1)
        group = s.value_heads // s.key_heads
        q, k = (t.reshape(T, s.key_heads, s.key_dim).repeat_interleave(group, dim=1).float() for t in (q, k))
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * s.key_dim ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v.reshape(T, s.value_heads, s.value_dim)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, Hv] float32 log decay, beta [T, Hv] in the model's dtype) of x [T, dim]."""
        beta = torch.sigmoid(self.linear(x, self.in_proj_b.weight))
        g = -self.A_log.float().exp() * F.softplus(self.linear(x, self.in_proj_a.weight).float() + self.dt_bias)
        return g, beta

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated norm and the out-projection: o [T, Hv, Dv] float32, x [T, dim] -> y [T, dim]."""
        T, dtype = x.shape[0], x.dtype
        z = self.linear(x, self.in_proj_z.weight).reshape(T, self.shape.value_heads, self.shape.value_dim)
        o = o.to(dtype).float()  # transformers hands the rule's output over in the model's dtype
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(dtype)
        gated = (self.norm_weight * normed) * F.silu(z.float())
        y = self.linear(gated.to(dtype).reshape(T, -1), self.out_proj.weight)
        return y if self.tp is None else self.tp.all_reduce(y)

    def step_many(self, x: torch.Tensor, states: list[LinearState]) -> tuple[torch.Tensor, list[LinearState]]:
        """One token each of B sequences: x [B, dim] (row i sequence i's), states[i] its state ->
        (y [B, dim], the B states after). The projections run for all B at once, the recurrence per
        sequence on its own state in place (`step_`); each row's result is its lone step's (`forward`
        of x[i:i+1] on states[i]) up to the matmuls' summation order."""
        mixed = self.project(x)
        g, beta = self.gates(x)
        outs, after = [], []
        for i, st in enumerate(states):
            q, k, v = self.convolve(mixed[i:i + 1], st.conv)
            o, rec = step_(q, k, v, g[i:i + 1], beta[i:i + 1], st.recurrent)
            outs.append(o)
            after.append(LinearState(torch.cat([st.conv, mixed[i:i + 1].to(st.conv.dtype)])[1:], rec))
        return self.finish(torch.cat(outs), x), after

    def forward(self, x: torch.Tensor, state: LinearState | None = None) -> tuple[torch.Tensor, LinearState]:
        s = self.shape
        state = state if state is not None else self.empty_state(x.device, x.dtype)
        if x.shape[0] == 0:
            return x.new_zeros(0, x.shape[1]), state
        mixed = self.project(x)
        q, k, v = self.convolve(mixed, state.conv)
        g, beta = self.gates(x)
        if x.shape[0] == 1:  # decode: the recurrence, as transformers' single-token step
            o, rec = step_(q, k, v, g, beta, state.recurrent)
        else:
            o, rec = chunked_from(q, k, v, g, beta, state.recurrent)
        conv = torch.cat([state.conv, mixed.to(state.conv.dtype)])[-(s.conv_width - 1):]
        return self.finish(o, x), LinearState(conv, rec)
