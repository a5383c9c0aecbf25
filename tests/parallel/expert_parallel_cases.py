"""Case functions of tests/parallel/test_expert_parallel.py, run on every rank of a RankPool
(module-level so that spawned ranks can import them)."""

from __future__ import annotations

import torch

DIM = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_rows(rank: int, case: tuple) -> tuple[torch.Tensor, list[int]]:
    """Rank `rank`'s (rows [n, DIM] sorted by expert, per-expert counts) of a dispatch case
    (seed, n_experts, rows of each rank, how the rows pick experts, dtype)."""
    seed, n_experts, rows_of, pick, dtype = case
    n = rows_of[rank]
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if pick == "uniform":
        experts = torch.randint(n_experts, (n,), generator=g)
    elif pick == "first":  # every row to expert 0: one rank gets all, the others none
        experts = torch.zeros(n, dtype=torch.long)
    else:  # "last rank": only the last rank's experts
        experts = torch.randint(n_experts - 1, n_experts, (n,), generator=g)
    experts = experts.sort().values
    rows = torch.randn(n, DIM, generator=g).to(DTYPES[dtype])
    return rows, torch.bincount(experts, minlength=n_experts).tolist()


def expert_fn(e: int):
    """Global expert e as a row-wise map whose bits do not depend on how many rows it gets."""
    return lambda rows: rows * (e + 2) - e


def dispatch_case(rank: int, world: int, cases: list[tuple]):
    """For each case: (this rank's run_experts output, the bytes it recorded by kind)."""
    from ringctx.model.expert_parallel import ExpertParallel, run_experts
    from ringctx.parallel.comm import CommStats

    out = []
    for case in cases:
        rows, counts = rank_rows(rank, case)
        stats = CommStats()
        ep = ExpertParallel(size=world, rank=rank, group=None, stats=stats)
        first, _ = ep.experts(len(counts))
        y = run_experts(rows, counts, lambda j, r: expert_fn(first + j)(r), ep)
        out.append((y, {k: stats.bytes_sent(k) for k in ("ep-counts", "ep-dispatch", "ep-combine")}))
    return out


def moe_case(rank: int, world: int, tokens_of: list[int], dtype: str, same_rows: bool):
    """A Qwen3-MoE-like layer (6 experts, top-2) under EP over the pool: this rank's output for its
    tokens (tokens_of[rank] rows, seeded; with same_rows every rank has rank 0's rows)."""
    from ringctx.model.expert_parallel import ExpertParallel
    return moe_forward(ExpertParallel(size=world, rank=rank, group=None), tokens_of, dtype, same_rows, rank)


def moe_forward(ep, tokens_of: list[int], dtype: str, same_rows: bool, rank: int) -> torch.Tensor:
    """The layer of `moe_case` with `ep`'s share of its experts (ep of size 1: all) on rank `rank`'s rows."""
    import contextlib

    from ringctx.model.config import Experts
    from ringctx.model.moe import MixtureOfExperts
    from ringctx.model.presets import get_preset
    from ringctx.model.transformer import linear

    config = get_preset("tiny")
    experts = Experts(n_experts=6, experts_per_token=2, expert_ffn_dim=16, renormalize=True)
    moe = MixtureOfExperts(config, experts, linear, ep=ep).to(DTYPES[dtype])
    g = torch.Generator().manual_seed(7)
    router = torch.randn(6, config.dim, generator=g)
    w13, w2 = torch.randn(6, 32, config.dim, generator=g) * 0.1, torch.randn(6, config.dim, 16, generator=g) * 0.1
    first, last = ep.experts(6)
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe.w13.copy_(w13[first:last])
        moe.w2.copy_(w2[first:last])
    source = 0 if same_rows else rank
    x = torch.randn(tokens_of[source], config.dim, generator=torch.Generator().manual_seed(source)).to(DTYPES[dtype])
    with torch.no_grad(), (ep.replicated_rows() if same_rows else contextlib.nullcontext()):
        return moe(x)
