"""Tensor parallelism x context parallelism on tiny random models: at (cp, tp) = (1, 2), (2, 2),
(1, 4) (more TP ranks than KV heads: replicated KV heads), (4, 1), GQA groups 1 and 3, q/k/v and
o biases, tied embeddings. Logits, the KV cache that reaches the decode ranks and greedy answers
equal one process's (float32, 1e-5 relative); documents saved under one TP size load under
another; ring and all-reduce bytes follow their formulas; bad meshes are refused before any rank
starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringctx.model.presets import get_preset
from ringctx.engine import Engine
from ringctx.model.tensor_parallel import TensorParallel, tp_problem
from ringctx.parallel.mesh import mesh_problem
from tests.helpers import rel_err
from tests.model.test_model import CASES, save_hf

DOC = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(0)).tolist()
QUESTION = [5, 17, 99, 3, 42, 7, 8]
GREEDY = dict(max_new_tokens=9, stop_token_ids=[], keep_logits=True)

# (model, cp, tp): "tiny" has 4 query and 2 KV heads; CASES come from tests/model/test_model.py.
MESHES = [
    ("tiny", 1, 2), ("tiny", 2, 2), ("tiny", 1, 4), ("tiny", 4, 1),
    ("gqa1", 1, 4),                     # 4 query = 4 KV heads: one of each per TP rank
    ("gqa3", 2, 2),                     # 6 query / 2 KV heads: 3 query heads and their KV head per rank
    ("qwen2-bias", 1, 2),               # q/k/v bias, tied embedding and head
    ("llama-attention-bias", 1, 4),     # o bias added once after the all-reduce; replicated KV heads
]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    paths = {"tiny": "tiny"}
    for name in {m for m, _, _ in MESHES} - {"tiny"}:
        directory = tmp_path_factory.mktemp(name)
        save_hf(CASES[name], directory)
        paths[name] = str(directory)
    return paths


def run(engine):
    """Prefill the document, answer greedily, gather the cache: what every mesh must agree on."""
    result = engine.prefill(DOC, chunk_tokens=64, as_document=True)
    generation = engine.generate(result.document, QUESTION, **GREEDY)
    "".join(generation)
    return {"logits": result.logits, "answer": generation.result, "cache": engine.whole_cache(result.document),
            "document": result.document, "stats": result.stats}


_references: dict[str, dict] = {}


def reference(path):
    if path not in _references:
        _references[path] = run(Engine(path, dtype="float32"))
    return _references[path]


@pytest.fixture(scope="module", params=MESHES, ids=lambda m: f"{m[0]}-cp{m[1]}-tp{m[2]}")
def mesh_run(request, model_paths):
    name, cp, tp = request.param
    path = model_paths[name]
    with Engine(path, nproc=cp * tp, tp=tp, dtype="float32") as engine:
        assert (engine.cp_size, engine.tp_size, engine.world_size) == (cp, tp, cp * tp)
        yield engine, run(engine), reference(path)


def test_logits_and_greedy_answer_equal_one_process(mesh_run):
    engine, got, want = mesh_run
    assert rel_err(got["logits"], want["logits"]) < 1e-5
    assert got["answer"].token_ids == want["answer"].token_ids
    for a, b in zip(got["answer"].step_logits, want["answer"].step_logits):
        assert rel_err(a, b) < 1e-5


def test_cache_on_the_decode_ranks_equals_one_process(mesh_run):
    engine, got, want = mesh_run
    cache, ref = got["cache"], want["cache"]
    n = len(DOC)
    assert cache.length == n and cache.n_kv_heads == ref.n_kv_heads
    for layer in range(ref.n_layers):
        assert rel_err(cache.k[layer][:n], ref.k[layer][:n]) < 1e-5
        assert rel_err(cache.v[layer][:n], ref.v[layer][:n]) < 1e-5


def test_documents_move_between_tp_sizes(mesh_run, tmp_path):
    """Saved under this mesh (every KV head in the file), loaded by one process, and back."""
    engine, got, want = mesh_run
    path = str(tmp_path / "doc.kv")
    engine.save_document(got["document"], path)
    # every TP rank wrote its own KV heads (one file for replicated heads): parts cover the heads once
    from ringctx.runtime.documents import read_manifest, slice_parts

    hkv = engine.model.full_config.n_kv_heads
    for entry in read_manifest(path)["slices"]:
        heads = [tuple(part["heads"]) for part in slice_parts(entry, engine.model.full_config)]
        assert heads == [(h, h + hkv // len(heads)) for h in range(0, hkv, hkv // len(heads))]
        assert len(heads) == (1 if engine.tp_size == 1 else min(engine.tp_size, hkv))
    single = Engine(engine.model_name, dtype="float32")
    loaded = single.load_document(path)
    generation = single.generate(loaded, QUESTION, **GREEDY)
    "".join(generation)
    assert generation.result.token_ids == want["answer"].token_ids
    back = str(tmp_path / "back.kv")
    single.save_document(loaded, back)
    again = engine.load_document(back)
    generation = engine.generate(again, QUESTION, **GREEDY)
    "".join(generation)
    assert generation.result.token_ids == want["answer"].token_ids


def test_each_rank_holds_only_its_share_of_the_weights():
    """Parameter counts of a TP shard: the heads, MLP and vocabulary split, the norms whole."""
    for name, sizes in (("smollm2-135m", (3,)), ("llama3-8b", (2, 4, 8))):
        check_shares(get_preset(name), sizes)


def check_shares(config, sizes):
    from ringctx.model.weights import empty_model

    whole = sum(p.numel() for p in empty_model(config, dtype=torch.float32, device="meta").parameters())
    norms = (2 * config.n_layers + 1) * config.dim
    for tp in sizes:
        counts = [sum(p.numel() for p in empty_model(config, dtype=torch.float32, device="meta",
                                                     tp=TensorParallel(tp, r)).parameters()) for r in range(tp)]
        assert sum(counts) == whole + (tp - 1) * norms  # everything split once, the norms on every rank
        assert max(counts) - min(counts) <= config.dim  # even shares (vocabulary rounding aside)


def test_shard_slices_follow_megatron_and_replicate_kv_heads():
    config = dataclasses.replace(get_preset("tiny"), n_heads=8, n_kv_heads=2, head_dim=8)
    # T = 4 > Hkv = 2: ranks 0, 1 share KV head 0, ranks 2, 3 KV head 1
    assert [TensorParallel(4, r).kv_heads(config) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TensorParallel(4, r).q_heads(config) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [TensorParallel(2, r).kv_heads(config) for r in range(2)] == [(0, 1), (1, 2)]
    shard = TensorParallel(4, 3).shard_config(config)
    assert (shard.n_heads, shard.n_kv_heads, shard.head_dim, shard.ffn_dim) == (2, 1, 8, config.ffn_dim // 4)


@pytest.mark.parametrize("world,tp,per_host,needle", [
    (3, 2, 3, "does not divide the 3 ranks"),
    (8, 4, 2, "larger than the 2 ranks of a host"),
    (6, 2, 3, "would span two hosts"),
])
def test_bad_meshes_are_named(world, tp, per_host, needle):
    assert needle in mesh_problem(world, tp, per_host)


def test_bad_tp_for_the_heads_is_named():
    tiny = get_preset("tiny")
    assert "does not divide the 4 query heads" in tp_problem(tiny, 3)
    assert "neither divides nor is a multiple of the 3 KV heads" in \
        tp_problem(dataclasses.replace(tiny, n_heads=6, n_kv_heads=3, dim=96, head_dim=16), 2)
    assert tp_problem(get_preset("smollm2-135m"), 3) is None


@pytest.mark.parametrize("nproc,tp,needle", [(3, 3, "does not divide the 4 query heads"),
                                             (3, 2, "does not divide the 3 ranks")])
def test_bad_tp_is_refused_before_any_rank_starts(nproc, tp, needle):
    with pytest.raises(ValueError, match=needle):
        Engine("tiny", nproc=nproc, tp=tp)


def test_torchrun_tp_across_hosts_is_refused_before_joining(monkeypatch):
    """WORLD_SIZE 4 with 2 ranks per host: TP 4 would span hosts. Refused before the group is joined
    (no MASTER_ADDR is set, so joining would fail differently)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="larger than the 2 ranks of a host"):
        Engine("tiny", tp=4)
