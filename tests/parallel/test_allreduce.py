"""The TP all-reduce through shared memory (ringctx.parallel.allreduce) on 2 and 3 gloo ranks:
every rank ends with the same bits, one-shot and two-shot (and the size's own choice) give the
same bits, equal to the sum in rank order computed here, and to the float64 sum within the
dtype's rounding; odd sizes, chunked messages, a strided tensor; the bytes each reports; a
stuck and a dead peer end with an error naming them, in bounded time."""

import math

import pytest
import torch

from ringctx.parallel import allreduce
from ringctx.parallel.launch import RankPool

from .allreduce_cases import (chosen_case, dead_peer_case, engine_tp_case, fallback_case, rank_input, strided_case,
                              stuck_peer_case, sums_case)

SIZES = [1, 3, 17, 1000, 4099]  # odd sizes; 4099 float32 take 5 chunks of SLOT_BYTES
ALGORITHMS = ["one-shot", "two-shot", None]  # None: the automatic choice by size


def expected_sum(world: int, n: int, dtype: str, seed: int) -> torch.Tensor:
    """The promised result: every rank's addend added in rank order, in float32 (rounded once to
    bfloat16 for a bfloat16 input)."""
    parts = [rank_input(r, n, dtype, seed) for r in range(world)]
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sums_are_the_rank_order_sum_on_every_rank(rank_pool, world, dtype):
    cases = [(n, dtype, algorithm, seed) for seed, (n, algorithm) in
             enumerate((n, a) for n in SIZES for a in ALGORITHMS)]
    results = rank_pool(world).run(sums_case, cases)
    for i, (n, _, algorithm, seed) in enumerate(cases):
        mine = [results[r][i][0] for r in range(world)]
        for r in range(1, world):
            assert torch.equal(mine[r], mine[0]), f"rank {r} differs from rank 0 ({n}, {algorithm})"
        assert torch.equal(mine[0], expected_sum(world, n, dtype, seed)), (n, algorithm)
        reference = sum(rank_input(r, n, dtype, seed).double() for r in range(world))
        magnitude = sum(rank_input(r, n, dtype, seed).double().abs() for r in range(world))
        if dtype == "float32":  # N - 1 float32 additions
            bound = (world - 1) * 2.0 ** -24 * magnitude
        else:  # float32 accumulation, then one rounding to bfloat16 (half an ulp: 2^-8 relative)
            bound = 2.0 ** -8 * reference.abs() + world * 2.0 ** -24 * magnitude
        assert bool(((mine[0].double() - reference).abs() <= bound + 1e-300).all()), (n, algorithm)


@pytest.mark.parametrize("world", [2, 3])
def test_one_shot_and_two_shot_report_the_bytes_they_move(rank_pool, world):
    n = 1000  # float32: one chunk (4000 bytes), segments 64-byte aligned
    cases = [(n, "float32", "one-shot", 0), (n, "float32", "two-shot", 0)]
    results = rank_pool(world).run(sums_case, cases)
    bounds = allreduce.segments(n, world, 4)
    for r in range(world):
        assert results[r][0][1] == (world - 1) * n * 4
        mine = bounds[r + 1] - bounds[r]
        assert results[r][1][1] == (n - mine + (world - 1) * mine) * 4
    if world == 2:  # as a ring's 2(N-1)/N at two ranks, whichever algorithm
        assert {results[r][i][1] for r in range(2) for i in range(2)} == {allreduce.ring_bytes(n * 4, 2)}


def test_the_engine_hands_tensor_parallel_the_shared_memory_all_reduce(rank_pool):
    """engine/startup.py's TensorParallel sums through ShmAllReduce, and its CommStats record what
    one-shot moves: (T-1) x the tensor, not a ring's 2(T-1)/T."""
    for name, x, sent in rank_pool(3).run(engine_tp_case):
        assert name == "ShmAllReduce"
        assert torch.equal(x, torch.full((3, 5), 6.0))
        assert sent == 2 * 15 * 4


