"""Presets: the shapes of real models by name. With random weights they serve benchmarks and
planning without any download.

    >>> cfg = get_preset("llama3-405b")
    >>> cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    (128, 8, 128)
"""

from __future__ import annotations

from ..attention.dual_chunk import DualChunk
from .config import Experts, LayerAttention, ModelConfig, RopeScaling
from .config_hf import read_hf_config


QWEN_1M_DCA = DualChunk(chunk_size=262144, local_size=8192, original_max_position=262144)
"""Qwen2.5-7B/14B-Instruct-1M's dual_chunk_attention_config (dense part)."""

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
        rope_theta=10000.0, max_seq_len=4096, bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
        rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_seq_len=8192,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    # SmolLM2-135M's shapes with Gemma 3's attention pattern (5 sliding layers of 1,024 to 1
    # global, random weights): the windowed-layer benchmark's model (scripts/bench_windows.py),
    # beside smollm2-135m with every layer global.
    "smollm2-135m-sliding": ModelConfig(
        name="smollm2-135m-sliding", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
        rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, max_seq_len=131072,
        bos_token_id=1, eos_token_ids=(2,),
        layer_attention=tuple(LayerAttention() if (i + 1) % 6 == 0 else LayerAttention(window=1024)
                              for i in range(30)),
    ),
    # Llama 4's attention at a small width (random weights): 3 layers in aligned
    # chunks of 8,192 with RoPE and weightless q/k norms after it, then 1 global NoPE layer whose
    # queries warm by position (floor_scale 8,192, attn_scale 0.1: Scout's and Maverick's); 10M
    # positions. Maverick's feed-forward layout: layers 1 and 3 a mixture of 4 experts of 128
    # units, top 1 by Llama 4's sigmoid router, plus a shared expert of 128 (as interleave step 2);
    # layers 0 and 2 a dense MLP of 256. A token's FFN work is the dense model's (2 x 128 units on
    # an MoE layer, 256 on a dense one). Sized so that a 1M-token prefill runs the whole path on a
    # 2-core CPU in about an hour (its global layer's causal attention: 4 * 128 * 10^12 / 2 = 2.6e14 FLOPs).
    "tiny-llama4": ModelConfig(
        name="tiny-llama4", vocab_size=1024, dim=128, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=256,
        head_dim=64, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=10485760, bos_token_id=1, eos_token_ids=(2,),
        layer_attention=tuple(LayerAttention(rope=False, temperature_floor=8192, temperature_scale=0.1)
                              if (i + 1) % 4 == 0 else LayerAttention(chunk=8192, qk_norm_after_rope=True)
                              for i in range(4)),
        layer_experts=tuple(Experts(n_experts=4, experts_per_token=1, expert_ffn_dim=128, router="sigmoid-topk",
                                    renormalize=False, weights_in_model_dtype=True, shared_ffn_dim=128)
                            if i % 2 else None for i in range(4)),
    ),
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
        rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_seq_len=32768,
        eos_token_ids=(151643, 151645),
    ),
    "llama3.2-1b": ModelConfig(
        name="llama3.2-1b", vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
        max_seq_len=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    # Shapes of published checkpoints, from their config.json files on the Hugging Face hub
    # (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B, Qwen/Qwen2.5-7B-Instruct-1M); parameter counts
    # 8.03B, 8.19B and 7.62B. Qwen3-8B's own config has plain RoPE over 40,960 positions (its
    # model card adds yarn, factor 4 over 32,768, for 128K); Qwen2.5-7B-Instruct-1M's layers run
    # Dual Chunk Attention (its dual_chunk_attention_config; ringctx computes the dense attention,
    # not vLLM's sparse approximation of it).
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, rope_scaling=RopeScaling(), norm_eps=1e-5, max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
        head_dim=128, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, max_seq_len=40960,
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "qwen2.5-7b-instruct-1m": ModelConfig(
        name="qwen2.5-7b-instruct-1m", vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
        ffn_dim=18944, rope_theta=10000000.0, norm_eps=1e-5, qkv_bias=True, max_seq_len=1010000,
        bos_token_id=151643, eos_token_ids=(151645,),
        layer_attention=(LayerAttention(dual_chunk=QWEN_1M_DCA),) * 28,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
        rope_theta=500000.0, rope_scaling=RopeScaling(), max_seq_len=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
}

TINY_QWEN35 = "tiny-qwen3.5"
TINY_QWEN35_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2}
"""tiny-qwen3.5 (random weights): Qwen3.5's layer pattern (3 Gated DeltaNet : 1 gated full attention,
8 layers), its norms, gates and partial rotary at small widths, 1,048,576 positions; sized so that a
1M-token prefill runs the whole hybrid path on a 2-core CPU (see its planned time in docs)."""

