"""A cache whose windowed and chunked layers keep only what later tokens see (`drop_unseen`):
decoding over it gives what decoding over the whole cache gives, in every storage format and for
a slice of a sequence; its bytes shrink to the kept rows; and what cannot be served from the kept
rows (a cut below them, a view of an earlier prefix) is refused in words."""

import dataclasses

import pytest
import torch

from ringctx.model import KVCache
from ringctx.model.config import LayerAttention
from ringctx.model.kvcache import forward_with_cache
from ringctx.model.loader import empty_model, init_random
from ringctx.model.presets import get_preset
from tests.helpers import rel_err

KINDS = (LayerAttention(window=7), LayerAttention(), LayerAttention(chunk=16), LayerAttention(window=5, softcap=20.0))


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(get_preset("tiny"), name="tiny-kinds", n_layers=4, layer_attention=KINDS)
    m = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(m, 0)
    return m.eval()


def spans(model):
    return [model.config.attention(i).span for i in range(model.config.n_layers)]


@pytest.mark.parametrize("kv_dtype", ["model", "int8", "fp8"])
def test_decoding_over_dropped_rows_equals_the_whole_cache(model, kv_dtype):
    ids = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1))
    whole = KVCache.for_model(model.config, 80, dtype=torch.float32, kv_dtype=kv_dtype)
    trimmed = KVCache.for_model(model.config, 80, dtype=torch.float32, kv_dtype=kv_dtype)
    with torch.inference_mode():
        forward_with_cache(model, ids[:50], whole)
        forward_with_cache(model, ids[:50], trimmed)
        assert trimmed.drop_unseen(spans(model), 50) > 0
        # window 7 keeps 6 rows, the chunk of 16 keeps 50 - 48 = 2, window 5 keeps 4; full: 50
        assert [trimmed.length - r for r in trimmed.kept] == [6, 50, 2, 4]
        # each layer's buffer: its kept rows plus the cache's room (80 rows of capacity in all)
        assert trimmed.nbytes * 4 * 80 == whole.nbytes * sum(80 - r for r in trimmed.kept)
        for i in range(50, 70):
            a = forward_with_cache(model, ids[i:i + 1], whole)
            b = forward_with_cache(model, ids[i:i + 1], trimmed)
            assert rel_err(b, a) < 1e-6, i
            if i % 7 == 0:  # a ring buffer: drop again every few steps
                trimmed.drop_unseen(spans(model), i + 1, least=4)
    assert trimmed.kept[2] == 64 and trimmed.kept[1] == 0  # the chunk of 64..79 began at 64


def test_a_slice_of_a_sequence_drops_by_position(model):
    """Rows of a decode rank (positions not 0..n-1, in order): the kept rows are its last ones by
    position, and a query sees the same keys as over the whole slice."""
    torch.manual_seed(0)
    cfg = model.config
    positions = torch.tensor([0, 1, 2, 9, 10, 11, 12, 30, 31, 40, 41, 42, 43, 44])
    cache = KVCache.for_model(cfg, 20, dtype=torch.float32, sliced=True)
    for layer in range(cfg.n_layers):
        cache.update(layer, 0, torch.randn(14, cfg.n_kv_heads, cfg.head_dim), torch.randn(14, cfg.n_kv_heads, cfg.head_dim))
    cache.positions[:14] = positions
    cache.length = 14
    whole = cache.grown(21)
    cache.drop_unseen(spans(model), 45)
    assert cache.kept == [9, 0, 9, 10]  # window 7 from 45: positions >= 39; chunk 16: >= 32; window 5: >= 41
    q = torch.randn(1, cfg.n_heads, cfg.head_dim)
    for layer in range(cfg.n_layers):
        softmax = model.layer_softmax(layer)
        a = whole.attend_rows(layer, q, softmax=softmax, q_positions=[45])
        b = cache.attend_rows(layer, q, softmax=softmax, q_positions=[45])
        assert rel_err(b[0], a[0]) < 1e-6 and rel_err(b[1], a[1]) < 1e-6


