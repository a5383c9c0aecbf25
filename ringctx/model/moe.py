"""The mixture-of-experts feed-forward of a decoder layer (Mixtral, Qwen3-MoE, Llama 4, gpt-oss,
Gemma 4 26B-A4B), described by its `Experts` (model/config.py); `Block` builds it in place of the
dense MLP where the layer has one (beside it for Gemma 4: `Experts.beside_dense`).

For T tokens x [T, dim] (E experts, k per token, F each expert's hidden width):

    probs = softmax(x W_router^T) in float32                  [T, E]
    weights, chosen = the k largest probs of each token        [T, k] (ties: the lower expert index)
    weights /= their sum                                       when Experts.renormalize
    the T * k (token, expert) pairs sorted by expert           (stable: token order within an expert)
    for each expert e that got rows:                           one GEMM pair per expert, no loop per token
        y = (act(rows W_gate[e]^T) * (rows W_up[e]^T)) W_down[e]^T   act: the model's mlp_activation
                                                               (silu; Gemma 4: GELU's tanh form)
        out[token] += weight * y                               float32 accumulator, index_add
    out rounded once to the activations' dtype; under TP summed over the ranks (the MLP's all-reduce)

Gemma 4's router ("gemma4") reads rms_norm(x) * router_scale * dim**-0.5 instead of x (its own
input, `router_input`: the residual, where the experts read their pre-norm's output), and
multiplies each kept weight by the chosen expert's per_expert_scale after renormalising.

gpt-oss (`Experts.router` "topk-softmax", `bias`, `router_bias`, `activation` "clamped-swiglu"):
the router's logits get a bias, its k largest logits are kept and softmaxed over those k (`route`);
each expert's gate/up and down products get their biases, and clamped_swiglu replaces silu(gate) * up.

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

Llama 4 (router "sigmoid-topk", `Experts.scales_inputs`) differs in three places, as
transformers 5.25's Llama4TextMoe computes it:

    chosen = the k largest logits of each token               (ties: the lower expert index)
    weights = sigmoid(those logits) in float32, rounded to the model dtype, not renormalised
    y = expert_e(weight * rows)                                the weight scales the expert's INPUT
    out[token] += y                                            float32, then rounded once
    out = shared_expert(x) + out                               in the model dtype (Llama4TextMoe's add_)

the shared expert being a SwiGLU MLP every token goes through (`Experts.shared_ffn_dim`). transformers
runs every expert on every token with a score of 0 for the experts not chosen (sigmoid(-inf)):
an expert of a zero input outputs exactly 0, so skipping them changes no bit.

Tensors: `router.weight` [E, dim] (and `router.bias` [E]; replicated under TP); `w13` [E, 2F, dim],
each expert's gate rows then its up rows (the dense MLP's w13 layout, per expert; gpt-oss's
checkpoints interleave them, weights_hf.py separates them at load); `w2` [E, dim, F]; with biases
`b13` [E, 2F] (gate then up) and `b2` [E, dim]; with a shared expert `shared_w13` [2S, dim] and
`shared_w2` [dim, S] (the dense MLP's layout), and its gate `shared_gate` [1, dim] (Qwen3-Next,
Qwen3.5-MoE: the shared output times sigmoid(x shared_gate^T)). Under tensor parallelism F and S are this rank's
share of every expert's hidden units (model/tensor_parallel.py).

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
from .expert_parallel import NO_EP, ExpertParallel, run_experts
from .tensor_parallel import NO_TP, TensorParallel

Linear = Callable[..., torch.Tensor]
"""linear(x [n, in], weight [out, in], bias [out] or None) -> [n, out] in x's dtype (transformer.linear)."""