def test_the_size_chooses_the_algorithm():
    """Two-shot from the measured size at 3+ ranks (more than 4: 4's), never at 2; a forced one always."""
    reducer = allreduce.ShmAllReduce.__new__(allreduce.ShmAllReduce)
    reducer.force = "auto"
    for world in (3, 4, 8):
        reducer.world = world
        threshold = allreduce.CPU_TWO_SHOT_FROM[min(world, 4)]
        assert reducer.algorithm(threshold - 1) == "one-shot"
        assert reducer.algorithm(threshold) == "two-shot"
    reducer.world = 2
    assert reducer.algorithm(1 << 40) == "one-shot"
    reducer.force = "two-shot"
    assert reducer.algorithm(1) == "two-shot"


def test_a_strided_tensor_is_summed_in_place(rank_pool):
    for x, expected in rank_pool(2).run(strided_case):
        assert not x.is_contiguous()
        assert torch.equal(x, expected)  # two float32 addends: gloo's sum too


@pytest.mark.parametrize("env,expected", [(None, ("ShmAllReduce", "auto")), ("group", ("GroupAllReduce", None)),
                                          ("two-shot", ("ShmAllReduce", "two-shot"))])
def test_the_environment_variable_forces_a_choice(rank_pool, env, expected):
    for got in rank_pool(2).run(chosen_case, env):
        assert got[:2] == expected
        assert got[2] == [3.0] * 9


@pytest.mark.parametrize("what", ["platform", "open"])
def test_every_rank_falls_back_to_the_group_when_one_cannot_share_memory(rank_pool, what):
    for name, x in rank_pool(3).run(fallback_case, what):
        assert name == "GroupAllReduce"
        assert x == [6.0] * 5


def test_an_unknown_choice_is_one_clear_error(rank_pool):
    texts = rank_pool(2).run(chosen_case, "fastest")
    assert texts == [texts[0]] * 2
    assert "RINGCTX_TP_ALLREDUCE='fastest'" in texts[0] and "one-shot" in texts[0]


def test_a_stuck_peer_ends_the_wait_naming_it(rank_pool):
    results = rank_pool(3).run(stuck_peer_case, 1.0)
    assert results[2] is None
    for text, seconds in results[:2]:
        assert "TP all-reduce timed out after 1 s waiting for rank(s) 2" in text
        assert seconds < 10


def test_a_dead_peer_ends_the_wait_naming_it(tmp_path):
    report = tmp_path / "rank0.txt"
    with RankPool(2, backend="gloo", timeout=60) as pool:  # its own pool: the case kills a rank
        with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
            pool.run(dead_peer_case, str(report))
    seconds, text = report.read_text().split("\n", 1)
    assert "TP all-reduce: peer rank 1" in text and "is gone" in text
    assert float(seconds) < 10


def test_segments_cover_the_message_with_aligned_starts():
    for n, world, size in [(1, 2, 4), (17, 3, 2), (4099, 4, 4), (1000, 3, 2)]:
        bounds = allreduce.segments(n, world, size)
        assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(bounds)
        assert all(b * size % 64 == 0 for b in bounds[:-1])
    assert math.isclose(allreduce.ring_bytes(1000, 4), 1500)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_the_c_sum_is_the_torch_sum_bit_for_bit(kernel_variant, count):
    """bf16 buffers summed by the C kernel (each variant this CPU runs) equal PyTorch's float32
    adds in rank order rounded once, at odd sizes and across vector and thread-block edges."""
    from ringctx.kernels import cpu

    for n in (1, 7, 33, 4095, 4097, 70001):
        sources = [rank_input(r, n, "bfloat16", n) * 1000 ** (r % 2) for r in range(count)]
        got, want = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        allreduce.add_with_torch(sources, want)
        if kernel_variant is None:  # no compiler here: the kernel does not apply, PyTorch's adds do
            assert not cpu.sum_buffers(sources, got)
            continue
        assert cpu.sum_buffers(sources, got)
        assert torch.equal(got, want), n
