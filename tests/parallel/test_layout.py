"""ShardLayout: balanced placement, shard/unshard, and block tasks that cover exactly the causal mask."""

import itertools

import pytest
import torch

from ringctx.parallel import ShardLayout


def test_docstring_example_placement():
    layout = ShardLayout.balanced([10], 2)
    assert layout.new_token_index(0).tolist() == [0, 1, 2, 9]
    assert layout.new_token_index(1).tolist() == [3, 4, 5, 6, 7, 8]
    assert layout.positions(1).tolist() == [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_i_holds_chunks_i_and_2n_minus_1_minus_i(world):
    layout = ShardLayout.balanced([8 * world], world)
    for r in range(world):
        c = 4
        expect = list(range(r * c, (r + 1) * c)) + list(range((2 * world - 1 - r) * c, (2 * world - r) * c))
        assert layout.new_token_index(r).tolist() == expect


CASES = [
    ([1], [0], 4), ([7], [0], 3), ([5, 0, 12], [2, 7, 0], 2), ([1, 257, 3, 40], [0, 5, 0, 100], 4),
    ([3], [5], 4), ([16], [3], 1), ([0], [4], 2),
]


@pytest.mark.parametrize("new_lens,cached_lens,world", CASES)
def test_shard_unshard_round_trip_and_counts(new_lens, cached_lens, world):
    layout = ShardLayout.balanced(new_lens, world, cached_lens)
    x = torch.arange(sum(new_lens) * 2).view(-1, 2)
    parts = [layout.shard(x, r) for r in range(world)]
    assert torch.equal(layout.unshard(parts), x)
    c = torch.arange(sum(cached_lens))
    cparts = [layout.shard_cached(c, r) for r in range(world)]
    assert torch.equal(layout.unshard_cached(cparts), c)
    assert sum(layout.num_new(r) for r in range(world)) == sum(new_lens)
    # Balanced: new-token counts differ by at most 2 per sequence between ranks (padding).
    counts = [layout.num_new(r) for r in range(world)]
    assert max(counts) - min(counts) <= 2 * len(new_lens)
    ccounts = [layout.num_cached(r) for r in range(world)]
    assert max(ccounts) - min(ccounts) <= len(cached_lens)


def true_mask(layout, q_rank, kv_rank):
    """Visibility of q_rank's new rows against kv_rank's message rows, from positions and seq ids."""
    q_pos, q_seq = layout.positions(q_rank), layout.seq_ids(q_rank)
    k_pos, k_seq = [], []
    kv_pos, kv_seq = layout.positions(kv_rank).tolist(), layout.seq_ids(kv_rank).tolist()
    new_i = 0
    for s in range(layout.num_seqs):
        k_pos += [-1] * layout.cached_counts[kv_rank][s]  # cached: before every new token
        k_seq += [s] * layout.cached_counts[kv_rank][s]
        while new_i < len(kv_seq) and kv_seq[new_i] == s:
            k_pos.append(kv_pos[new_i]); k_seq.append(s); new_i += 1
    k_pos, k_seq = torch.tensor(k_pos, dtype=torch.long), torch.tensor(k_seq, dtype=torch.long)
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


@pytest.mark.parametrize("new_lens,cached_lens,world", CASES + [([100, 33], [10, 0], 3), ([64], [0], 4)])
def test_block_tasks_cover_the_mask_exactly_once(new_lens, cached_lens, world):
    layout = ShardLayout.balanced(new_lens, world, cached_lens)
    for q_rank, kv_rank in itertools.product(range(world), repeat=2):
        mask = true_mask(layout, q_rank, kv_rank)
        covered = torch.zeros(mask.shape, dtype=torch.int)
        for t in layout.block_tasks(q_rank, kv_rank):
            block = torch.ones(t.q_end - t.q_start, t.k_end - t.k_start, dtype=torch.int)
            if t.causal:
                assert t.q_end - t.q_start == t.k_end - t.k_start
                block = block.tril()
            else:  # a full block must be fully visible: no computed-then-masked work
                assert mask[t.q_start:t.q_end, t.k_start:t.k_end].all()
            covered[t.q_start:t.q_end, t.k_start:t.k_end] += block
        assert torch.equal(covered, mask.int()), f"q_rank={q_rank} kv_rank={kv_rank}"


def test_balanced_ring_skips_half_of_the_blocks():
    # One sequence, 4 ranks: each off-diagonal step needs only half of the (2 x 2) chunk pairs.
    layout = ShardLayout.balanced([800], 4)
    for q_rank, kv_rank in itertools.product(range(4), repeat=2):
        if q_rank != kv_rank:
            rows = sum((t.q_end - t.q_start) * (t.k_end - t.k_start) for t in layout.block_tasks(q_rank, kv_rank))
            assert rows == 2 * 100 * 100


def test_message_sizes():
    layout = ShardLayout.balanced([10, 3], 2, [5, 1])
    assert layout.q_message_rows == max(layout.num_new(0), layout.num_new(1))
    assert layout.kv_message_rows == max(layout.num_new(r) + layout.num_cached(r) for r in range(2))


def test_explicit_cached_counts():
    layout = ShardLayout.balanced([4], 2, cached_counts=[[5], [1]])
    assert layout.cached_lens == (6,) and layout.num_cached(0) == 5
    assert layout.positions(0).tolist() == [6, 9]


@pytest.mark.parametrize("kwargs,match", [
    (dict(new_lens=[4], world_size=0), "world_size"),
    (dict(new_lens=[-1], world_size=2), ">= 0"),
    (dict(new_lens=[], world_size=2), "empty"),
    (dict(new_lens=[4, 4], world_size=2, cached_lens=[1]), "cached_lens has 1"),
    (dict(new_lens=[4], world_size=2, cached_lens=[1], cached_counts=[[1], [0]]), "not both"),
    (dict(new_lens=[4], world_size=2, cached_counts=[[1]]), "cached_counts must be"),
])
def test_bad_layouts_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardLayout.balanced(**kwargs)


def test_shard_rejects_wrong_row_count():
    layout = ShardLayout.balanced([10], 2)
    with pytest.raises(ValueError, match="10 new tokens"):
        layout.shard(torch.zeros(9, 1), 0)
    with pytest.raises(ValueError, match="outside"):
        layout.new_token_index(2)