def route(logits: torch.Tensor, experts: Experts,
          per_expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for T tokens: logits [T, E] (any float dtype; the router's bias already
    added) -> (weights [T, k] float32, chosen [T, k] long), each token's k best experts in descending
    order of their logits.

    "softmax-topk": softmax over all E experts in float32, as transformers' MixtralTopKRouter /
    Qwen3MoeTopKRouter; with `renormalize` the k weights are divided by their sum in float32.
    "topk-softmax" (GptOssTopKRouter): the k largest logits as they are (in the model dtype), then a
    softmax over those k in float32 (transformers' softmax(dtype=bf16) computes in float32 and rounds
    once; `weights_in_model_dtype` rounds the same way).
    Ties are broken by expert index, the lower first (a stable sort: torch.topk, which transformers
    calls, leaves the order of equal values unspecified, and on the CPU picked experts 1 and 3 of four
    equal ones). Router "gemma4": softmax-topk, then each weight times per_expert_scale [E] (any
    dtype) of its expert, in float32 (Gemma4TextRouter's `top_k_weights * per_expert_scale[top_k_index]`).

    Router "sigmoid-topk" (Llama 4): the k largest logits, ranked as they are (in the logits'
    dtype, ties likewise), and their sigmoid in float32 as the weights (Llama4Router)."""
    k = experts.experts_per_token
    if experts.router in ("topk-softmax", "sigmoid-topk"):
        ranked, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        kept = ranked[:, :k].float()
        return (torch.sigmoid(kept) if experts.router == "sigmoid-topk" else torch.softmax(kept, dim=-1)), order[:, :k]
    probs = torch.softmax(logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, chosen = ranked[:, :k], order[:, :k]
    if experts.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if experts.router == "gemma4":
        weights = weights * per_expert_scale.float()[chosen]
    return weights, chosen


def swiglu_(gate_up: torch.Tensor, ffn: int) -> torch.Tensor:
    """silu(gate) * up in place over the gate half of gate_up [n, 2 ffn] (as FeedForward: ringctx's
    kernel on the CPU, PyTorch's two ops elsewhere); returns that half [n, ffn], a strided view."""
    gate = gate_up[:, :ffn]
    if not (gate_up.device.type == "cpu" and cpu.swiglu_(gate_up, ffn)):
        F.silu(gate, inplace=True).mul_(gate_up[:, ffn:])
    return gate


def geglu_(gate_up: torch.Tensor, ffn: int) -> torch.Tensor:
    """gelu_tanh(gate) * up in place over the gate half of gate_up [n, 2 ffn] (as FeedForward's
    GeGLU: transformers' act_fn(gate) * up in the activation dtype); returns that half [n, ffn]."""
    gate = gate_up[:, :ffn]
    return gate.copy_(F.gelu(gate, approximate="tanh")).mul_(gate_up[:, ffn:])


def clamped_swiglu(gate_up: torch.Tensor, ffn: int, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation over gate_up [n, 2 ffn] (gate half, then up half) -> [n, ffn]:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit). The ops of
    transformers' GptOssExperts._apply_gate in the same order, each in gate_up's dtype (so bf16
    rounds where it does)."""
    gate = gate_up[:, :ffn].clamp(max=limit)
    up = gate_up[:, ffn:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MixtureOfExperts(nn.Module):
    """A layer's mixture of experts (see the module docstring): forward(x [T, dim]) -> [T, dim].

    `linear` is the block's product (transformer.linear, handed in by Block: this module is
    imported by transformer.py, so it does not import it). Router "gemma4" adds router_scale
    [dim] and per_expert_scale [E] (replicated under TP, as the router). Under expert parallelism
    (`ep`, model/expert_parallel.py) w13, w2, b13 and b2 hold this rank's experts only:
    [n_experts / ep.size, ...]."""

    def __init__(self, config: ModelConfig, experts: Experts, linear: Linear, tp: TensorParallel = NO_TP,
                 ep: ExpertParallel = NO_EP):
        super().__init__()
        self.experts, self.linear, self.tp, self.ep = experts, linear, tp, ep
        E, ffn = experts.n_experts, experts.expert_ffn_dim
        held = E // ep.size  # this rank's experts (all of them without EP)
        self.router = nn.Linear(config.dim, E, bias=experts.router_bias)
        self.w13 = nn.Parameter(torch.empty(held, 2 * ffn, config.dim))
        self.w2 = nn.Parameter(torch.empty(held, config.dim, ffn))
        self.activation = swiglu_ if config.mlp_activation == "silu" else geglu_
        self.gemma4 = experts.router == "gemma4"
        if self.gemma4:
            self.router_scale = nn.Parameter(torch.ones(config.dim))
            self.per_expert_scale = nn.Parameter(torch.ones(E))
            self.norm_eps, self.root = config.norm_eps, config.dim ** -0.5
        if experts.shared_ffn_dim:  # the shared expert: the dense MLP's layout, its own width (on every EP rank)
            self.shared_w13 = nn.Parameter(torch.empty(2 * experts.shared_ffn_dim, config.dim))
            self.shared_w2 = nn.Parameter(torch.empty(config.dim, experts.shared_ffn_dim))
        # Qwen3-Next / Qwen3.5-MoE: the shared expert's output times sigmoid(x w) [1, dim], replicated
        # under TP (a per-token scalar times this rank's partial sum is that rank's share of the product)
        self.shared_gate = nn.Parameter(torch.empty(1, config.dim)) if experts.shared_gate else None
        # Experts.bias (gpt-oss): b13 [held, 2F] this rank's gate then up units (split as w13's rows),
        # b2 [held, dim] whole on every TP rank but added by TP rank 0 only (see _down_bias).
        self.b13 = nn.Parameter(torch.empty(held, 2 * ffn)) if experts.bias else None
        self.b2 = nn.Parameter(torch.empty(held, config.dim)) if experts.bias else None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's scores [T, E] (x's dtype) of its input x [T, dim]: x W_router^T; Gemma 4's
        router first RMS-norms x without a weight (float32, rounded once) and scales it, as
        Gemma4TextRouter: (normed * scale) * dim**-0.5 in x's dtype."""
        if self.gemma4:
            normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.norm_eps).to(x.dtype)
            x = normed.mul_(self.router_scale).mul_(self.root)
        return self.linear(x, self.router.weight, self.router.bias)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, dim] -> [T, dim] in x's dtype (summed over the TP ranks); the router reads
        router_input [T, dim] when given (Gemma 4: the residual), else x."""
        experts = self.experts
        logits = self.router_logits(x if router_input is None else router_input)
        weights, chosen = route(logits, experts, self.per_expert_scale if self.gemma4 else None)
        if experts.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        k, E = experts.experts_per_token, experts.n_experts
        # Pairs sorted by expert; the stable sort keeps each expert's pairs in token order.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens, pair_weights = order // k, weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=E).tolist()  # one host sync for all experts
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)  # expert e's pairs: starts[e] .. starts[e + 1] - 1
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, y in self._outputs(x, tokens, pair_weights, counts, starts):  # in expert order, whatever ran them
            rows, w = tokens[starts[e]:starts[e + 1]], pair_weights[starts[e]:starts[e + 1], None]
            if experts.scales_inputs:  # Llama 4: the weight scaled the input; y is added as it is
                out.index_add_(0, rows, y.float())
                continue
            # float32 weights: the product in float32; model-dtype weights: rounded there first. A token
            # picks k different experts, so one call adds to each row at most once: even with atomics
            # (CUDA) every row's sum runs in expert order, the same every time.
            out.index_add_(0, rows, y.float().mul_(w) if w.dtype == torch.float32 else y.mul_(w).float())
        if self.ep.size > 1 and self.ep.same_rows:
            self.ep.all_reduce(out)  # each rank added its own experts' share of the same rows
        out = out.to(x.dtype)
        if experts.shared_ffn_dim:  # transformers' order: the shared output (rounded) plus the routed sum (rounded)
            shared = self.linear(self.activation(self.linear(x, self.shared_w13), experts.shared_ffn_dim),
                                 self.shared_w2)
            if self.shared_gate is not None:  # transformers: sigmoid(x w^T) * shared, in the model dtype
                shared = torch.sigmoid(self.linear(x, self.shared_gate)) * shared
            out = shared.add_(out)
        return self.tp.all_reduce(out)

    def _outputs(self, x: torch.Tensor, tokens: torch.Tensor, pair_weights: torch.Tensor, counts: list[int],
                 starts: list[int]):
        """(e, y [counts[e], dim]) for each expert e that has pairs, in expert order: expert e's output
        of its pairs' rows (scaled first by their weights where the router scales inputs).

        Without EP every expert runs here. Under EP (model/expert_parallel.py), with different rows
        on every rank (a prefill) every pair goes to the rank of its expert and back (`run_experts`,
        the two-shot all-to-all); with the same rows on every rank (a decode step, `ep.same_rows`)
        this rank runs its own experts only, and forward's all-reduce adds the others'. Where
        kernels/selection.py's `grouped_experts` says so (bf16 on the CPU, many pairs an expert),
        experts without biases run as two grouped GEMMs (`_grouped`) instead of a pair per expert."""
        experts, ep = self.experts, self.ep

        def inputs(a: int, b: int) -> torch.Tensor:
            rows = x[tokens[a:b]]  # float32 weights scale in float32, the product rounded once
            return (rows * pair_weights[a:b, None]).to(x.dtype) if experts.scales_inputs else rows

        if ep.size > 1 and not ep.same_rows:
            y = run_experts(inputs(0, len(tokens)), counts, self._expert, ep)
            yield from ((e, y[starts[e]:starts[e + 1]]) for e, n in enumerate(counts) if n)
            return
        if ep.size == 1 and self.b13 is None and experts.activation != "clamped-swiglu" and \
                selection.grouped_experts(x.device.type, x.dtype, len(tokens), experts.n_experts):
            y = self._grouped(inputs(0, len(tokens)), counts)  # every expert in two grouped GEMMs
            yield from ((e, y[starts[e]:starts[e + 1]]) for e, n in enumerate(counts) if n)
            return
        first, last = ep.experts(experts.n_experts)
        for e in range(first, last):
            if counts[e]:  # an expert no token chose: its weights are not read
                yield e, self._expert(e - first, inputs(starts[e], starts[e + 1]))

    def _expert(self, j: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's j-th expert on rows [n, dim] -> [n, dim] in rows' dtype: its gate and up
        products (and biases), joined by the layer's activation, then its down product (and bias)."""
        experts, ffn = self.experts, self.experts.expert_ffn_dim
        gate_up = self.linear(rows, self.w13[j], None if self.b13 is None else self.b13[j])
        if experts.activation == "clamped-swiglu":
            hidden = clamped_swiglu(gate_up, ffn, experts.swiglu_alpha, experts.swiglu_limit)
        else:
            hidden = self.activation(gate_up, ffn)
        return self.linear(hidden, self.w2[j], self._down_bias(j))

    def _down_bias(self, j: int) -> torch.Tensor | None:
        """This rank's j-th expert's down bias [dim] for this rank's product, or None. Under TP each
        rank's product is a partial sum over its hidden units; the bias belongs to the whole sum once,
        so TP rank 0 adds it to its partial, before the weighting and the all-reduce: sum over ranks
        of w * (y_r + [r = 0] b) = w * (y + b), transformers' (y + b) * w, exact up to rounding order."""
        return None if self.b2 is None or self.tp.rank != 0 else self.b2[j]

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert's rows at once: rows [P, dim] sorted by expert, counts [E] per expert -> the
        experts' outputs [P, dim] in rows' dtype, by two torch._grouped_mm calls (on the CPU each
        group's product is the loop's PyTorch GEMM: the same bits where the loop's rows are past
        small_linear's)."""
        ffn = self.experts.expert_ffn_dim
        offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)  # each expert's end
        gate_up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(self.activation(gate_up, ffn).contiguous(), self.w2.transpose(1, 2), offs=offsets)
