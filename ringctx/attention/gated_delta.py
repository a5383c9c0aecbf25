"""The gated delta rule (Gated DeltaNet: Qwen3.5 / 3.6, Qwen3-Next linear-attention layers), and how a
sequence split into pieces over ranks computes it exactly.

For each head, a state S [Dk, Dv] (float32) runs over the tokens t = 1..T:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T      g_t <= 0 (log decay), 0 <= beta_t <= 1
    o_t = S_t^T q_t                                                         [Dv]

(transformers' torch_recurrent_gated_delta_rule: decay the state, read k_t from it, write back
beta_t (v_t - S^T k_t) at k_t.) q and k arrive L2-normalised and q scaled by Dk^-0.5 (the layer
does both, as transformers does, before calling these).

The recurrence is linear in the start state. Write A_t = exp(g_t) (I - beta_t k_t k_t^T) [Dk, Dk]
(symmetric); over a piece of tokens from a start state S_0:

    S_end    = M S_0 + C                  M = A_T ... A_1 (the piece's transition), C = S_end from 0
    o_t(S_0) = o_t(0) + (P_t S_0)^T q_t     P_t = A_t ... A_1

so the outputs from any start state are the outputs from zero plus a term linear in S_0. Context
parallelism uses exactly this (`PieceSummary`, `compose`): every rank summarises its pieces of a
chunk as (M, C) from a zero state, one exchange gives every rank every summary, each composes the
true start state of its pieces in sequence order, and the scan runs again from it. What is not
repeated is the costly part of a chunk: the projections, the convolution and the intra-chunk
triangular solve (`ChunkForm`).

The chunked form (`ChunkForm`, after transformers' torch_chunk_gated_delta_rule and the DeltaNet
paper's UT transform): tokens in blocks of `block` (64); within a block the T rank-1 updates are
condensed by one triangular solve into u (the values each token writes, corrected for the block's
earlier writes) and w (the keys' decayed reads of the block's start state); across blocks a scan
of small matmuls carries the state:

    v_new = u_b - w_b S          o_b = (q_b decayed) S + (intra_b) v_new
    S     = exp(G_b) S + (k_b decayed to the block's end)^T v_new

On a CPU with ringctx's kernels the recurrence itself is the faster prefill (csrc/cpu_gated_delta.c
keeps each state column in registers across a piece's tokens: 2.6-4.5x the chunked form in
PyTorch): `TokenPiece`, which `local_piece` and `chunked` pick there; it summarises a piece in one
recurrence of twice the state's width (its docstring).

Every function is computed in float32 (inputs of another dtype are converted); the reference
(`recurrent`) runs in the dtype it is given, float64 for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu as cpu_kernels

BLOCK = 64
"""Tokens per block of the chunked form (transformers' and flash-linear-attention's chunk_size)."""


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token, in q's dtype (the decode step; float64 as the reference).
    Float32 on the CPU runs ringctx's kernel (kernels/cpu.py's gated_delta_) where it is built.

    q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H]; state [H, Dk, Dv] or None (zeros).
    Returns (o [T, H, Dv], the state after the last token [H, Dk, Dv])."""
    T, H, Dk = k.shape
    dtype = q.dtype
    S = (torch.zeros(H, Dk, v.shape[-1], dtype=dtype, device=q.device) if state is None
         else state.to(dtype).clone(memory_format=torch.contiguous_format))  # contiguous: the kernel's layout
    if dtype == torch.float32 and q.device.type == "cpu":
        out = cpu_kernels.gated_delta_(*((x if x.dtype == dtype else x.to(dtype)).unsqueeze(0)
                                         for x in (q, k, v, g, beta)), S.unsqueeze(0))
        if out is not None:
            return out[0], S
    out = torch.empty(T, H, v.shape[-1], dtype=dtype, device=q.device)
    for t in range(T):
        out[t] = _token_(S, q[t].to(dtype), k[t].to(dtype), v[t].to(dtype), g[t].to(dtype), beta[t].to(dtype))
    return out, S


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   states: torch.Tensor) -> torch.Tensor:
    """One decode step of B sequences at once, the states updated in place (float32 CPU tensors run
    ringctx's kernel, anything else PyTorch in the states' dtype).

    q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; states [B, H, Dk, Dv] (contiguous for the kernel).
    Returns o [B, H, Dv] in the states' dtype."""
    dtype = states.dtype
    q, k, v, g, beta = (x if x.dtype == dtype else x.to(dtype) for x in (q, k, v, g, beta))
    out = cpu_kernels.gated_delta_(q, k, v, g, beta, states) if states.device.type == "cpu" else None
    return _token_(states, q, k, v, g, beta) if out is None else out


