"""Weights and KV caches in one huge-page arena (ringctx.host_memory): placement, independence,
lifetime, the fallback where huge pages are not offered, and unchanged results."""

import dataclasses
import gc

import pytest
import torch

from ringctx import host_memory
from ringctx.model.presets import get_preset
from ringctx.host_memory import host_tensors, huge_pages_enabled, huge_pages_report, place_in_host_arena, thp_mode
from ringctx.model import KVCache
from ringctx.model.weights import empty_model, init_random


def tiny_config(**changes):
    return dataclasses.replace(get_preset("tiny"), **changes)


linux_thp = pytest.mark.skipif(not huge_pages_enabled(), reason=f"huge pages not offered here: {huge_pages_report()['why']}")


def _mapping(address: int, field: str = "VmFlags:") -> tuple[int, int, str] | None:
    """(start, end, the line of `field`) of this process's mapping holding `address`, or None."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    found = None
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            found = (start, end) if start <= address < end else None
        elif found and line.startswith(field):
            return found[0], found[1], line
    return None


@pytest.fixture
def no_huge_pages(monkeypatch, tmp_path):
    """The system as one without transparent huge pages ("never")."""
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "THP_SETTING", setting)


SPECS = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 3, 4), torch.int8), ((1000, 3, 64), torch.float32),
         ((0, 4), torch.float32), ((1,), torch.int64)]


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("huge", [True, False], ids=["arena", "fallback"])
def test_host_tensors_shapes_alignment_and_independence(huge, zero, request):
    if huge and not huge_pages_enabled():
        pytest.skip(huge_pages_report()["why"])
    if not huge:
        request.getfixturevalue("no_huge_pages")
    tensors = host_tensors(SPECS, zero=zero)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(tuple(s), d) for s, d in SPECS]
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    if zero or huge:  # a fresh mapping is zeros whether asked or not
        assert all(bool((t == 0).all()) for t in tensors)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "tensors overlap"
    if huge:
        assert all(start % host_memory.ALIGN == 0 for start, _ in spans)
    for i, t in enumerate(tensors):  # writing one leaves the others as they were
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert bool((t == i + 1).all())


@linux_thp
def test_arena_is_one_mapping_that_asks_for_huge_pages():
    tensors = host_tensors([((4 << 20,), torch.uint8), ((1 << 20,), torch.float32)])
    maps = [_mapping(t.data_ptr()) for t in tensors]
    assert maps[0] is not None and maps[0] == maps[1], "the tensors of one call share one mapping"
    start, end, flags = maps[0]
    assert " hg" in flags, f"the arena's mapping was not advised MADV_HUGEPAGE: {flags}"
    assert end - start >= 8 << 20


@linux_thp
def test_a_small_pages_arena_is_one_mapping_that_stays_in_small_pages():
    """A prefill's cache: one arena still, advised against 2 MiB pages (whose first touch stalled
    the chunks writing it), so even a full write leaves no huge page."""
    a, b = host_tensors([((6 << 20,), torch.uint8), ((1 << 20,), torch.float32)], small_pages=True)
    start, end, flags = _mapping(a.data_ptr())
    assert _mapping(b.data_ptr())[:2] == (start, end), "the tensors of one call share one mapping"
    assert " nh" in flags and " hg" not in flags, f"advised for small pages: {flags}"
    a.fill_(7)
    b.fill_(0.5)
    assert int(_mapping(start, "AnonHugePages:")[2].split()[1]) == 0
    assert (a == 7).all() and (b == 0.5).all()


def test_a_prefills_cache_is_in_small_pages_and_holds_what_it_is_given():
    config = tiny_config()
    cache = KVCache.for_model(config, 5000, dtype=torch.float32, small_pages=True)
    k = torch.randn(5000, config.n_kv_heads, config.head_dim)
    for layer in range(config.n_layers):
        cache.update(layer, 0, k, -k)
    for layer in range(config.n_layers):
        assert torch.equal(cache.k[layer], k) and torch.equal(cache.v[layer], -k)
    if huge_pages_enabled():
        assert " nh" in _mapping(cache.k[0].data_ptr())[2]


@linux_thp
def test_arena_is_unmapped_when_its_last_tensor_dies():
    tensors = host_tensors([((3 << 20,), torch.uint8), ((5,), torch.float32)])
    address = tensors[0].data_ptr()
    survivor = tensors[1]
    del tensors
    gc.collect()
    assert _mapping(address) is not None, "a living view keeps the arena mapped"
    survivor.fill_(1.0)
    del survivor
    gc.collect()
    assert _mapping(address) is None, "the arena outlived every tensor viewing it"


def test_fallback_where_huge_pages_are_not_offered(no_huge_pages, monkeypatch):
    assert thp_mode() == "never" and not huge_pages_enabled()
    assert huge_pages_report()["why"].startswith("off: transparent huge pages are 'never'")
    a, b = host_tensors([((1 << 20,), torch.float32)] * 2)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), "one allocation per tensor"
    monkeypatch.undo()
    monkeypatch.setenv(host_memory.ENV, "0")
    assert not huge_pages_enabled() and huge_pages_report()["why"] == f"off: {host_memory.ENV}=0"


def test_thp_mode_reads_the_selected_word(tmp_path, monkeypatch):
    for text, mode in [("[always] madvise never", "always"), ("always [madvise] never\n", "madvise"),
                       ("garbage", "unavailable")]:
        (tmp_path / "enabled").write_text(text)
        monkeypatch.setattr(host_memory, "THP_SETTING", tmp_path / "enabled")
        assert thp_mode() == mode
    monkeypatch.setattr(host_memory, "THP_SETTING", tmp_path / "missing")
    assert thp_mode() == "unavailable"


def _one_storage(model) -> bool:
    return len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1


@pytest.mark.parametrize("tied", [True, False])
def test_place_in_host_arena_keeps_values_ties_and_results(tied):
    config = tiny_config(tie_embeddings=tied)
    model = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(model, 3)
    ids = torch.arange(11) % config.vocab_size
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    old_storage = model.output.weight.untyped_storage().data_ptr()
    logits = model.logits(ids)
    place_in_host_arena(model)  # a second time: a new arena, the values copied over
    assert model.output.weight.untyped_storage().data_ptr() != old_storage
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert isinstance(p, torch.nn.Parameter) and p.is_contiguous() and not p.requires_grad
    assert torch.equal(model.logits(ids), logits)
    assert _one_storage(model) == huge_pages_enabled()


@pytest.mark.parametrize("tied", [True, False])
def test_place_in_host_arena_gives_meta_parameters_cpu_storage(tied):
    model = empty_model(tiny_config(tie_embeddings=tied), dtype=torch.bfloat16, device="meta")
    shapes = {name: (p.shape, p.dtype) for name, p in model.named_parameters()}
    place_in_host_arena(model)
    assert {name: (p.shape, p.dtype) for name, p in model.named_parameters()} == shapes
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    assert _one_storage(model) == huge_pages_enabled()


def test_cpu_models_are_built_and_loaded_in_one_arena():
    from ringctx.model import load_model

    assert _one_storage(empty_model(tiny_config(), dtype=torch.float32, device="cpu")) == huge_pages_enabled()
    model = load_model("tiny", dtype=torch.float32, device="cpu", seed=1)
    assert _one_storage(model) == huge_pages_enabled()
    if huge_pages_enabled():
        assert " hg" in _mapping(model.tok_embeddings.weight.data_ptr())[2]


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_kv_cache_buffers_share_one_arena(kv_dtype):
    cache = KVCache(3, 50, 2, 16, dtype=torch.float32, kv_dtype=kv_dtype)
    buffers = cache.storage_tensors()
    assert len(buffers) == (12 if kv_dtype == "int8" else 6)
    if huge_pages_enabled():
        assert len({t.untyped_storage().data_ptr() for t in buffers}) == 1
    for i, t in enumerate(buffers):
        t.fill_(i + 1)
    for i, t in enumerate(buffers):
        assert bool((t == i + 1).all()), "cache buffers overlap"


def test_kv_cache_from_tensors_with_room_starts_zero_past_the_given_rows():
    k = [torch.randn(5, 2, 16) for _ in range(2)]
    v = [torch.randn(5, 2, 16) for _ in range(2)]
    cache = KVCache.from_tensors(k, v, length=4, max_tokens=9)
    for dst, src in zip(cache.k + cache.v, k + v):
        assert dst.shape == (9, 2, 16)
        assert torch.equal(dst[:4], src[:4]) and bool((dst[4:] == 0).all())


def test_loaded_model_and_cache_decode_as_before_with_huge_pages_off(monkeypatch):
    """The same greedy tokens and logits from weights and caches in huge pages and in ordinary ones."""
    from ringctx.model import load_model

    def run():
        model = load_model("tiny", dtype=torch.float32, device="cpu", seed=5)
        result = model.generate(torch.arange(40) % model.config.vocab_size, max_new_tokens=6, stop_token_ids=[])
        return result.token_ids, model.logits(torch.arange(9))

    on = run()
    monkeypatch.setenv(host_memory.ENV, "0")
    off = run()
    assert on[0] == off[0] and torch.equal(on[1], off[1])


@linux_thp
def test_a_mapping_larger_than_the_machine_is_a_clear_memory_error():
    with pytest.raises(MemoryError, match=r"cannot map 1048576\.00 GiB of host memory .*ringctx plan"):
        host_tensors([((2 ** 50,), torch.uint8)])