def test_what_the_kept_rows_cannot_serve_is_refused(model):
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(model.config, 48, dtype=torch.float32)
    with torch.inference_mode():
        forward_with_cache(model, ids, cache)
    cache.drop_unseen(spans(model), 40)
    assert cache.serves_prefix(40) and not cache.serves_prefix(30)
    with pytest.raises(ValueError, match="cannot be cut back"):
        cache.truncate(20)
    with pytest.raises(ValueError, match="layer dropped"):
        cache.view_below(30)
    with pytest.raises(ValueError, match="dropped its rows below"):
        cache.read_rows(0, 0, 40)
    grown = cache.grown(64)  # keeps the same rows, more room
    assert grown.kept == cache.kept and torch.equal(grown.read_rows(0, 34, 40)[0], cache.read_rows(0, 34, 40)[0])


def test_a_slice_out_of_order_is_sorted_as_it_drops(model):
    """A decode rank's rows as a hand-off leaves them (two pieces, the later one first)."""
    torch.manual_seed(1)
    cfg = model.config
    positions = torch.tensor([20, 21, 22, 23, 24, 3, 4, 5, 6])
    cache = KVCache.for_model(cfg, 12, dtype=torch.float32, sliced=True)
    for layer in range(cfg.n_layers):
        cache.update(layer, 0, torch.randn(9, cfg.n_kv_heads, cfg.head_dim), torch.randn(9, cfg.n_kv_heads, cfg.head_dim))
    cache.positions[:9] = positions
    cache.length = 9
    whole = cache.grown(13)
    with torch.inference_mode():  # as a prefill's hand-off drops them
        cache.drop_unseen(spans(model), 25)
    cache.positions[9] = 25  # written outside inference mode later (a question's rows): ordinary tensors
    assert cache.in_position_order() and cache.kept == [4, 0, 4, 5]  # window 7: >= 19; chunk 16: >= 16; window 5: >= 21
    q = torch.randn(1, cfg.n_heads, cfg.head_dim)
    for layer in range(cfg.n_layers):
        softmax = model.layer_softmax(layer)
        a = whole.attend_rows(layer, q, softmax=softmax, q_positions=[25])
        b = cache.attend_rows(layer, q, softmax=softmax, q_positions=[25])
        assert rel_err(b[0], a[0]) < 1e-6, layer


def test_layers_with_their_own_head_shape_keep_rows_of_that_shape():
    """A model whose full layer has its own head shape (Gemma 4 31B's kind: wider heads, fewer KV
    heads): the cache's buffers, the copies it makes (grown, trimmed, sorted, from tensors) keep
    each layer's shape; decoding over it equals the model's own forward over the whole prompt;
    a question about one layer's shape where layers differ is refused in words."""
    kinds = (LayerAttention(window=7), LayerAttention(head_dim=32, n_kv_heads=1), LayerAttention(chunk=16),
             LayerAttention(window=5, head_dim=8))
    config = dataclasses.replace(get_preset("tiny"), name="tiny-heads", n_layers=4, layer_attention=kinds)
    model = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(model, 0)
    assert config.kv_shapes == [(2, 16), (1, 32), (2, 16), (2, 8)] and not config.uniform_heads
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model.logits(ids)
        for kv_dtype in ("model", "int8"):
            cache = KVCache.for_model(config, 40, dtype=torch.float32, kv_dtype=kv_dtype)
            assert [tuple(k.shape[1:]) for k in cache.k] == config.kv_shapes
            cache.check_model(config)
            forward_with_cache(model, ids[:30], cache)
            cache = cache.grown(64)
            cache.drop_unseen(spans(model), 30)
            assert cache.shapes == config.kv_shapes and cache.trimmed
            for t in range(30, 59):
                forward_with_cache(model, ids[t:t + 1], cache)
            got = forward_with_cache(model, ids[59:60], cache)
            assert rel_err(got, want[-1:]) < (1e-5 if kv_dtype == "model" else 3e-2), kv_dtype
    with pytest.raises(ValueError, match=r"layers differ in \(KV heads, head dim\).*read KVCache.shapes"):
        cache.n_kv_heads
    whole = KVCache.from_tensors([torch.zeros(5, h, d) for h, d in config.kv_shapes],
                                 [torch.zeros(5, h, d) for h, d in config.kv_shapes], max_tokens=9)
    assert whole.shapes == config.kv_shapes and whole.empty_like(3, sliced=True).shapes == config.kv_shapes
    uniform = dataclasses.replace(config, layer_attention=KINDS)
    with pytest.raises(ValueError, match=r"KV cache has \(layers, KV heads, head dim\) = \(4, \[\(2, 16\), \(1, 32\)"):
        whole.check_model(uniform)


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_dropping_in_place_moves_nothing_and_gives_the_pages_back(model, kv_dtype):
    """A prefill's shard drops chunk by chunk in place: each layer's buffers become views of the
    same memory from its first kept row (nothing is copied), the whole pages under the dropped
    rows are released, and decoding over it equals decoding over the whole cache. Received rows
    out of order afterwards (a decode rank's hand-off) sort as they drop."""
    from ringctx.host_memory import release_pages

    ids = torch.randint(3, 256, (2100,), generator=torch.Generator().manual_seed(3))
    whole = KVCache.for_model(model.config, 2200, dtype=torch.float32, kv_dtype=kv_dtype)
    shard = KVCache.for_model(model.config, 2200, dtype=torch.float32, kv_dtype=kv_dtype)
    with torch.inference_mode():
        starts = [t.data_ptr() for t in shard.k]
        for a in range(0, 2048, 512):  # chunks of 512 (8-bit rows: as the whole cache's), dropping after each
            forward_with_cache(model, ids[a:a + 512], whole)
            forward_with_cache(model, ids[a:a + 512], shard)
            shard.drop_unseen(spans(model), a + 512, in_place=True)
        assert [shard.length - r for r in shard.kept] == [6, 2048, 0, 4]
        row = shard.k[0].element_size() * model.config.n_kv_heads * model.config.head_dim
        assert [t.data_ptr() - s for t, s in zip(shard.k, starts)] == [r * row for r in shard.kept]
        assert shard.trimmed and shard.nbytes < whole.nbytes
        for t in range(2048, 2099):
            a = forward_with_cache(model, ids[t:t + 1], whole)
            b = forward_with_cache(model, ids[t:t + 1], shard)
            assert rel_err(b, a) < 1e-6, t
    # whole pages come back; a tensor smaller than a page releases nothing
    pages = torch.ones(1 << 16, dtype=torch.float32)
    assert release_pages(pages) > 0 and release_pages(pages[:10]) == 0