def _token_(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> torch.Tensor:
    """One token of the rule in PyTorch over any leading dims (...: heads, or sequences and heads):
    S [..., Dk, Dv] updated in place; q, k [..., Dk]; v [..., Dv]; g, beta [...]. Returns o [..., Dv]."""
    S.mul_(g.exp()[..., None, None])
    read = torch.einsum("...k,...kv->...v", k, S)
    delta = (v - read) * beta[..., None]
    S.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("...k,...kv->...v", q, S)


@dataclass
class ChunkForm:
    """A piece of T tokens prepared for the scan: what depends only on the piece's own q, k, v, g,
    beta (its cost is the layer's; a new start state does not change it). Heads first, tokens in
    nb = ceil(T / block) blocks of `block` (the last padded with g = 0, beta = 0, k = v = q = 0: a
    padded token neither decays nor writes the state, and its output is dropped).

    Shapes (float32): u [H, nb, B, Dv] the values written; w [H, nb, B, Dk] the keys' reads of the
    block's start state; q_decayed [H, nb, B, Dk]; k_to_end [H, nb, B, Dk] (each key decayed to its
    block's end); intra [H, nb, B, B] the block's causal, decayed q.k; block_decay [H, nb] exp of a
    block's summed g."""

    T: int
    u: torch.Tensor
    w: torch.Tensor
    q_decayed: torch.Tensor
    k_to_end: torch.Tensor
    intra: torch.Tensor
    block_decay: torch.Tensor

    @classmethod
    def build(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              block: int = BLOCK) -> "ChunkForm":
        """q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H] (any float dtype; computed in float32)."""
        T, H, Dk = k.shape
        pad = (-T) % block
        f32 = [x.float().transpose(0, 1) for x in (q, k, v)]                       # [H, T, D]
        q_, k_, v_ = (torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(H, -1, block, x.shape[-1]) for x in f32)
        g_, beta_ = (torch.nn.functional.pad(x.float().transpose(0, 1), (0, pad)).reshape(H, -1, block)
                     for x in (g, beta))
        cum = g_.cumsum(-1)                                                        # [H, nb, B]
        upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
        # exp(cum_i - cum_j) for j <= i: the decay from token j to token i of a block (masked before exp)
        pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        k_beta = k_ * beta_[..., None]
        system = (k_beta @ k_.transpose(-1, -2)) * pair                            # unit lower-triangular, minus I
        system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0) + torch.eye(block, device=q.device)
        u = torch.linalg.solve_triangular(system, v_ * beta_[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
        return cls(T=T, u=u, w=w, q_decayed=q_ * cum.exp()[..., None],
                   k_to_end=k_ * (cum[..., -1:] - cum).exp()[..., None],
                   intra=(q_ @ k_.transpose(-1, -2)) * pair, block_decay=cum[..., -1].exp())

    def scan(self, state: torch.Tensor | None, outputs: bool = True, values: bool = True
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Carry a start state [H, Dk, Dv'] (None: zeros of Dv' = Dv) through the piece.

        values=False drops the piece's own writes (u): the scan is then the linear part alone, the
        map S_0 -> (outputs' dependence on S_0, P S_0), which with S_0 = I gives the transition M.
        Returns (o [T, H, Dv'] or None when not `outputs`, the end state [H, Dk, Dv'])."""
        H, nb, B, Dv = self.u.shape
        S = torch.zeros(H, self.w.shape[-1], Dv, device=self.u.device) if state is None else state.float().clone()
        out = torch.empty(H, nb, B, S.shape[-1], device=self.u.device) if outputs else None
        for b in range(nb):
            v_new = -(self.w[:, b] @ S)
            if values:
                v_new += self.u[:, b]
            if outputs:
                out[:, b] = self.q_decayed[:, b] @ S + self.intra[:, b] @ v_new
            S = S * self.block_decay[:, b, None, None] + self.k_to_end[:, b].transpose(-1, -2) @ v_new
        if out is not None:
            out = out.reshape(H, nb * B, -1)[:, :self.T].transpose(0, 1)
        return out, S


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None = None, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens for a prefill, float32: (o [T, H, Dv], end state [H, Dk, Dv]).
    Shapes as `recurrent`. On a CPU with ringctx's kernel the recurrence itself (`local_piece`: it
    beat the chunked form 2.6-4.5x there), else the chunked form."""
    return local_piece(q, k, v, g, beta, block).scan(state)


def local_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                block: int = BLOCK) -> "ChunkForm | TokenPiece":
    """A piece prepared on this device without fla (attention/gated_delta_gpu.py picks fla on CUDA):
    `TokenPiece` where ringctx's CPU kernel runs (float32 CPU tensors; measured 2.6-4.5x faster than
    the chunked form per piece on a 2-core EPYC, docs/BENCHMARKS.md), else `ChunkForm`. Either
    answers `.scan` and `PieceSummary.of` alike."""
    if q.device.type == "cpu" and cpu_kernels.available():
        return TokenPiece.build(q, k, v, g, beta)
    return ChunkForm.build(q, k, v, g, beta, block)


@dataclass
class TokenPiece:
    """A piece of T tokens computed by the recurrence token by token (`recurrent`: ringctx's CPU
    kernel, which reads and writes each state column once per call however many tokens). float32
    [T, H, D] inputs as `recurrent`'s.

    For context parallelism (`summary`) one recurrence gives everything, as attention/
    gated_delta_gpu.py's FlaPiece does with fla's kernel: the state's value columns never mix, so
    run the values widened to [v | 0] (Dv + Dk columns) from the start state [0 | I]. The first Dv
    columns end at the contribution C and output o_t(0); the last Dk end at the transition M and
    output r_t = P_t^T q_t; the outputs from the true start S_0 are then o_t(0) + S_0^T r_t (a
    [T, Dk] x [Dk, Dv] product a head) without another pass: a recurrence twice as wide instead
    of three (from zero, from I, from S_0)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    opened: tuple[torch.Tensor, torch.Tensor] | None = None
    """After `summary`: (o_t(0) [T, H, Dv], r_t [T, H, Dk]), what `scan` finishes from."""

    @classmethod
    def build(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
              ) -> "TokenPiece":
        return cls(*(x.float().contiguous() for x in (q, k, v, g, beta)))

    def scan(self, state: torch.Tensor | None, outputs: bool = True, values: bool = True
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """As `ChunkForm.scan`: from `state` [H, Dk, Dv'] (None: zeros of Dv' = Dv); values=False
        runs with zero values (the map S_0 -> P S_0: from I, the transition). After `summary`,
        the outputs from `state` [H, Dk, Dv] come from its results (the end state: M S_0 + C)."""
        T, H, Dk = self.k.shape
        if self.opened is not None and values and state is not None:
            o0, r = self.opened
            transition, contribution = self._summary
            return ((o0 + torch.einsum("thk,hkv->thv", r, state.float())) if outputs else None,
                    transition @ state.float() + contribution)
        v = self.v if values else self.v.new_zeros(T, H, Dk if state is None else state.shape[-1])
        o, end = recurrent(self.q, self.k, v, self.g, self.beta, state)
        return (o if outputs else None), end

    def summary(self) -> "PieceSummary":
        """(transition, contribution) from one recurrence of [v | 0] from [0 | I] (the class
        docstring), keeping o_t(0) and r_t for `scan`."""
        T, H, Dk = self.k.shape
        Dv = self.v.shape[-1]
        widened = torch.cat([self.v, self.v.new_zeros(T, H, Dk)], dim=-1)
        start = torch.cat([self.v.new_zeros(H, Dk, Dv), torch.eye(Dk, device=self.k.device).expand(H, Dk, Dk)], -1)
        o, end = recurrent(self.q, self.k, widened, self.g, self.beta, start)
        self.opened = (o[..., :Dv], o[..., Dv:])
        self._summary = (end[..., Dv:].contiguous(), end[..., :Dv].contiguous())
        return PieceSummary(*self._summary)


@dataclass
class PieceSummary:
    """What a piece of a sequence tells the others (one exchange per linear layer and chunk): the
    end state S_end = transition S_0 + contribution for any start state S_0.

    transition [H, Dk, Dk] and contribution [H, Dk, Dv], float32 (bf16 drifts over many pieces)."""

    transition: torch.Tensor
    contribution: torch.Tensor

    @classmethod
    def of(cls, form: ChunkForm) -> "PieceSummary":
        """The summary of a prepared piece: two scans without outputs, from zero and from I (a piece
        from another backend, attention/gated_delta_gpu.FlaPiece, has it already)."""
        if not isinstance(form, ChunkForm):
            return form.summary()
        H, _, _, Dv = form.u.shape
        Dk = form.w.shape[-1]
        _, contribution = form.scan(None, outputs=False)
        eye = torch.eye(Dk, device=form.u.device).expand(H, Dk, Dk)
        _, transition = form.scan(eye, outputs=False, values=False)
        return cls(transition, contribution)

    def apply(self, state: torch.Tensor) -> torch.Tensor:
        """The piece's end state from the start state [H, Dk, Dv]."""
        return self.transition @ state.float() + self.contribution


def compose(summaries: list[PieceSummary], state: torch.Tensor) -> list[torch.Tensor]:
    """The start state of each piece, in sequence order, from the state before the first
    [H, Dk, Dv]; then the end state after the last (len(summaries) + 1 states)."""
    states = [state.float()]
    for summary in summaries:
        states.append(summary.apply(states[-1]))
    return states
