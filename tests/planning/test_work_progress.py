"""The prefill's ETA counts work (the cost model's FLOPs per chunk), not chunks."""

import dataclasses
import statistics
import time

import pytest
import torch

from ringctx.model.presets import get_preset
from ringctx.runtime.prefill import PrefillConfig, cp_prefill
from ringctx.model.weights import empty_model, init_random
from ringctx.planning.work import WorkProgress, chunk_flops, prefill_chunk_flops

from tests.helpers import one_thread_for_module

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)


def test_chunk_work_grows_with_the_cache_it_attends_to():
    cfg = get_preset("smollm2-135m")
    work = prefill_chunk_flops([12288], 4096, cfg)
    assert work == [chunk_flops(4096, p, cfg) for p in (0, 4096, 8192)]
    assert work[0] < work[1] < work[2]
    # two prefills one after another: the second one's chunks attend to the first's tokens too
    assert prefill_chunk_flops([100, 50], 64, cfg, cached_tokens=10) == [
        chunk_flops(64, 10, cfg), chunk_flops(36, 74, cfg), chunk_flops(50, 110, cfg)]


def test_eta_is_the_work_left_at_the_timed_rate():
    progress = WorkProgress([1.0, 2.0, 3.0, 4.0])
    assert progress.eta_s() is None and progress.done == 0
    progress.chunk_done(5.0)  # one chunk: its rate, warm-up and all
    assert progress.eta_s() == pytest.approx(5.0 * 9)
    progress.chunk_done(4.0)  # from the second on, the first chunk is left out: 2 s per unit of work
    assert progress.eta_s() == pytest.approx(2.0 * 7) and progress.done == 3.0
    assert progress.eta_s(since_last_chunk_s=3.0) == pytest.approx(11.0)
    assert progress.eta_s(since_last_chunk_s=100.0) == 0.0
    progress.chunk_done(6.0)
    progress.chunk_done(8.0)
    assert progress.eta_s() == 0.0
    with pytest.raises(ValueError, match="already done"):
        progress.chunk_done(1.0)
    with pytest.raises(ValueError, match="positive work"):
        WorkProgress([])


def test_eta_after_the_second_chunk_is_within_30_percent_of_the_time_left():
    """A model that times itself: 8 chunks whose cost grows as each attends to all before it. The
    chunks are timed in this thread's CPU time (one intra-op thread), so other work on the machine
    does not move the numbers; the median of 3 runs is compared. A chunk-counting ETA would say
    6 x the mean of the first two chunks: about half of the time left."""
    cfg = dataclasses.replace(get_preset("tiny"), name="eta-probe", dim=256, n_heads=4, n_kv_heads=2, head_dim=64,
                              ffn_dim=512, n_layers=2, max_seq_len=8192)
    model = empty_model(cfg, dtype=torch.float32, device="cpu")
    init_random(model, 0)
    chunk, n_chunks = 512, 8
    ids = torch.randint(0, cfg.vocab_size, (chunk * n_chunks,), generator=torch.Generator().manual_seed(0))
    ratios, counting = [], []
    for _ in range(3):
        progress = WorkProgress(prefill_chunk_flops([len(ids)], chunk, cfg))
        marks, etas = [time.thread_time()], []

        def on_chunk(done, total, record):
            marks.append(time.thread_time())
            progress.chunk_done(marks[-1] - marks[-2])
            etas.append(progress.eta_s())

        cp_prefill(model, ids, PrefillConfig(chunk_tokens=chunk), group="local", on_chunk=on_chunk)
        seconds = [b - a for a, b in zip(marks, marks[1:])]
        assert len(seconds) == n_chunks
        ratios.append(etas[1] / sum(seconds[2:]))
        counting.append(statistics.mean(seconds[:2]) * (n_chunks - 2) / sum(seconds[2:]))
    assert 0.7 <= statistics.median(ratios) <= 1.3, (ratios, counting)
