"""Expert parallelism's two-shot all-to-all (ringctx.model.expert_parallel.run_experts) on 2 and 3
gloo ranks against a single process: every row comes back through its expert, in its order, with
uneven counts, ranks with no rows and experts no row chose; the bytes each rank records; and a
mixture-of-experts layer under EP (dispatch and same-row modes) against the layer with every expert."""

import pytest
import torch

from ringctx.model.expert_parallel import NO_EP, ExpertParallel, ep_problem
from ringctx.model.presets import get_preset

from .expert_parallel_cases import DIM, dispatch_case, expert_fn, moe_case, moe_forward, rank_rows

PICKS = ["uniform", "first", "last rank"]


def dispatch_cases(world: int) -> list[tuple]:
    """(seed, n_experts, rows of each rank, pick, dtype): uneven rows, an empty rank, all empty."""
    rows = [[5, 0, 9][:world], [1, 17, 3][:world], [0] * world, [40, 2, 0][:world]]
    return [(seed, n_experts, r, pick, dtype)
            for seed, (n_experts, r, pick, dtype) in enumerate(
                (n, r, p, d) for n in (world, 2 * world) for r in rows for p in PICKS for d in ("float32", "bfloat16"))]


def reference(rank: int, case: tuple) -> torch.Tensor:
    """Rank `rank`'s rows each through its expert in one process."""
    rows, counts = rank_rows(rank, case)
    out, at = torch.empty_like(rows), 0
    for e, n in enumerate(counts):
        out[at:at + n] = expert_fn(e)(rows[at:at + n])
        at += n
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_row_comes_back_through_its_expert(rank_pool, world):
    cases = dispatch_cases(world)
    results = rank_pool(world).run(dispatch_case, cases)
    for i, case in enumerate(cases):
        for r in range(world):
            y, sent = results[r][i]
            assert torch.equal(y, reference(r, case)), (case, r)
            # bytes: the rows this rank sent to other ranks' experts, and as many came back from it
            rows, counts = rank_rows(r, case)
            per = case[1] // world
            mine = sum(counts[r * per:(r + 1) * per])
            assert sent["ep-dispatch"] == (rows.shape[0] - mine) * DIM * rows.element_size()
            received = sum(sum(rank_rows(s, case)[1][r * per:(r + 1) * per]) for s in range(world) if s != r)
            assert sent["ep-combine"] == received * DIM * rows.element_size()
            assert sent["ep-counts"] == (world - 1) * per * 8


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_layer_under_ep_equals_the_layer_with_every_expert(rank_pool, world, dtype):
    """Dispatch (each rank its own tokens, one rank none) and same rows (a decode step): EP's output
    within float32 rounding of EP 1's (bfloat16: EP 1's float32 sum rounded once, so within one
    bfloat16 rounding of it)."""
    tokens_of = [13, 0, 6][:world]
    for same_rows in (False, True):
        outs = rank_pool(world).run(moe_case, tokens_of, dtype, same_rows)
        for r in range(world):
            want = moe_forward(NO_EP, tokens_of, dtype, same_rows, r)
            assert outs[r].shape == want.shape
            if dtype == "float32":
                torch.testing.assert_close(outs[r], want, rtol=1e-5, atol=1e-7)
            else:
                bound = 2 ** -8 * want.float().abs() + 1e-6
                assert bool(((outs[r].float() - want.float()).abs() <= bound).all()), (same_rows, r)


def test_bad_ep_is_one_line_naming_what_to_use():
    moe = get_preset("tiny")
    assert ep_problem(moe, 1) is None
    assert "dense model" in ep_problem(moe, 2)
    import dataclasses

    from ringctx.model.config import Experts

    six = dataclasses.replace(moe, layer_experts=(Experts(6, 2, 16),) * moe.n_layers)
    assert ep_problem(six, 3, cp_size=3, decode_rank=0, decode_ranks=3) is None
    assert "does not divide the 6 experts" in ep_problem(six, 4) and "1, 2, 3, 6" in ep_problem(six, 4)
    assert "does not divide the 3 CP ranks" in ep_problem(six, 2, cp_size=3)
    assert "whole EP groups" in ep_problem(six, 2, cp_size=2, decode_rank=0, decode_ranks=1)
    assert "whole EP groups" in ep_problem(six, 2, cp_size=4, decode_rank=1, decode_ranks=2)
    assert "positive integer" in ep_problem(six, 0)
    for problem in (ep_problem(six, 4), ep_problem(moe, 2), ep_problem(six, 2, cp_size=3)):
        assert "\n" not in problem
    assert ExpertParallel(size=3, rank=1).experts(6) == (2, 4)
    assert ExpertParallel(size=3, rank=1).local_expert(6, 3) == 1 and ExpertParallel(size=3, rank=1).local_expert(6, 4) is None


def test_an_ep_rank_loads_only_its_experts(tmp_path):
    """Each EP rank's expert slabs are the same slabs of the whole model's, from transformers' per-expert
    and fused (save_original_format=False) checkpoints and from a preset's random weights; the other
    weights whole. (Loading is local: no process group.)"""
    import dataclasses

    from ringctx.model import load_model
    from ringctx.model.config import Experts
    from ringctx.model.weights import empty_model, init_random
    from tests.model.test_model_moe import random_hf_model

    hf = random_hf_model("qwen3-moe-norm")  # 6 experts on layers 0 and 2
    for fused in (False, True):
        directory = tmp_path / f"fused{fused}"
        hf.save_pretrained(directory, **({"save_original_format": False} if fused else {}))
        whole = load_model(str(directory), dtype="float32", device="cpu")
        for size in (2, 3):
            for rank in range(size):
                ep = ExpertParallel(size=size, rank=rank)
                part = load_model(str(directory), dtype="float32", device="cpu", ep=ep)
                first, last = ep.experts(6)
                for layer in (0, 2):
                    mine, all_of = part.layers[layer].feed_forward, whole.layers[layer].feed_forward
                    assert mine.w13.shape[0] == mine.w2.shape[0] == 6 // size
                    assert torch.equal(mine.w13, all_of.w13[first:last]) and torch.equal(mine.w2, all_of.w2[first:last])
                    assert torch.equal(mine.router.weight, all_of.router.weight)
                assert torch.equal(part.layers[1].feed_forward.w13.weight, whole.layers[1].feed_forward.w13.weight)
    config = dataclasses.replace(get_preset("tiny"), layer_experts=(Experts(4, 2, 16),) * 2)
    whole = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(whole, seed=3)
    ep = ExpertParallel(size=2, rank=1)
    part = empty_model(config, dtype=torch.float32, device="cpu", ep=ep)
    init_random(part, seed=3)
    assert torch.equal(part.layers[0].feed_forward.w13, whole.layers[0].feed_forward.w13[2:4])
    assert torch.equal(part.layers[1].feed_forward.w2, whole.layers[1].feed_forward.w2[2:4])
