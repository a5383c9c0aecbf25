"""A tiny random Qwen2 with `dual_chunk_attention_config` (Qwen2.5-1M's Dual Chunk Attention):
ringctx's forward, chunked prefill and decode against a float64 forward written from scratch
with `reference_dual_chunk_attention`, and against transformers' Qwen2 below chunk_len, where
DCA is plain attention. chunk_size 16, local_size 4 (chunk_len 12), original_max_position 24:
prompts of 37 and 70 tokens cross several chunks and switch the length factor on."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ringctx.attention.dual_chunk import DualChunk
from ringctx.attention.reference import reference_dual_chunk_attention
from ringctx.model import load_model
from ringctx.model.config_hf import read_hf_config
from tests.helpers import one_thread_for_module, rel_err
from tests.model.test_model_families import prompt

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)

DCA = {"chunk_size": 16, "local_size": 4, "original_max_position_embeddings": 24}
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             max_position_embeddings=1010, rope_theta=10000.0)


def random_qwen2(seed: int = 0):
    """transformers' Qwen2ForCausalLM, every parameter random (biases and norms too)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05)
    return model


def save_with_dca(hf, directory, dca=DCA):
    """Save `hf` and add dual_chunk_attention_config to its config.json (as the 1M checkpoints have it)."""
    hf.save_pretrained(directory)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["dual_chunk_attention_config"] = dca
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ringctx model with DCA, transformers' plain Qwen2 of the same weights)."""
    directory = tmp_path_factory.mktemp("qwen2-dca")
    hf = random_qwen2()
    save_with_dca(hf, directory)
    return load_model(str(directory), dtype=torch.float32, device="cpu"), hf


