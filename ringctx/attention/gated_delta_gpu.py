"""A piece of the gated delta rule on CUDA through flash-linear-attention's chunked kernel (the
optional `fla-core` package, as flash-attn is for softmax blocks), and which backend a piece takes.

Context parallelism needs three things of a piece of T tokens (attention/gated_delta.py's module
docstring): its transition M [H, Dk, Dk] and contribution C [H, Dk, Dv] (S_end = M S_0 + C), and
its outputs from the true start state S_0 once the exchange has given it. fla's
`chunk_gated_delta_rule` runs the recurrence from an `initial_state` and returns the final state;
one call gives all three, because the value columns of the state never mix:

    S_t = A_t S_{t-1} + beta_t k_t v_t^T       A_t = exp(g_t) (I - beta_t k_t k_t^T)

Column j of S_t depends only on column j of S_0 and of the values v. So run the kernel with the
values widened to [v | 0] (Dv + Dk columns) from the start state [0 | I]:

    first Dv columns:   values v from a zero state        -> end state C, outputs o_t(0)
    last Dk columns:    no values (the recurrence is then S_t = A_t S_{t-1}) from I
                        -> end state A_T ... A_1 I = M, and outputs (P_t I)^T q_t = P_t^T q_t =: r_t
                           (P_t = A_t ... A_1)

and the outputs from any start state follow without another pass over the piece:

    o_t(S_0) = o_t(0) + (P_t S_0)^T q_t = o_t(0) + S_0^T r_t      (a [T, Dk] x [Dk, Dv] matmul a head)

(`FlaPiece.build`; tests/attention/test_gated_delta_gpu.py checks M against the product of the
A_t in float64.) The costly part of the kernel (the intra-block triangular solve, the keys' WY
form) depends on k, g, beta only and is done once; the widened columns cost the state scan and the
output kernel, which are parallel over value columns. ringctx's `ChunkForm` instead builds once and
scans three times (from zero, from I, from S_0).

Which backend: `piece_backend(device)` is "fla" on CUDA when fla imports, else "torch" (ChunkForm,
every device); `build_piece` prepares a piece with it, and either kind answers
`PieceSummary.of(piece)` and `piece.scan(start)` alike, so the two compose with each other.
`chunked_from` is one rank's whole chunk from a known state (no summary needed): fla's plain call.

fla's conventions, as ringctx calls it: layout [B, T, H, D] (B = 1 here); q and k arrive
L2-normalised and q scaled by Dk^-0.5 (attention/gated_delta.py), so use_qk_l2norm_in_kernel is
False and scale = 1.0 (fla multiplies q.k and q.S by `scale`, default Dk^-0.5); g is the log
decay, beta after its sigmoid; the state is [H, Dk, Dv] (state_v_first False) and fla keeps and
returns it in float32 whatever the inputs' dtype. Inputs may be bf16 on the GPU (fla's matmuls
then round to bf16 as its own long sequences do; with float32 inputs its triangular solve still
multiplies in TF32 on Ampere and newer); M, C, the start state and their composition (`compose`)
stay float32.

Tested in float32 under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, inside
`interpreter_shims`), and on a GPU by scripts/gpu_check.sh.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from dataclasses import dataclass

import torch

from .gated_delta import ChunkForm, PieceSummary, TokenPiece, chunked, local_piece

PIECE_BACKENDS = ("auto", "torch", "fla")


@functools.lru_cache(maxsize=1)
def fla_available() -> bool:
    """True when flash-linear-attention's gated delta kernel imports (the optional `fla-core`)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or a Triton build that fails at import
        return False
    return True


@contextlib.contextmanager
def untuned():
    """fla's kernels with the first of their configs, not autotuned: in Triton's interpreter (it has
    no driver to time configs with) and for tests on a GPU (tuning every test shape would take
    minutes; the timings of scripts/bench_gated_delta_gpu.py tune). Undone on exit."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    try:
        yield
    finally:
        Autotuner.prune_configs = prune


@contextlib.contextmanager
def interpreter_shims():
    """What fla-core 0.6's kernels need to run in Triton's interpreter on CPU tensors (tests and
    scripts' --dry-run only; TRITON_INTERPRET=1 set before fla is imported): `untuned`, and a
    `range` for fla's state kernel (fla/ops/common/chunk_delta_h.py), which calls `.to(tl.int64)`
    on its loop index: compiled Triton makes that index a tensor, the interpreter leaves it a
    Python int, so the module's `range` yields interpreter scalars instead. Undone on exit."""
    import fla.ops.common.chunk_delta_h as state_kernel
    from triton.runtime.interpreter import interpreter_semantic

    def scalar_range(*bounds):
        ints = [int(b.handle.data.item()) if hasattr(b, "handle") else int(b) for b in bounds]
        for i in builtins.range(*ints):
            yield interpreter_semantic.to_tensor(i, False)

    state_kernel.range = scalar_range
    try:
        with untuned():
            yield
    finally:
        del state_kernel.range


def piece_backend(device: torch.device, backend: str = "auto") -> str:
    """The backend of a linear-attention piece on `device`: "fla" on CUDA when fla imports, else
    "torch" (`ChunkForm`, every device). "fla" on a CPU tensor runs only under TRITON_INTERPRET=1
    (tests)."""
    if backend not in PIECE_BACKENDS:
        raise ValueError(f"unknown linear-attention backend {backend!r}; choose one of {', '.join(PIECE_BACKENDS)}")
    if backend == "auto":
        return "fla" if torch.device(device).type == "cuda" and fla_available() else "torch"
    if backend == "fla" and not fla_available():
        raise ValueError("linear-attention backend 'fla' requested but flash-linear-attention is not installed "
                         "(pip install 'ringctx[fla]' on a CUDA machine), or use backend 'torch'")
    return backend


def build_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                backend: str = "auto") -> "ChunkForm | TokenPiece | FlaPiece":
    """A piece prepared for context parallelism on q's device (`piece_backend`): either answers
    `PieceSummary.of(piece)` and `piece.scan(start)` alike. Shapes as `ChunkForm.build` (q, k with
    v's H heads; `FlaPiece.build` alone also takes them unrepeated)."""
    if piece_backend(q.device, backend) == "fla":
        return FlaPiece.build(q, k, v, g, beta)
    return local_piece(q, k, v, g, beta)  # ringctx's CPU kernel token by token, or ChunkForm