def test_a_shard_dropped_in_place_then_given_rows_out_of_order_sorts_as_it_drops(model):
    """A decode rank's shard: its own rows in position order dropped in place after the chunks,
    then another rank's rows appended (positions between its own, some under the horizon, as
    zeros); the hand-off's drop sorts them: every layer sees what the whole slice shows it."""
    torch.manual_seed(1)
    cfg = model.config
    own, theirs = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]), torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    k, v = (torch.randn(20, cfg.n_kv_heads, cfg.head_dim) for _ in range(2))
    shard = KVCache.for_model(cfg, 24, dtype=torch.float32, sliced=True)
    reference = KVCache.for_model(cfg, 24, dtype=torch.float32, sliced=True)
    for layer in range(cfg.n_layers):
        shard.update(layer, 0, k[own], v[own])
        reference.update(layer, 0, k[torch.cat([own, theirs])], v[torch.cat([own, theirs])])
    shard.positions[:12], shard.length = own, 12
    reference.positions[:20], reference.length = torch.cat([own, theirs]), 20
    shard.drop_unseen(spans(model), 16, in_place=True)  # window 7 from 16: >= 10; chunk 16: >= 16; window 5: >= 12
    assert shard.kept == [6, 0, 8, 8]
    for layer in range(cfg.n_layers):  # the received rows, as sent: those under the sender's horizon zeros
        rows = shard.stored_rows(layer, 12, 20)
        seen = theirs >= cfg.attention(layer).span.first_visible(16)
        rows[0].copy_(k[theirs] * seen.view(-1, 1, 1))
        rows[1].copy_(v[theirs] * seen.view(-1, 1, 1))
    shard.positions[12:20], shard.length = theirs, 20
    shard.drop_unseen(spans(model), 20)
    assert shard.in_position_order() and shard.kept == [14, 0, 16, 16]  # from 20: >= 14, all, >= 16, >= 16
    q = torch.randn(1, cfg.n_heads, cfg.head_dim)
    for layer in range(cfg.n_layers):
        softmax = model.layer_softmax(layer)
        a = reference.attend_rows(layer, q, softmax=softmax, q_positions=[20])
        b = shard.attend_rows(layer, q, softmax=softmax, q_positions=[20])
        assert rel_err(b[0], a[0]) < 1e-6 and rel_err(b[1], a[1]) < 1e-6, layer
