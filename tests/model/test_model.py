"""ringctx.model on small random models: logits against transformers, KV cache, sampling, errors.

Reference models are transformers' LlamaForCausalLM / Qwen2ForCausalLM with random weights, saved
with `save_pretrained` (safetensors) and loaded by ringctx from that directory, so the safetensors
loader is checked along the way. Everything runs in float32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from ringctx.attention import attention_block
from ringctx.model.config import ModelConfig, RopeScaling
from ringctx.model.config_hf import hf_config_dict
from ringctx.model.presets import get_preset
from ringctx.model import KVCache, forward_with_cache, load_model
from ringctx.model.generate import Sampler, StopStrings
from ringctx.model.weights import empty_model, init_random
from tests.helpers import one_thread_for_module, rel_err

TINY = get_preset("tiny")


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)



def make_hf_model(config: ModelConfig, seed: int = 0):
    """A transformers model of `config` with every parameter random (biases and norms too)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**hf_config_dict(config))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.05 if p.dim() == 1 else 0.02)
    return model


def save_hf(config: ModelConfig, directory, seed: int = 0):
    model = make_hf_model(config, seed)
    model.save_pretrained(directory)
    return model


CASES = {
    "gqa1": dataclasses.replace(TINY, n_kv_heads=4),
    "gqa3": dataclasses.replace(TINY, n_heads=6, n_kv_heads=2, head_dim=16, dim=96),
    "qwen2-bias": dataclasses.replace(TINY, n_heads=6, n_kv_heads=2, head_dim=16, dim=96, qkv_bias=True,
                                      tie_embeddings=True),
    "llama-attention-bias": dataclasses.replace(TINY, qkv_bias=True, attn_out_bias=True),
    "rope-llama3": dataclasses.replace(TINY, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(ringctx model, transformers model) with the same random weights, for each case."""
    config = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf(config, directory)
    ours = load_model(str(directory), dtype=torch.float32, device="cpu")
    return request.param, ours, hf


def test_config_round_trip(pair):
    name, ours, hf = pair
    assert ours.config == dataclasses.replace(CASES[name], name=ours.config.name)
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if name == "qwen2-bias" else "LlamaForCausalLM")


def test_logits_match_transformers(pair):
    name, ours, hf = pair
    ids = torch.randint(0, TINY.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = ours.logits(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert rel_err(got, ref) < 1e-4, name


def test_logits_at_global_positions_match_transformers(pair):
    """RoPE at explicit positions: tokens placed at 1000..1036 (as a later ring chunk would be)."""
    name, ours, hf = pair
    ids = torch.randint(0, TINY.vocab_size, (37,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(1000, 1037)
    with torch.no_grad():
        ref = hf(ids[None], position_ids=positions[None]).logits[0].float()
        got = ours(ids, positions, lambda i, q, k, v: attention_block(q, k, v, causal=True)[0], logits="all")
    assert rel_err(got, ref) < 1e-4, name


def test_rope_scaling_changes_the_result():
    """The rope-llama3 case would pass vacuously if both sides ignored the scaling: they cannot."""
    config = CASES["rope-llama3"]
    plain = dataclasses.replace(config, rope_scaling=None).rope_inv_freq()
    scaled = config.rope_inv_freq()
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8.0)
    models = []
    for cfg in (TINY, config):  # same seed and shapes: same weights, only RoPE differs
        model = empty_model(cfg, dtype=torch.float32, device="cpu")
        init_random(model, seed=0)
        models.append(model)
    assert torch.equal(models[0].layers[0].attention.wqkv.weight, models[1].layers[0].attention.wqkv.weight)
    ids = torch.arange(40)
    assert rel_err(models[1].logits(ids), models[0].logits(ids)) > 1e-3


def test_safetensors_dtype_and_sharded_index(tmp_path):
    config = CASES["gqa3"]
    hf = make_hf_model(config)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours32 = load_model(str(tmp_path), dtype="float32", device="cpu")
    ours16 = load_model(str(tmp_path), dtype="bf16", device="cpu")
    assert ours16.dtype == torch.bfloat16 and ours32.dtype == torch.float32
    ids = torch.arange(40) % config.vocab_size
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(ours32.logits(ids), ref) < 1e-4
    assert rel_err(ours16.logits(ids), ref) < 5e-2  # bf16 weights and activations


# ------------------------------------------------------------------------------------------------
# KV cache and the engine-facing contract


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float32, device="cpu")


def test_cached_prefill_chunks_and_decode_match_full_forward(tiny):
    ids = torch.randint(0, TINY.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    full = tiny.logits(ids)
    cache = KVCache.for_model(tiny.config, 40, dtype=torch.float32)
    with torch.inference_mode():
        a = forward_with_cache(tiny, ids[:20], cache, logits="all")  # prefill from 0
        b = forward_with_cache(tiny, ids[20:27], cache, logits="all")  # a chunk after a cache
        c = [forward_with_cache(tiny, ids[i:i + 1], cache) for i in range(27, 32)]  # decode steps
    got = torch.cat([a, b, *c])
    assert cache.length == 32
    assert rel_err(got, full) < 1e-5


def test_kvcache_from_engine_tensors(tiny):
    """K/V captured by a custom attend (as the prefill engine would) seed a decode cache."""
    ids = torch.randint(0, TINY.vocab_size, (25,), generator=torch.Generator().manual_seed(4))
    seen_k, seen_v = {}, {}

    def attend(layer, q, k, v):
        assert q.shape == (24, TINY.n_heads, TINY.head_dim) and k.shape == v.shape == (24, TINY.n_kv_heads, TINY.head_dim)
        seen_k[layer], seen_v[layer] = k.clone(), v.clone()
        return attention_block(q, k, v, causal=True)[0]

    with torch.inference_mode():
        tiny(ids[:24], torch.arange(24), attend, logits="none")
        cache = KVCache.from_tensors([seen_k[i] for i in range(TINY.n_layers)],
                                     [seen_v[i] for i in range(TINY.n_layers)], max_tokens=30)
        assert cache.length == 24 and cache.max_tokens == 30
        step = forward_with_cache(tiny, ids[24:], cache)
        # without max_tokens the given tensors become the buffers (no copy)
        room_k = [torch.cat([k, torch.zeros(4, *k.shape[1:])]) for k in seen_k.values()]
        room_v = [torch.cat([v, torch.zeros(4, *v.shape[1:])]) for v in seen_v.values()]
        shared = KVCache.from_tensors(room_k, room_v, length=24)
        assert shared.k[0] is room_k[0]
        step2 = forward_with_cache(tiny, ids[24:], shared)
    full = tiny.logits(ids)[-1:]
    assert rel_err(step, full) < 1e-5 and rel_err(step2, full) < 1e-5


def test_forward_logits_modes(tiny):
    ids = torch.arange(10)
    pos = torch.arange(10)
    attend = lambda i, q, k, v: attention_block(q, k, v, causal=True)[0]  # noqa: E731
    with torch.inference_mode():
        full = tiny(ids, pos, attend, logits="all")
        assert full.shape == (10, TINY.vocab_size) and full.dtype == torch.float32
        # (a GEMM over fewer rows may round differently in the last bit)
        assert rel_err(tiny(ids, pos, attend, logits="last"), full[-1:]) < 1e-6
        assert rel_err(tiny(ids, pos, attend, logits=torch.tensor([2, 5])), full[[2, 5]]) < 1e-6
        assert tiny(ids, pos, attend, logits="none") is None
        # layer by layer with the exposed pieces gives the same result
        x, rope = tiny.embed(ids), tiny.rope(pos)
        for i, block in enumerate(tiny.layers):
            x = block(x, rope, attend, i)
        assert rel_err(tiny.head(tiny.norm(x)), full) < 1e-6


def test_random_presets_are_seeded_and_meta_costs_nothing():
    a = load_model("tiny", device="cpu", seed=0)
    b = load_model("tiny", device="cpu", seed=0)
    c = load_model("tiny", device="cpu", seed=1)
    assert a.dtype == torch.bfloat16 and a.tokenizer is None
    assert torch.equal(a.layers[1].attention.wqkv.weight, b.layers[1].attention.wqkv.weight)
    assert not torch.equal(a.layers[1].attention.wqkv.weight, c.layers[1].attention.wqkv.weight)
    big = load_model("llama3-405b", device="meta")
    assert big.config.n_layers == 126 and big.layers[0].attention.wqkv.weight.is_meta
    assert sum(p.numel() for p in big.parameters()) == big.config.n_params


# ------------------------------------------------------------------------------------------------
# Generation on the tiny preset (token ids in, token ids out)


def test_greedy_generation_equals_argmax_loop(tiny):
    prompt = [5, 17, 42, 8]
    result = tiny.generate(prompt, max_new_tokens=12, stop_token_ids=[])
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(tiny.logits(ids)[-1].argmax()))
    assert result.token_ids == ids[4:] and result.finish_reason == "length"
    assert result.prompt_tokens == 4 and len(result.token_times_s) == 11 and result.time_to_first_token_s > 0


def test_chunked_prefill_and_follow_up_turn(tiny):
    prompt = list(range(3, 40))
    whole = tiny.generate(prompt, max_new_tokens=6, stop_token_ids=[])
    chunked = tiny.generate(prompt, max_new_tokens=6, stop_token_ids=[], prefill_chunk=10)
    assert chunked.token_ids == whole.token_ids
    # a follow-up turn on the same cache continues the sequence
    cache = KVCache.for_model(tiny.config, 64, dtype=torch.float32)
    first = tiny.generate(prompt[:20], max_new_tokens=1, stop_token_ids=[], cache=cache)
    assert cache.length == 20 and first.token_ids == tiny.generate(prompt[:20], max_new_tokens=1).token_ids
    second = tiny.generate(prompt[20:], max_new_tokens=6, stop_token_ids=[], cache=cache)
    assert second.token_ids == whole.token_ids and cache.length == len(prompt) + 5


def test_sampling_is_seeded(tiny):
    kw = dict(max_new_tokens=16, stop_token_ids=[], temperature=1.0)
    a = tiny.generate([1, 2, 3], seed=7, **kw).token_ids
    assert a == tiny.generate([1, 2, 3], seed=7, **kw).token_ids
    assert a != tiny.generate([1, 2, 3], seed=8, **kw).token_ids
    greedy = tiny.generate([1, 2, 3], max_new_tokens=16, stop_token_ids=[]).token_ids
    assert tiny.generate([1, 2, 3], seed=9, top_k=1, **kw).token_ids == greedy
    assert tiny.generate([1, 2, 3], seed=9, top_p=1e-6, **kw).token_ids == greedy


def test_sampler_filters():
    logits = torch.tensor([0.0, 5.0, 4.0, -3.0])
    assert Sampler()(logits) == 1
    picks = {Sampler(1.0, top_k=2, seed=s)(logits) for s in range(40)}
    assert picks == {1, 2}
    # top_p 0.8: token 1 holds ~0.73 of the mass, so token 2 is needed and nothing else
    picks = {Sampler(1.0, top_p=0.8, seed=s)(logits) for s in range(40)}
    assert picks == {1, 2}


def test_generation_stops_on_eos_id(tiny):
    greedy = tiny.generate([3, 1, 4], max_new_tokens=10, stop_token_ids=[]).token_ids
    stopped = tiny.generate([3, 1, 4], max_new_tokens=10, stop_token_ids=[greedy[3]])
    assert stopped.finish_reason == "eos" and stopped.token_ids == greedy[: greedy.index(greedy[3]) + 1]


def test_stop_strings_hold_back_partial_matches():
    stops = StopStrings(["</end>", "STOP"])
    out = []
    for piece in ["Hello <", "/e", "nd", "> more"]:
        text, hit = stops.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello " and hit
    stops = StopStrings("STOP")
    assert stops.feed("ST") == ("", False)
    assert stops.feed("ay") == ("STay", False)
    assert stops.feed("xS") == ("x", False) and stops.flush() == "S"


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the file or value


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no-such-model.*neither a model preset"):
        load_model("/nonexistent/no-such-model.gguf", device="cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture model_type='gpt2'"):
        load_model(str(tmp_path), device="cpu")
    cfg = hf_config_dict(TINY)
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    cfg.pop("rope_scaling")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        load_model(str(tmp_path), device="cpu")


def test_corrupt_and_truncated_safetensors(tmp_path):
    save_hf(TINY, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: .*(truncated|corrupt)"):
        load_model(str(tmp_path), device="cpu")
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(str(tmp_path), device="cpu")
    os.remove(weights)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weight files"):
        load_model(str(tmp_path), device="cpu")


def test_missing_and_misshaped_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf(TINY, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, path,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 weight tensor\(s\) missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path), device="cpu")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(7,\)"):
        load_model(str(tmp_path), device="cpu")


def test_token_ids_outside_vocabulary(tiny):
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
        tiny.logits([1, 256])
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        tiny.generate([1, -1], max_new_tokens=2)


def test_prompt_longer_than_kv_cache(tiny):
    cache = KVCache.for_model(tiny.config, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"the prompt of 10 tokens does not fit the KV cache: .*max_tokens=8"):
        tiny.generate(list(range(10)), cache=cache, max_new_tokens=4)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        forward_with_cache(tiny, torch.arange(9), cache)


# ------------------------------------------------------------------------------------------------
# Execution details that must not change results: MLP row slices, float32 math for bf16 on CPUs


@pytest.mark.parametrize("head_dim", [8, 16])  # Hq * D == dim (results overwrite the attention output), or not
def test_block_row_slices_equal_one_pass(monkeypatch, head_dim):
    """A block over more than ROWS_PER_SLICE tokens (projections, RoPE, MLP in row slices) gives
    what one pass over all rows gives, and leaves its input alone."""
    from ringctx.model import transformer

    config = dataclasses.replace(TINY, n_layers=1, dim=32, ffn_dim=48, n_heads=4, n_kv_heads=2, head_dim=head_dim)
    net = empty_model(config, dtype=torch.float32, device="cpu")
    init_random(net, seed=3)
    T = 2 * transformer.ROWS_PER_SLICE + 7
    ids = torch.randint(0, config.vocab_size, (T,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T) + 5

    def attend(layer, q, k, v):
        return attention_block(q, k, v, causal=True)[0]

    with torch.inference_mode():
        x, rope = net.embed(ids), net.rope(positions)
        x_before = x.clone()
        sliced = net.layers[0](x, rope, attend, 0)
        assert torch.equal(x, x_before)
        monkeypatch.setattr(transformer, "ROWS_PER_SLICE", 10 * T)
        whole = net.layers[0](x, rope, attend, 0)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)
    assert not torch.equal(sliced[-7:], torch.zeros_like(sliced[-7:]))


@pytest.mark.parametrize("in_float32", [True, False])
@pytest.mark.parametrize("extra_rows", [-1, 3])
def test_half_linear_rounds_like_a_native_bf16_gemm(monkeypatch, in_float32, extra_rows):
    """bf16 x bf16 -> bf16 with float32 accumulation, whichever way it runs: nearly every element
    is the float64 product rounded to bf16 (the rest differ by one bf16 step). Without bf16 units,
    from UPCAST_MIN_ROWS rows the float32 GEMM; below, the decode kernels' product (a row's bits
    those of the row alone)."""
    from ringctx.kernels import build
    from ringctx.kernels.selection import UPCAST_MIN_ROWS
    from ringctx.model import transformer

    monkeypatch.setattr(transformer, "computes_in_float32", lambda x: in_float32)
    torch.manual_seed(0)
    x = torch.randn(UPCAST_MIN_ROWS + extra_rows, 96).bfloat16()
    w = torch.randn(80, 96).bfloat16()
    got = transformer.linear(x, w)
    exact = (x.double() @ w.double().T).bfloat16()
    assert got.dtype == torch.bfloat16
    assert (got == exact).float().mean() > 0.98
    torch.testing.assert_close(got.float(), exact.float(), rtol=2 ** -7, atol=1e-3)
    if in_float32 and extra_rows > 0:
        assert torch.equal(got, torch.nn.functional.linear(x.float(), w.float()).bfloat16())
    if in_float32 and extra_rows < 0 and build.library() is not None:
        assert torch.equal(got, torch.cat([transformer.linear(row, w) for row in x.split(1)]))


@pytest.mark.parametrize("flags, aten, onednn, fast", [
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", None, True),
    ({"avx2", "avx512f", "amx_bf16"}, "AVX512", "AVX512_CORE_AMX", True),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", None, False),       # ATEN_CPU_CAPABILITY=avx2
    ({"avx2", "avx512f", "amx_bf16"}, "AVX512", "avx2", False),      # ONEDNN_MAX_CPU_ISA=avx2
    ({"avx2", "avx512f", "amx_bf16"}, "AVX512", "AVX512_CORE", False),
    ({"avx2", "avx512f"}, "AVX512", None, False),                    # AVX-512 without bf16 units
    ({"avx2", "fma"}, "AVX2", None, False),                          # AVX2-only
])
def test_fast_bf16_needs_the_units_and_pytorch_allowed_to_use_them(monkeypatch, flags, aten, onednn, fast):
    """bf16 matmuls run natively only where the CPU has bf16 units and neither of PyTorch's caps
    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) keeps it off them; otherwise ringctx upcasts."""
    from ringctx.kernels import cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if onednn is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    cpu_features.cpu_has_fast_bf16.cache_clear()
    try:
        assert cpu_features.cpu_has_fast_bf16() is fast
        assert cpu_features.computes_in_float32(torch.zeros(1, dtype=torch.bfloat16)) is not fast
    finally:
        cpu_features.cpu_has_fast_bf16.cache_clear()
