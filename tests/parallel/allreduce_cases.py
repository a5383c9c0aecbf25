"""Case functions of tests/parallel/test_allreduce.py, run on every rank of a RankPool
(module-level so that spawned ranks can import them)."""

from __future__ import annotations

import os
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SLOT_BYTES = 4096
"""Small slots, so that the larger cases go through in several chunks."""


def rank_input(rank: int, n: int, dtype: str, seed: int) -> torch.Tensor:
    """Rank `rank`'s addend [n] (seeded, so the test process can rebuild every rank's)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(DTYPES[dtype])


def sums_case(rank: int, world: int, cases: list[tuple[int, str, str | None, int]]):
    """For each (n, dtype, algorithm or None for the automatic choice, seed): this rank's summed
    tensor, the bytes the call reported and the algorithm the size chose."""
    from ringctx.parallel.allreduce import ShmAllReduce

    reducer = ShmAllReduce.create(None, timeout_s=60, slot_bytes=SLOT_BYTES)
    assert reducer is not None, "shared memory is unavailable on this test machine"
    out = []
    for n, dtype, algorithm, seed in cases:
        x = rank_input(rank, n, dtype, seed)
        sent = reducer(x, algorithm)
        out.append((x, sent, reducer.algorithm(x.numel() * x.element_size())))
    return out


def strided_case(rank: int, world: int):
    """A non-contiguous tensor [5, 7] (a transpose) summed in place: (it, its sum by gloo)."""
    import torch.distributed as dist

    from ringctx.parallel.allreduce import ShmAllReduce

    reducer = ShmAllReduce.create(None, timeout_s=60, slot_bytes=SLOT_BYTES)
    x = rank_input(rank, 35, "float32", 7).view(7, 5).t()
    expected = x.clone()
    dist.all_reduce(expected)
    reducer(x, "two-shot")
    return x, expected


def chosen_case(rank: int, world: int, env: str | None):
    """The all-reduce make_all_reduce builds with RINGCTX_TP_ALLREDUCE=env (None: unset): its class
    name and force, and its sum of a small tensor."""
    from ringctx.parallel.allreduce import ENV, make_all_reduce

    old = os.environ.pop(ENV, None)
    try:
        if env is not None:
            os.environ[ENV] = env
        try:
            reducer = make_all_reduce(None, torch.device("cpu"), timeout_s=60)
        except ValueError as exc:
            return str(exc)
        x = torch.full((9,), float(rank + 1))
        reducer(x)
        return type(reducer).__name__, getattr(reducer, "force", None), x.tolist()
    finally:
        os.environ.pop(ENV, None)
        if old is not None:
            os.environ[ENV] = old


def stuck_peer_case(rank: int, world: int, timeout_s: float):
    """The last rank never calls; the others must raise within about timeout_s: (error, seconds)."""
    from ringctx.parallel.allreduce import ShmAllReduce

    reducer = ShmAllReduce.create(None, timeout_s=timeout_s)
    if rank == world - 1:
        time.sleep(timeout_s + 1.0)  # stuck: alive, never arriving
        return None
    t0 = time.monotonic()
    try:
        reducer(torch.ones(100))
    except RuntimeError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def dead_peer_case(rank: int, world: int, report: str):
    """The last rank dies (os._exit) after the reducer is built; rank 0 writes its error and the
    seconds it waited into `report` (the pool itself ends with the rank's death)."""
    from ringctx.parallel.allreduce import ShmAllReduce

    reducer = ShmAllReduce.create(None, timeout_s=120)
    if rank == world - 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        reducer(torch.ones(100))
        text = "no error"
    except RuntimeError as exc:
        text = str(exc)
    if rank == 0:
        with open(report, "w") as f:
            f.write(f"{time.monotonic() - t0:.3f}\n{text}")
    return text


def engine_tp_case(rank: int, world: int):
    """The TensorParallel the engine builds for a (1, world) mesh: its all-reduce's class, a sum
    through it and the bytes its CommStats recorded."""
    from ringctx.engine.startup import tensor_parallel
    from ringctx.parallel.comm import CommStats
    from ringctx.parallel.mesh import build_mesh

    tp = tensor_parallel(build_mesh(world, rank, world, "cpu"), "cpu", 60)
    tp.stats = CommStats()
    x = torch.full((3, 5), float(rank + 1))
    tp.all_reduce(x, "tp-test")
    return type(tp.reducer).__name__, x, tp.stats.bytes_sent("tp-test")


def fallback_case(rank: int, world: int, what: str):
    """The last rank cannot use shared memory ("platform": shm_supported says no there; "open": its
    /dev/shm file will not open): the class make_all_reduce builds on each rank, and a sum through it."""
    from unittest import mock

    from ringctx.parallel import allreduce, shm

    last = rank == world - 1
    if what == "platform":
        patch = mock.patch.object(allreduce, "shm_supported", return_value=not last)
    else:
        patch = mock.patch.object(shm.torch, "from_file", side_effect=OSError("no room") if last else torch.from_file)
    with patch:
        reducer = allreduce.make_all_reduce(None, torch.device("cpu"), timeout_s=60)
    x = torch.full((5,), float(rank + 1))
    reducer(x)
    return type(reducer).__name__, x.tolist()
