"""The mixture-of-experts feed-forward of a decoder layer (Mixtral, Qwen3-MoE), described by its
`Experts` (model/config.py); `Block` builds it in place of the dense MLP where the layer has one.

For T tokens x [T, dim] (E experts, k per token, F each expert's hidden width):

    probs = softmax(x W_router^T) in float32                  [T, E]
    weights, chosen = the k largest probs of each token        [T, k] (ties: the lower expert index)
    weights /= their sum                                       when Experts.renormalize
    the T * k (token, expert) pairs sorted by expert           (stable: token order within an expert)
    for each expert e that got rows:                           one GEMM pair per expert, no loop per token
        y = (silu(rows W_gate[e]^T) * (rows W_up[e]^T)) W_down[e]^T
        out[token] += weight * y                               float32 accumulator, index_add
    out rounded once to the activations' dtype; under TP summed over the ranks (the MLP's all-reduce)

So a decode step (one row) reads the router and its k experts only; on CPUs the fused decode step
computes the same in C (model/decode_step.py, csrc/cpu_decode.c's layer_experts), a batch of rows
reading the union of their experts once. The pairs of one token reach
its accumulator row in the order of their experts whatever else is in the call (the products
themselves take the kernel `linear` picks for the rows an expert got, as every matmul does).

Rounding, as transformers 5.25 computes it by default (`experts_implementation="grouped_mm"`,
integrations/moe.py): the expert's output, in the model dtype, times its weight, summed over the k
experts in float32 and rounded once. Mixtral keeps the weights in float32; Qwen3-MoE rounds them
to the model dtype first (`Experts.weights_in_model_dtype`), so its products are rounded too. In
float32 the two are the same computation; in bf16 they differ in the last bits. (transformers'
"eager" experts instead add each expert's rounded output into a model-dtype sum, and transformers
4.x rounded the weights for Mixtral too: the tests pin 5.25.)

Tensors: `router.weight` [E, dim] (replicated under TP); `w13` [E, 2F, dim], each expert's gate rows
then its up rows (the dense MLP's w13 layout, per expert); `w2` [E, dim, F]. Under tensor
parallelism F is this rank's share of every expert's hidden units (model/tensor_parallel.py).

torch._grouped_mm (torch 2.13 has a CPU kernel) was measured against this loop, this module's
forward either way (one thread, a 2-core Xeon shared with other jobs, so +-30%; ms per call):

    E, k, dim, F          dtype     1 row           64 rows          256-512 rows
    64, 8, 256, 128       float32   2.8 vs 3.3      66 vs 27         119 vs 103
    64, 8, 256, 128       bf16      6.3 vs 5.0      40 vs 26         59 vs 32
    32, 8, 2048, 768      float32   30 vs 23        -                1059 vs 619 (256)
    32, 8, 2048, 768      bf16      16 vs 19        -                285 vs 359 (256)

(loop vs grouped_mm). At a real expert width (Qwen3-30B-A3B's 2048 x 768) the loop is faster in
bf16, the dtype CPU prefills run in, and grouped_mm in float32 (1.3-1.7x); the loop's products go
through ringctx's `linear` (its decode-sized and AMX kernels). On a 2-core Zen 4 with bf16 units
(2026-12-07) it went the other way: the two tied within 0.9-1.3x at one thread in both dtypes, and
on two threads of a loaded machine grouped_mm took 0.46-0.84x the loop's time in bf16 from 512
tokens (fewer parallel ops to wait on). So the choice is kernels/selection.py's rule
`grouped_experts`: bf16 CPU calls of at least GROUPED_EXPERTS_MIN_ROWS pairs per expert run
`_grouped`, everything else (decode steps, float32, GPUs until measured) the loop.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu, selection
from .config import Experts, ModelConfig
from .tensor_parallel import NO_TP, TensorParallel

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""linear(x [n, in], weight [out, in]) -> [n, out] in x's dtype (transformer.linear)."""