def reference_logits(hf, ids: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """float64 logits [T, vocab] of the Qwen2 block computed from hf's weights, each layer's
    attention by `reference_dual_chunk_attention`; factors [T]: each token's length factor
    (its query's and its key's)."""
    sd = {k: v.double() for k, v in hf.state_dict().items()}
    c = hf.config
    H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    inv_freq = torch.tensor([SHAPE["rope_theta"] ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    pos = torch.arange(ids.numel())

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    x = sd["model.embed_tokens.weight"][ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        q = F.linear(h, sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.q_proj.bias"]).view(-1, H, D)
        k = F.linear(h, sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.k_proj.bias"]).view(-1, Hkv, D)
        v = F.linear(h, sd[p + "self_attn.v_proj.weight"], sd[p + "self_attn.v_proj.bias"]).view(-1, Hkv, D)
        out, _ = reference_dual_chunk_attention(q, k, v, pos, pos, inv_freq, DCA["chunk_size"], DCA["local_size"],
                                                q_factors=factors, k_factors=factors)
        x = x + F.linear(out.reshape(-1, H * D), sd[p + "self_attn.o_proj.weight"])
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        mlp = F.silu(F.linear(h, sd[p + "mlp.gate_proj.weight"])) * F.linear(h, sd[p + "mlp.up_proj.weight"])
        x = x + F.linear(mlp, sd[p + "mlp.down_proj.weight"])
    return F.linear(norm(x, sd["model.norm.weight"]), sd["lm_head.weight"])


def prompt_factors(n_prompt: int, n_total: int) -> torch.Tensor:
    """vLLM's length factor per token: the prompt's length for prompt tokens, position + 1 after."""
    dca = DualChunk(DCA["chunk_size"], DCA["local_size"], DCA["original_max_position_embeddings"])
    lengths = torch.tensor([n_prompt] * n_prompt + list(range(n_prompt + 1, n_total + 1)))
    return dca.length_factor(lengths)


def test_config_reads_dual_chunk_attention(pair):
    ours, _ = pair
    assert ours.config.attention_summary() == "2 dual chunk 16/4"
    layer = ours.config.attention(0)
    assert layer.dual_chunk == DualChunk(16, 4, 24) and layer.span.dual_chunk == 12
    assert ours.config.trained_context == 1010


def test_below_chunk_len_equals_transformers_qwen2(pair):
    """11 tokens < chunk_len 12 (and below original_max_position): DCA is plain Qwen2."""
    ours, hf = pair
    ids = prompt(11)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert rel_err(ours.logits(ids), ref) < 1e-5


@pytest.mark.parametrize("n", [5, 37, 70])
def test_forward_matches_float64_reference(pair, n):
    ours, hf = pair
    ids = prompt(n, seed=n)
    ref = reference_logits(hf, ids, prompt_factors(n, n))
    assert rel_err(ours.logits(ids), ref.float()) < 1e-5


def test_chunked_prefill_and_decode_match_float64_reference(pair):
    """A 37-token prompt prefilled in pieces of 10 (each attends to the cache by position), then
    greedy decode: every step's logits equal the reference with vLLM's per-token factors."""
    ours, hf = pair
    ids = prompt(37, seed=5)
    result = ours.generate(ids, max_new_tokens=6, stop_token_ids=[], prefill_chunk=10, keep_logits=True)
    sequence = torch.cat([ids, torch.tensor(result.token_ids[:-1])])
    ref = reference_logits(hf, sequence, prompt_factors(37, sequence.numel()))
    for step, logits in enumerate(result.step_logits):
        assert rel_err(logits, ref[36 + step].float()) < 1e-5, step
        assert result.token_ids[step] == int(ref[36 + step].argmax())


@pytest.mark.parametrize("dca, message", [
    ({"chunk_size": 16, "local_size": 16}, "local_size < chunk_size"),
    ({"chunk_size": 0, "local_size": 4}, "local_size < chunk_size"),
    ({"chunk_size": 16, "local_size": 4, "original_max_position_embeddings": -1}, "original_max_position"),
])
def test_nonsense_dual_chunk_configs_are_refused(dca, message):
    config = {"model_type": "qwen2", **SHAPE, "dual_chunk_attention_config": dca}
    with pytest.raises(ValueError, match=message):
        read_hf_config(config)


def test_dual_chunk_with_rope_scaling_or_another_family_is_refused():
    base = {**SHAPE, "dual_chunk_attention_config": DCA}
    with pytest.raises(ValueError, match="plain RoPE"):
        read_hf_config({"model_type": "qwen2", **base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="qwen2 configs"):
        read_hf_config({"model_type": "llama", **base})


def test_config_round_trips_with_its_dual_chunk(pair):
    from ringctx.model.config import ModelConfig

    config = pair[0].config
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.fingerprint() == config.fingerprint()


def test_past_chunk_len_dca_is_not_plain_attention(pair):
    """The checks above can fail: at 70 tokens DCA's logits differ from plain Qwen2's, and the
    length factor changes them too."""
    ours, hf = pair
    ids = prompt(70, seed=70)
    with torch.no_grad():
        plain = hf(input_ids=ids[None]).logits[0].float()
    assert rel_err(ours.logits(ids), plain) > 1e-3
    unscaled = reference_logits(hf, ids, torch.ones(70, dtype=torch.float64))
    assert rel_err(ours.logits(ids), unscaled.float()) > 1e-4


def test_qwen_1m_presets_run_dual_chunk_within_their_stated_context():
    """The 1M presets are what their checkpoints load as: DCA on every layer; the context guard
    takes 1M tokens (max_position_embeddings, 1,010,000) and refuses past it."""
    from ringctx.model.context import context_problem
    from ringctx.model.presets import get_preset

    for name, layers in (("qwen2.5-7b-instruct-1m", 28), ("qwen2.5-14b-instruct-1m", 48)):
        config = get_preset(name)
        assert config.attention_summary() == f"{layers} dual chunk 262144/8192", name
        assert config.trained_context == 1_010_000
        assert context_problem(config, 1_000_000) is None
        assert context_problem(config, 1_000_000, cached_tokens=10_001) is not None


def test_the_strategy_rule_keeps_dual_chunk_models_on_pass_kv():
    """Where alg5 says pass-Q (a short follow-up on a long cache), a DCA model runs pass-KV and
    the reason says why; the same shapes without DCA take pass-Q."""
    import dataclasses

    from ringctx.model.presets import get_preset
    from ringctx.planning.strategy import choose_strategy

    config = get_preset("qwen2.5-7b-instruct-1m")
    choice = choose_strategy(4000, 500_000, config, 4, "h100-rdma")
    assert choice.strategy == "pass-kv" and "the rule said: alg5: pass-Q" in choice.reason
    plain = dataclasses.replace(config, layer_attention=())
    assert choose_strategy(4000, 500_000, plain, 4, "h100-rdma").strategy == "pass-q"
