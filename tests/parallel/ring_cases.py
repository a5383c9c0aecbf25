"""Case functions run on every rank of a RankPool (module-level so spawned ranks can import them)."""

from __future__ import annotations

import torch

from ringctx.parallel import CommStats, ShardLayout, ring_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_inputs(spec: dict):
    """Full (unsharded) inputs of a case, identical on every rank (seeded), as float32."""
    g = torch.Generator().manual_seed(spec["seed"])
    tn, tc = sum(spec["new_lens"]), sum(spec["cached_lens"])
    hq, hkv, d = spec["hq"], spec["hkv"], spec["d"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    return rnd(tn, hq, d), rnd(tn, hkv, d), rnd(tn, hkv, d), rnd(tc, hkv, d), rnd(tc, hkv, d)


def ring_case(rank: int, world: int, spec: dict):
    """Shard the case's inputs, run ring_attention, return (out, lse, comm events) of this rank."""
    dtype = DTYPES[spec["dtype"]]
    q, k, v, ck, cv = (x.to(dtype) for x in make_inputs(spec))
    layout = ShardLayout.balanced(spec["new_lens"], world, spec["cached_lens"])
    cached = {}
    if layout.num_cached(rank):
        cached = dict(cached_k=layout.shard_cached(ck, rank), cached_v=layout.shard_cached(cv, rank))
    stats = CommStats()
    out, lse = ring_attention(layout.shard(q, rank), layout.shard(k, rank), layout.shard(v, rank), layout,
                              strategy=spec["strategy"], stats=stats, **cached)
    return out, lse, [(e.kind, e.step, e.bytes_sent) for e in stats.events]


def bad_input_case(rank: int, world: int, what: str):
    """Give one rank (or all) a bad input; return the ValueError text each rank raised."""
    spec = dict(new_lens=[10], cached_lens=[4], hq=4, hkv=2, d=16, seed=0)
    q, k, v, ck, cv = make_inputs(spec)
    layout = ShardLayout.balanced(spec["new_lens"], world, spec["cached_lens"])
    args = dict(q=layout.shard(q, rank), k=layout.shard(k, rank), v=layout.shard(v, rank),
                layout=layout, cached_k=layout.shard_cached(ck, rank), cached_v=layout.shard_cached(cv, rank),
                strategy="pass-kv")
    last = rank == world - 1
    if what == "rows" and last:
        args["q"], args["k"], args["v"] = args["q"][1:], args["k"][1:], args["v"][1:]
    elif what == "dtype" and last:
        args["k"] = args["k"].bfloat16()
    elif what == "heads":
        args["q"] = args["q"][:, :3]
    elif what == "strategy" and last:
        args["strategy"] = "pass-q"
    elif what == "unknown-strategy":
        args["strategy"] = "pass-z"
    elif what == "layout" and last:
        args["layout"] = ShardLayout.balanced([11], world, [3])
    elif what == "world":
        args["layout"] = ShardLayout.balanced([10], world + 1, [4])
    elif what == "cache-missing" and last:
        args["cached_k"] = args["cached_v"] = None
    elif what == "head-dim":
        args["k"], args["v"] = args["k"][..., :8], args["v"][..., :8]
    try:
        ring_attention(**args)
    except ValueError as exc:
        return str(exc)
    return None


def shm_exchange_case(rank: int, world: int, steps: int):
    """Exchange `steps` seeded tensors through shared memory and through gloo; return whether every
    step agreed, and whether the shared buffer was available."""
    import torch.distributed as dist

    from ringctx.runtime.shm_exchange import ShmExchange

    shm = ShmExchange.create(37, None, timeout_s=30)
    if shm is None:
        return None
    same = True
    for step in range(steps):
        mine = torch.randn(37, generator=torch.Generator().manual_seed(1000 * step + rank))
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        got = shm.exchange(mine).clone()  # every rank's row, rank order
        same &= bool(torch.equal(got, torch.stack(everyone)))
        if step % 7 == rank:  # one rank late now and then: the others must wait, never read stale rows
            import time
            time.sleep(0.002)
    return same


def span_layout(spec: dict, world: int):
    """The case's layout with each sequence's cached tokens dealt to the ranks in a seeded random
    order (as a chunked prefill leaves them: rows out of position order), and each rank's
    cached-row positions per sequence."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    counts = [[0] * len(spec["new_lens"]) for _ in range(world)]
    positions = [[None] * len(spec["new_lens"]) for _ in range(world)]
    for s, p in enumerate(spec["cached_lens"]):
        order = torch.randperm(p, generator=g)
        cuts = sorted(torch.randint(0, p + 1, (world - 1,), generator=g).tolist())
        bounds = [0, *cuts, p]
        for r in range(world):
            positions[r][s] = order[bounds[r]:bounds[r + 1]]
            counts[r][s] = bounds[r + 1] - bounds[r]
    layout = ShardLayout.balanced(spec["new_lens"], world, cached_counts=counts, cached_positions=positions)
    return layout, positions


def span_ring_case(rank: int, world: int, spec: dict):
    """ring_attention of a windowed / chunked / soft-capped layer: (out, lse, comm events)."""
    from ringctx.attention.spans import LayerSoftmax, Span

    dtype = DTYPES[spec["dtype"]]
    q, k, v, ck, cv = (x.to(dtype) for x in make_inputs(spec))
    layout, positions = span_layout(spec, world)
    starts = [sum(spec["cached_lens"][:s]) for s in range(len(spec["new_lens"]))]
    rows = torch.cat([positions[rank][s] + starts[s] for s in range(len(starts))]) if starts else None
    cached = {}
    if layout.num_cached(rank):
        cached = dict(cached_k=ck[rows], cached_v=cv[rows])
    softmax = LayerSoftmax(scale=spec.get("scale", spec["d"] ** -0.5), softcap=spec.get("softcap", 0.0),
                           span=Span(window=spec.get("window", 0), chunk=spec.get("chunk", 0)))
    stats = CommStats()
    out, lse = ring_attention(layout.shard(q, rank), layout.shard(k, rank), layout.shard(v, rank), layout,
                              strategy=spec["strategy"], stats=stats, softmax=softmax, **cached)
    return out, lse, [(e.kind, e.step, e.bytes_sent) for e in stats.events]