def chunked_from(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens from `state` [H, Dk, Dv] (None: zeros) when no other piece
    needs this one's summary (one rank's prefill): with the "fla" backend fla's plain call from the
    state (Dv value columns, no M), else attention/gated_delta.chunked. Shapes as `build_piece`;
    returns (o [T, H, Dv] float32, the end state [H, Dk, Dv] float32); `state` is not written."""
    if piece_backend(q.device, backend) != "fla":
        return chunked(q, k, v, g, beta, state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    start = None if state is None else state.float()[None].contiguous()
    o, end = chunk_gated_delta_rule(q[None], k[None], v[None], g.float()[None], beta.float()[None], scale=1.0,
                                    initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=False)
    return o[0].float(), end[0]


@dataclass
class FlaPiece:
    """A piece of T tokens after one call of fla's chunked kernel (module docstring), H heads.

    outputs_from_zero [T, H, Dv] o_t(0); start_read [T, H, Dk] r_t = P_t^T q_t (both in the
    inputs' dtype, as fla returns them); transition [H, Dk, Dk] M and contribution [H, Dk, Dv] C,
    float32."""

    outputs_from_zero: torch.Tensor
    start_read: torch.Tensor
    transition: torch.Tensor
    contribution: torch.Tensor

    @classmethod
    def build(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
              ) -> "FlaPiece":
        """q, k [T, Hk, Dk] (normalised, q scaled: module docstring); v [T, H, Dv]; g, beta [T, H];
        Hk divides H (fla shares a key head among H / Hk value heads, as the layer's repeat does).
        q, k, v in one dtype (float32, or bf16/fp16 on CUDA); g and beta are passed in float32."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        T, Hk, Dk = k.shape
        H, Dv = v.shape[1], v.shape[2]
        if q.shape != k.shape or v.shape[0] != T or g.shape != (T, H) or beta.shape != (T, H) or H % Hk:
            raise ValueError(f"FlaPiece.build: q {tuple(q.shape)}, k {tuple(k.shape)} must be [T, Hk, Dk], "
                             f"v {tuple(v.shape)} [T, H, Dv] with Hk dividing H, g {tuple(g.shape)} and "
                             f"beta {tuple(beta.shape)} [T, H]")
        values = torch.cat([v, v.new_zeros(T, H, Dk)], dim=-1)                        # [v | 0]
        start = torch.zeros(1, H, Dk, Dv + Dk, dtype=torch.float32, device=v.device)
        start[0, :, :, Dv:] = torch.eye(Dk, device=v.device)                          # [0 | I]
        o, end = chunk_gated_delta_rule(q[None], k[None], values[None], g.float()[None], beta.float()[None],
                                        scale=1.0, initial_state=start, output_final_state=True,
                                        use_qk_l2norm_in_kernel=False)
        o, end = o[0], end[0]
        return cls(outputs_from_zero=o[..., :Dv], start_read=o[..., Dv:],
                   transition=end[..., Dv:].contiguous(), contribution=end[..., :Dv].contiguous())

    def summary(self) -> PieceSummary:
        """(M, C): what the piece tells the other pieces (parallel/linear_state.py's exchange)."""
        return PieceSummary(self.transition, self.contribution)

    def scan(self, state: torch.Tensor | None, outputs: bool = True, values: bool = True
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`ChunkForm.scan`'s contract from the kept results: a start state [H, Dk, Dv'] (None:
        zeros of Dv' = Dv); values=False drops the piece's own writes (the part linear in the start
        state alone). Returns (o [T, H, Dv'] float32 or None, the end state [H, Dk, Dv'] float32)."""
        if state is None:
            state = torch.zeros_like(self.contribution)
        state = state.float()
        end = self.transition @ state
        out = None
        if outputs:
            out = torch.einsum("thk,hkv->thv", self.start_read.float(), state)
        if values:
            end = end + self.contribution
            if out is not None:
                out = out + self.outputs_from_zero.float()
        return out, end
