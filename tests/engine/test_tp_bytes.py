"""Bytes on the wire under tensor parallelism: each TP rank's ring carries its own heads, so ring
messages are 1/T of the CP-only size; the layers' all-reduces move 2(T-1)/T of the activations,
two per layer, plus one for the vocabulary-parallel embedding and one logits all-gather."""

import pytest
import torch

from ringctx.model.presets import get_preset
from ringctx.engine import Engine

TOKENS = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(1)).tolist()
CHUNK = 128


@pytest.fixture(scope="module")
def stats():
    """PrefillStats of the same prefill at (cp, tp) = (2, 1) and (2, 2), with each strategy forced."""
    out = {}
    for tp in (1, 2):
        with Engine("tiny", nproc=2 * tp, tp=tp, dtype="float32") as engine:
            for strategy in ("pass-kv", "pass-q"):
                out[tp, strategy] = engine.prefill(TOKENS, chunk_tokens=CHUNK, strategy=strategy).stats
    return out


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_ring_messages_are_one_tp_th_of_the_cp_only_size(stats, strategy):
    cp_only, with_tp = stats[1, strategy], stats[2, strategy]
    assert all(s.strategy == strategy for s in with_tp.chunks)
    assert cp_only.ring_bytes_per_rank[0] > 0
    assert [2 * b for b in with_tp.ring_bytes_per_rank] == cp_only.ring_bytes_per_rank
    assert cp_only.tp_bytes_per_rank == [0, 0]


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_all_reduces_move_two_t_minus_one_over_t_of_the_activations(stats, strategy):
    config, T = get_preset("tiny"), 2
    s = stats[T, strategy]
    rows = len(TOKENS) // s.cp_size            # every CP rank's new rows over all chunks (balanced)
    activation = rows * config.dim * 4          # float32 [rows, dim]
    ring_all_reduce = 2 * (T - 1) * activation // T
    layers = config.n_layers * 2 * ring_all_reduce  # after wo and after w_down
    embedding = ring_all_reduce                 # vocabulary-parallel lookup, once per chunk row
    logits = (T - 1) * (config.vocab_size // T) * 4  # the last token's logits, on its CP rank only
    extra = [b - layers - embedding for b in s.tp_bytes_per_rank]
    assert sorted(extra) == [0, logits]