def route(logits: torch.Tensor, experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for T tokens: logits [T, E] (any float dtype) -> (weights [T, k] float32,
    chosen [T, k] long), each token's k most probable experts in descending probability.

    Softmax over all E experts in float32, as transformers' MixtralTopKRouter / Qwen3MoeTopKRouter.
    Ties are broken by expert index, the lower first (a stable sort: torch.topk, which transformers
    calls, leaves the order of equal values unspecified, and on the CPU picked experts 1 and 3 of four
    equal ones). With `renormalize` the k weights are divided by their sum in float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, chosen = ranked[:, :experts.experts_per_token], order[:, :experts.experts_per_token]
    if experts.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def swiglu_(gate_up: torch.Tensor, ffn: int) -> torch.Tensor:
    """silu(gate) * up in place over the gate half of gate_up [n, 2 ffn] (as FeedForward: ringctx's
    kernel on the CPU, PyTorch's two ops elsewhere); returns that half [n, ffn], a strided view."""
    gate = gate_up[:, :ffn]
    if not (gate_up.device.type == "cpu" and cpu.swiglu_(gate_up, ffn)):
        F.silu(gate, inplace=True).mul_(gate_up[:, ffn:])
    return gate


class MixtureOfExperts(nn.Module):
    """A layer's mixture of experts (see the module docstring): forward(x [T, dim]) -> [T, dim].

    `linear` is the block's product (transformer.linear, handed in by Block: this module is
    imported by transformer.py, so it does not import it)."""

    def __init__(self, config: ModelConfig, experts: Experts, linear: Linear, tp: TensorParallel = NO_TP):
        super().__init__()
        self.experts, self.linear, self.tp = experts, linear, tp
        E, ffn = experts.n_experts, experts.expert_ffn_dim
        self.router = nn.Linear(config.dim, E, bias=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * ffn, config.dim))
        self.w2 = nn.Parameter(torch.empty(E, config.dim, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim] in x's dtype (summed over the TP ranks)."""
        experts = self.experts
        weights, chosen = route(self.linear(x, self.router.weight), experts)
        if experts.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        k, ffn = experts.experts_per_token, experts.expert_ffn_dim
        # Pairs sorted by expert; the stable sort keeps each expert's pairs in token order.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens, pair_weights = order // k, weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=experts.n_experts).tolist()  # one host sync for all experts
        if selection.grouped_experts(x.device.type, x.dtype, flat.numel(), experts.n_experts):
            return self.tp.all_reduce(self._grouped(x, tokens, pair_weights, counts).to(x.dtype))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue  # an expert no token chose: its weights are not read
            rows, w = tokens[start:start + n], pair_weights[start:start + n, None]
            start += n
            y = self.linear(swiglu_(self.linear(x[rows], self.w13[e]), ffn), self.w2[e])
            # float32 weights: the product in float32; model-dtype weights: rounded there first. A token
            # picks k different experts, so one call adds to each row at most once: even with atomics
            # (CUDA) every row's sum runs in expert order, the same every time.
            out.index_add_(0, rows, y.float().mul_(w) if w.dtype == torch.float32 else y.mul_(w).float())
        return self.tp.all_reduce(out.to(x.dtype))

    def _grouped(self, x: torch.Tensor, tokens: torch.Tensor, pair_weights: torch.Tensor,
                 counts: list[int]) -> torch.Tensor:
        """forward's experts as two torch._grouped_mm calls over all the pairs (sorted by expert:
        tokens [P], pair_weights [P], counts [E] per expert) where kernels/selection.py's
        `grouped_experts` says so: float32 [T, dim], the weighted outputs summed as the loop sums
        them (one index_add_ over the pairs in expert order: on the CPU it adds them in that order,
        so each row's sum runs in its experts' order)."""
        ffn = self.experts.expert_ffn_dim
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)  # each expert's end
        gate_up = torch._grouped_mm(x[tokens], self.w13.transpose(1, 2), offs=offsets)
        y = torch._grouped_mm(swiglu_(gate_up, ffn).contiguous(), self.w2.transpose(1, 2), offs=offsets)
        w = pair_weights[:, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tokens, y.float().mul_(w) if w.dtype == torch.float32 else y.mul_(w).float())