# The dense long-context families, read by read_hf_config from their published config.json values
# (google/gemma-3-27b-it's text_config, mistralai/Mistral-Small-3.1-24B-Instruct-2503's text_config,
# microsoft/Phi-3-mini-128k-instruct, ByteDance-Seed/Seed-OSS-36B-Instruct,
# Qwen/Qwen2.5-14B-Instruct-1M), so that a preset is what loading the checkpoint gives; parameter
# counts 27.0B (text model), 23.6B (text model), 3.82B, 36.2B, 14.8B. Phi-3's 48 short and 48 long
# LongRoPE factors are NOT the published ones (placeholders: 1.0 short, 1 to 48 long): they do
# not change a plan's costs; load the checkpoint for its real values.
_PUBLISHED = {
    "gemma3-27b": {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear",
                                                                                      "factor": 8.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": [1, 106]},
    # Gemma 4 31B's layout as FAMILIES.md records it (5 sliding : 1 full; the full layers' own
    # 512-dim heads, 4 KV heads whose keys are their values, partial proportional RoPE): the
    # widths here are not read from the published config.json (no hub here); load the checkpoint
    # for its exact numbers.
    "gemma4-31b": {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
        "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0, "sliding_window": 1024, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106]},
    # Gemma 4 26B-A4B's text model (google/gemma-4-26B-A4B-it's text_config as several public
    # repositories copy it; no hub here): 30 layers of 2,816, 5 sliding (1,024) : 1 full, the full
    # layers' 512-dim heads with 2 KV heads whose keys are their values, and on every layer a dense
    # GeGLU MLP of 2,112 beside 128 experts of 704, top 8 (Gemma4TextRouter); 262,144 positions
    # (256K, the issue's). Keys left out take Gemma4TextConfig's defaults (RoPE bases 10,000 and
    # 1,000,000, partial 0.25). 25.2B parameters, 3.8B a token, as Google's model card counts them.
    "gemma4-26b": {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
        "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0, "sliding_window": 1024, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106]},
    "mistral-small-24b": {
        "model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 1_000_000_000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "phi3-mini-128k": {
        "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                         "long_factor": [float(1 + i) for i in range(48)]},
        "rms_norm_eps": 1e-5, "sliding_window": 262144, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": [32000, 32001, 32007]},
    "seed-oss-36b": {
        "model_type": "seed_oss", "vocab_size": 155136, "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 10_000_000.0, "max_position_embeddings": 524288, "rms_norm_eps": 1e-6,
        "attention_bias": True, "attention_out_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 2},
    "qwen2.5-14b-instruct-1m": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "rope_theta": 10_000_000.0,
        "max_position_embeddings": 1010000, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
        "dual_chunk_attention_config": {"chunk_size": 262144, "local_size": 8192,
                                        "original_max_position_embeddings": 262144}},
    # The mixtures of experts, from Qwen/Qwen3-30B-A3B's and mistralai/Mixtral-8x7B-v0.1's
    # config.json values: 30.5B parameters of which 3.3B reach a token, and 46.7B of which 12.9B.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    # Qwen/Qwen3-235B-A22B-Instruct-2507 (no hub here): widths, layers, heads, experts, vocabulary
    # and 262,144 positions as issue 51 states them; intermediate_size 12,288 (unused: every layer
    # sparse), RoPE base 5,000,000, norm_topk_prob and the token ids as the published config.json
    # has them, not checked here. The counts agree with the name: 235.1B parameters, 22.2B a token.
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 5_000_000.0,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 1_000_000.0, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2},
    # Llama 4, from meta-llama/Llama-4-Scout-17B-16E's and Llama-4-Maverick-17B-128E's text_config
    # values as recalled here (no hub on this machine: check against the checkpoint's config.json):
    # Scout 48 layers of 16 experts + a shared one on every layer, llama3 RoPE scaling (factor 16 over
    # 8,192), 10M positions, 107.8B text parameters of which 17.2B reach a token; Maverick 128 experts
    # on every 2nd layer (dense MLPs of 16,384 between), no RoPE scaling and no q/k norm, 1M positions,
    # 400.7B of which 17.2B. Both: chunks of 8,192 on the RoPE layers, every 4th layer NoPE
    # (no_rope_layers left to the default interval 4), the query temperature of floor_scale 8,192.
    "llama4-scout": {
        "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "use_qk_norm": True,
        "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008]},
    "llama4-maverick": {
        "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 128, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "attention_chunk_size": 8192, "use_qk_norm": False,
        "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "rope_theta": 500000.0,
        "rope_scaling": None, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008]},
    # gpt-oss, from openai/gpt-oss-20b's and gpt-oss-120b's config.json values (as recalled here: no
    # hub on this machine), which agree with transformers 5.25's GptOssConfig defaults (those are the
    # 120b's: 36 layers, 128 experts; hidden and expert width 2880, 64 query heads of 64 dims, 8 KV
    # heads, vocabulary 201,088, windows of 128 on the even layers, YaRN x32 over 4,096 with truncate
    # false, theta 150,000, 131,072 positions). The 20b has 24 layers and 32 experts, top 4 both.
    # Sinks, attention and expert biases and the router bias come with model_type gpt_oss
    # (config_hf.py). eos: config.json's <|return|> (its generation_config.json adds <|call|> and
    # <|endoftext|>). Parameters 20.91B and 116.83B, the model card's; of those 4.19B and 5.71B reach
    # a token (`active_params`; the card's 3.61B and 5.13B leave out the 0.58B embedding table).
    **{name: {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": experts, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999}
       for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
    # The linear-attention hybrids: three Gated DeltaNet layers to one gated full-attention layer
    # (partial rotary 0.25, RoPE base 10,000,000, 262,144 positions). Qwen3.6-27B's text model
    # as Qwen3.5-27B's text_config (copies in public repositories agree; no hub here): 64 layers
    # of 5,120, 24 query heads of 256, 4 KV heads, linear heads 16 key / 48 value of 128, a dense
    # MLP of 17,408, 248,320 tokens; eos: the top-level <|im_end|> 248046 and the text_config's
    # 248044. Qwen3.6-35B-A3B: Qwen3_5MoeTextConfig's defaults (40 layers of 2,048, 16 heads of 256,
    # 2 KV heads, linear 16 / 32, 256 experts of 512 top 8 and a gated shared expert of 512).
    # Qwen3-Next-80B-A3B: Qwen3NextConfig's defaults (48 layers of 2,048, 512 experts of 512 top
    # 10, 151,936 tokens), its RoPE base and context as recalled. The interleaved M-RoPE of the
    # Qwen3.5 checkpoints rotates text positions as plain RoPE does (its three sections carry one
    # position), so it is left out. Parameters: 26.9B (the text model; the checkpoint adds a vision
    # tower), 34.7B of which 3.5B reach a token, 79.7B of which 3.9B.
    "qwen3.6-27b": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": [248046, 248044]},
    "qwen3.6-35b-a3b": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "eos_token_id": [248046, 248044]},
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645},
    TINY_QWEN35: TINY_QWEN35_CONFIG,
}
PRESETS.update({name: read_hf_config(d, name=name) for name, d in _PUBLISHED.items()})
"""Model shapes by preset name. `smollm2-135m` is also the embedded default model (real weights)."""


def get_preset(name: str) -> ModelConfig:
    """The preset config called `name`; a clear error listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
