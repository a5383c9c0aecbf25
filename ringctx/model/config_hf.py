"""Reading (and writing) a Hugging Face `config.json`: the `ModelConfig` of a checkpoint, beside the
safetensors weight loader (weights_hf.py) and the planner call these."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from ..attention.dual_chunk import DualChunk
from .config import Experts, LayerAttention, LinearShape, ModelConfig, RopeScaling, with_head_shape


def _as_id_list(value: Any) -> list[int]:
    """An int, a list of ints or None (as in config.json's eos_token_id) as a list of ints."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


HF_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "seed_oss", "phi3", "gemma3_text",
                  "gemma4_text", "llama4_text", "mistral3", "gemma3", "gemma4", "llama4", "mixtral", "qwen3_moe",
                  "gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5", "qwen3_5_moe")
"""Hugging Face `model_type`s ringctx's decoder runs (mistral3, gemma3, gemma4 and llama4: their
text model only, see WRAPPERS)."""

WRAPPERS = {"mistral3": ("mistral",), "gemma3": ("gemma3_text",), "gemma4": ("gemma4_text",),
            "llama4": ("llama4_text",), "qwen3_5": ("qwen3_5_text",), "qwen3_5_moe": ("qwen3_5_moe_text",)}
"""Image-text models whose `text_config` ringctx runs, with the text model_types it accepts there:
Mistral-Small 3.x / Magistral (Mistral3ForConditionalGeneration), Gemma 3 4B-27B
(Gemma3ForConditionalGeneration) and Llama 4 (Llama4ForConditionalGeneration). Their vision tower
and projector are ignored (weights_hf.py skips those tensors): ringctx reads text prompts only."""

LLAMA4_TYPES = ("llama4_text",)
"""model_types with Llama 4's attention (chunked RoPE layers with weightless q/k norms, NoPE layers
with a query temperature; `_llama4_layers`) and interleaved rotary pairs in their checkpoints
(weights_hf.py permutes those rows at load)."""

LLAMA4_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                   "intermediate_size_mlp": 16384, "attention_chunk_size": 8192, "use_qk_norm": True,
                   "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                   "no_rope_layer_interval": 4, "interleave_moe_layer_step": 1, "rope_theta": 500000.0,
                   "num_local_experts": 16, "num_experts_per_tok": 1}
"""Llama4TextConfig's defaults for the keys a config.json may leave out (transformers 5.25)."""

GEMMA_TYPES = ("gemma3_text", "gemma4_text")
"""model_types with Gemma's block: four norms a block, GeGLU, scaled embeddings, q/k norms; (1 + w)
norms on Gemma 3 only."""

GEMMA4_TYPES = ("gemma4_text",)
"""Gemma 4's text model: Gemma's block with plain (w) norms, a weightless v norm, a stored scalar
per block, softmax scale 1, and full layers with their own RoPE ("proportional", partial), maybe
their own head shape (`_gemma4_head_shapes`) and keys as values (`attention_k_eq_v`)."""

GEMMA4_DEFAULTS = {"head_dim": 256, "sliding_window": 512, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                   "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0, "global_head_dim": 512,
                   "num_key_value_heads": 4, "tie_word_embeddings": True}
"""Gemma4TextConfig's defaults for the keys a config.json may leave out (transformers 5.25)."""

HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""Linear-attention hybrids (`read_hybrid_layers`): Gated DeltaNet layers ("linear_attention" in
layer_types, default three of every four) between gated full-attention layers with partial
rotary, (1 + w) q/k norms and block norms (Qwen3.5 / 3.6 dense and MoE, Qwen3-Next)."""

HYBRID_DEFAULTS = {"head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25,
                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4}
"""Qwen3_5TextConfig's (and Qwen3NextConfig's) defaults for the keys a config.json may leave out
(transformers 5.25)."""

PARTIAL_ROTARY_TYPES = ("phi3", *HYBRID_TYPES)
"""model_types whose partial_rotary_factor ringctx reads (transformers rotates the first dims only)."""

REFUSED_TYPES = {
    "gemma3n": "Gemma 3n (hidden_size_per_layer_input: per-layer inputs, AltUp, LAuReL) is not supported yet",
    "gemma3n_text": "Gemma 3n (hidden_size_per_layer_input: per-layer inputs, AltUp, LAuReL) is not supported yet",
    "gemma2": "Gemma 2 is not supported (ringctx runs Gemma 3)",
    "ministral3": "model_type 'ministral3' (Ministral 3: rope_parameters.llama_4_scaling_beta scales each query "
                  "by its position) is not supported",
    **{t: f"model_type {t!r} ({what}) is not supported yet: of the linear-attention hybrids ringctx computes "
          "Gated DeltaNet ones (Qwen3.5 / 3.6, Qwen3-Next)"
       for t, what in (("kimi_linear", "Kimi-Linear: Kimi Delta Attention layers"),
                       ("minimax", "MiniMax-01: lightning attention layers"),
                       ("mamba", "Mamba: selective state-space layers"), ("mamba2", "Mamba-2 state-space layers"),
                       ("falcon_mamba", "Falcon-Mamba state-space layers"), ("jamba", "Jamba: Mamba layers"),
                       ("bamba", "Bamba: Mamba-2 layers"), ("zamba", "Zamba: Mamba layers"),
                       ("zamba2", "Zamba2: Mamba-2 layers"), ("falcon_h1", "Falcon-H1: Mamba-2 layers"),
                       ("nemotron_h", "Nemotron-H: Mamba-2 layers"),
                       ("granitemoehybrid", "Granite 4 hybrid: Mamba-2 layers"),
                       ("lfm2", "LFM2: short convolution layers"), ("lfm2_moe", "LFM2-MoE: short convolution layers"),
                       ("recurrent_gemma", "RecurrentGemma: RG-LRU layers"), ("rwkv", "RWKV: its recurrence"),
                       ("xlstm", "xLSTM: its recurrence"))},
}
"""model_types refused with their own one-line reason (the decoder would compute them wrongly): other
recurrences than the gated delta rule get one naming theirs."""

MOE_DEFAULTS = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                "max_position_embeddings": 131072},
    "qwen3_moe": {"num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "max_position_embeddings": 32768},
    "gpt_oss": {"num_local_experts": 128, "num_experts_per_tok": 4, "rms_norm_eps": 1e-5, "rope_theta": 150_000.0,
                "max_position_embeddings": 131072, "head_dim": 64, "sliding_window": 128, "attention_bias": True,
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    "qwen3_5_moe_text": {"num_local_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512},
    "qwen3_next": {"num_local_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": []},
}
"""The mixture-of-experts model_types ringctx reads (`read_experts`), with their config classes'
defaults for the keys a config.json may leave out (MixtralConfig, Qwen3MoeConfig, GptOssConfig,
transformers 5.25; all store the expert count as num_local_experts, num_experts being an alias of
it). gpt_oss's default layer_types and YaRN are filled in by `_gpt_oss_defaults`. Qwen3.5-MoE and
Qwen3-Next add a gated shared expert (shared_expert_intermediate_size, `Experts.shared_gate`).""" 

GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
"""GptOssConfig's RoPE scaling when a config.json gives none (transformers 5.25)."""


def _gpt_oss_defaults(d: Mapping[str, Any]) -> dict:
    """A gpt_oss config with GptOssConfig's derived defaults: layer_types alternating sliding / full
    from layer 0 (sliding where (i + 1) % 2), and its YaRN when neither rope_parameters nor the
    transformers 4 spelling rope_scaling (openai's published config.json) carries a rope_type."""
    d = dict(d)
    if not d.get("layer_types"):
        d["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                            for i in range(int(d["num_hidden_layers"]))]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not rope.get("rope_type", rope.get("type")):
        d["rope_parameters"] = {**GPT_OSS_ROPE, "rope_theta": rope.get("rope_theta", d["rope_theta"])}
    return d

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
"""Config keys that declare a mixture-of-experts feed-forward (qwen3_moe, mixtral, gpt_oss, llama4...):
refused outside the model_types of MOE_DEFAULTS (and Llama 4, which lists its own MoE layers)."""

PER_LAYER_INPUT_KEYS = ("hidden_size_per_layer_input",)  # its vocabulary size is set without them (Gemma 4)
"""Config keys of per-layer inputs (an embedding added to every layer: Gemma 3n, the Gemma 4 edge models)."""


def _expert_key(d: Mapping[str, Any]) -> str | None:
    """'key=value' of the first mixture-of-experts key a config (or its text_config) sets, or None."""
    for config in (d, d.get("text_config") if isinstance(d.get("text_config"), Mapping) else {}):
        for key in EXPERT_KEYS:
            if config.get(key):
                return f"{key}={config[key]}"
    return None


def _refuse_unsupported_features(d: Mapping[str, Any], model_type: str, unsupported) -> None:
    """Raise unsupported("key=value ...") for the first config entry ringctx would compute differently
    from transformers: experts, partial rotary, soft-capping, other activations, MLP biases."""
    gemma = model_type in GEMMA_TYPES
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = d.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise unsupported(f"{act_key}={act!r} (only {'gelu_pytorch_tanh' if gemma else 'silu'})")
    if d.get("mlp_bias"):
        raise unsupported("mlp_bias=true")
    if model_type not in PARTIAL_ROTARY_TYPES and d.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise unsupported(f"partial_rotary_factor={d['partial_rotary_factor']}")
    # Llama 4 lists its MoE layers itself (`_llama4_layers`): its expert counts are there with or without them;
    # mixtral and qwen3_moe are read (`read_experts`), gemma4_text's with enable_moe_block (`read_gemma4_experts`)
    read = model_type in LLAMA4_TYPES or model_type in MOE_DEFAULTS or model_type in GEMMA4_TYPES
    experts = None if read else _expert_key(
        {k: v for k, v in d.items() if k != "text_config"})
    if experts:
        raise unsupported(f"mixture-of-experts layers ({experts})", yet=True)
    for key in () if model_type in GEMMA4_TYPES else PER_LAYER_INPUT_KEYS:  # Gemma 4's reader names its own
        if d.get(key):
            raise unsupported(f"per-layer inputs ({key}={d[key]}, Gemma 3n's)", yet=True)
    capped = () if gemma else ("attn_logit_softcapping", "final_logit_softcapping")  # Gemma's final cap: read
    for key in capped:
        if d.get(key) is not None:
            raise unsupported(f"soft-capping ({key}={d[key]})")
    if gemma and d.get("attn_logit_softcapping") is not None:
        # transformers 5.25's Gemma3Attention never passes it to the attention: refuse, not guess
        raise unsupported(f"attn_logit_softcapping={d['attn_logit_softcapping']} (transformers' Gemma 3 ignores it)")
    if model_type in GEMMA4_TYPES:
        _gemma4_refusals(d, unsupported)
    elif gemma and d.get("use_bidirectional_attention"):
        raise unsupported("use_bidirectional_attention=true (EmbeddingGemma: not a causal decoder)")
    beta = (d.get("rope_parameters") or {}).get("llama_4_scaling_beta", d.get("llama_4_scaling_beta"))
    if beta:
        raise unsupported(f"llama_4_scaling_beta={beta} (position-dependent query scaling)")


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""`layer_types` entries ringctx computes."""


def _positive_int(value: Any) -> bool:
    """True for a whole token count above 0 (an int, or a float with no fraction), not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and float(value).is_integer())


def read_layer_attention(d: Mapping[str, Any], model_type: str, unsupported, invalid) -> tuple[LayerAttention, ...]:
    """Each layer's attention kind from a config dict, as transformers decides it per model type:

    - mistral, phi3: one sliding window on every layer whenever `sliding_window` is set (their
      models ignore layer_types);
    - gemma3_text, gemma4_text: `layer_types`, else every `sliding_window_pattern`-th layer
      (default 6) full; Gemma 4's last layer is full whatever the config says;
    - ministral and others: `layer_types`, else derived as transformers' config classes do:
      qwen2/qwen3 slide from layer `max_window_layers` on when `use_sliding_window`; ministral
      slides everywhere when `sliding_window` is set.
    An empty tuple when every layer is plain causal attention. unsupported(text) / invalid(text)
    -> the ValueError for a kind ringctx does not compute / for a value no model can have."""
    n_layers = int(d["num_hidden_layers"])
    window = d.get("sliding_window")
    if model_type in GEMMA_TYPES and not d.get("layer_types"):
        # transformers' Gemma3TextConfig: every `sliding_window_pattern`-th layer (default 6) is full
        if model_type in GEMMA4_TYPES:  # Gemma4TextConfig's pattern is fixed
            pattern = 6
        else:
            pattern = 6 if d.get("sliding_window_pattern") is None else d["sliding_window_pattern"]
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
                raise invalid(f"sliding_window_pattern={pattern!r} (a positive layer count: every n-th layer is "
                              "full); fix it, or give layer_types")
        d = {**d, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(n_layers)]}
    if model_type in ("mistral", "phi3", "mixtral"):  # their models: one window on every layer when set
        kinds = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    elif model_type == "qwen3_moe":  # Qwen3MoeConfig keeps sliding_window only with use_sliding_window
        slides = bool(d.get("use_sliding_window")) and window is not None
        kinds = ["sliding_attention" if slides else "full_attention"] * n_layers
    elif d.get("layer_types"):
        kinds = list(d["layer_types"])
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window"):
            window = None  # transformers' Qwen2/Qwen3 configs drop the window unless it is used
    elif model_type in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers") or 0)
        slides = bool(d.get("use_sliding_window")) and window is not None
        kinds = ["sliding_attention" if slides and i >= first else "full_attention" for i in range(n_layers)]
    else:
        kinds = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    if len(kinds) != n_layers:
        raise invalid(f"layer_types lists {len(kinds)} layers for num_hidden_layers={n_layers}: give one entry "
                      "per layer")
    if model_type in GEMMA4_TYPES and kinds:  # Gemma4TextConfig forces its last layer to full attention
        kinds[-1] = "full_attention"
    layers = []
    for kind in kinds:
        if kind not in LAYER_TYPES:
            raise unsupported(f"layer_types entry {kind!r} (ringctx computes {', '.join(LAYER_TYPES)})", yet=True)
        if kind == "sliding_attention":
            if not _positive_int(window):
                raise invalid(f"sliding_attention layers with sliding_window={window!r} (a positive window): set "
                              "sliding_window to the window in tokens, or null (mistral, phi3) / full_attention "
                              "layers for none")
            layers.append(LayerAttention(window=int(window)))
        elif kind == "chunked_attention":
            chunk = d.get("attention_chunk_size")
            if not _positive_int(chunk):
                raise invalid(f"chunked_attention layers with attention_chunk_size={chunk!r} (a positive size): set "
                              "attention_chunk_size to the chunk in tokens, or make those layers full_attention")
            layers.append(LayerAttention(chunk=int(chunk)))
        else:
            layers.append(LayerAttention())
    return tuple(layers) if any(not layer.is_plain for layer in layers) else ()


def read_hf_config(config: "Mapping[str, Any] | str | os.PathLike", *, name: str | None = None) -> ModelConfig:
    """The config of a Hugging Face checkpoint: a `config.json` dict, file or directory.

    Accepts model_type llama, mistral, ministral, qwen2, qwen3, seed_oss, phi3 (fused tensors,
    longrope, partial rotary) and gemma3_text, and the text model of mistral3 and gemma3
    (`WRAPPERS`), sliding windows and `layer_types` included (`read_layer_attention`), with plain,
    llama3, linear, dynamic, yarn or (phi3) longrope RoPE, in both the transformers 4
    (`rope_scaling`, `rope_theta`) and 5 (`rope_parameters`) spellings. From a directory, the EOS ids of
    `generation_config.json` are added too (Llama-3 instruct models end turns with <|eot_id|>,
    listed only there). Anything ringctx would compute differently from transformers (mixtures
    of experts, partial rotary, soft-capping...) is rejected with a one-line
    ValueError naming the config key and its value.
    """
    source = "config"
    extra_eos: list[int] = []
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if os.path.isdir(path):
            directory, path = path, os.path.join(path, "config.json")
        else:
            directory = os.path.dirname(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file; a Hugging Face model directory needs a config.json")
        source = path
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON config ({e}); re-download or re-save the model") from None
        gen_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                extra_eos = _as_id_list(json.load(f).get("eos_token_id"))
        name = name or os.path.basename(os.path.normpath(directory)) or "hf-model"
    d = dict(config)
    model_type = d.get("model_type")
    if model_type in REFUSED_TYPES:
        raise ValueError(f"{source}: {REFUSED_TYPES[model_type]}")
    if model_type in WRAPPERS:
        text = d.get("text_config")
        text_type = (text or {}).get("model_type") if isinstance(text, Mapping) else None
        if text_type in REFUSED_TYPES:
            raise ValueError(f"{source}: text_config: {REFUSED_TYPES[text_type]}")
        if text_type not in WRAPPERS[model_type]:
            raise ValueError(f"{source}: model_type {model_type!r} with text_config.model_type={text_type!r} is not "
                             f"supported (ringctx runs its text model when that is {', '.join(WRAPPERS[model_type])})")
        # The text model's keys, with the wrapper's ids where the text config lacks them. Tying: the
        # wrapper's tie_word_embeddings when it has one (transformers 5 ties by the top-level
        # config's), else the text config's, else the text model's default (Mistral: untied, as the
        # Mistral-Small 3.x checkpoints, which carry their lm_head, were saved).
        outer = {k: d[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype") if k in d}
        tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        d = {**outer, **text}
        if tie is not None:
            d["tie_word_embeddings"] = tie
        model_type = text_type
    if model_type not in HF_MODEL_TYPES:
        experts = _expert_key(d)
        what = f"a mixture of experts: {experts}, not supported yet; " if experts else ""
        raise ValueError(
            f"{source}: unsupported architecture model_type={model_type!r} "
            f"({what}architectures={d.get('architectures')}); ringctx runs Llama-family decoders: "
            f"model_type {', '.join(HF_MODEL_TYPES)}")

    def unsupported(what: str, yet: bool = False) -> ValueError:
        return ValueError(f"{source}: {what} is not supported {'yet ' if yet else ''}by ringctx's decoder "
                          f"(model_type {model_type})")

    def invalid(what: str) -> ValueError:
        return ValueError(f"{source}: {what} (model_type {model_type})")

    _refuse_unsupported_features(d, model_type, unsupported)
    if model_type == "qwen3_5_moe_text" and d.get("intermediate_size") is None:
        # every layer's feed-forward is experts: no dense width (ffn_dim must still be a count)
        d["intermediate_size"] = d.get("moe_intermediate_size") or MOE_DEFAULTS[model_type]["moe_intermediate_size"]
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    absent = [key for key in required if d.get(key) is None]
    if absent:
        raise ValueError(f"{source}: the config lacks {', '.join(absent)}; it is incomplete or not a model config")
    if model_type in LLAMA4_TYPES:
        d = {**LLAMA4_DEFAULTS, **d}  # an explicit null stays: attention_chunk_size null means no chunks
    if model_type in MOE_DEFAULTS:
        if d.get("num_local_experts") is None and d.get("num_experts") is not None:  # the alias, as transformers
            d = {**d, "num_local_experts": d["num_experts"]}
        d = {**MOE_DEFAULTS[model_type], **d}
    if model_type == "gpt_oss":
        d = _gpt_oss_defaults(d)
    if model_type in HYBRID_TYPES:
        d = {**HYBRID_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if model_type in GEMMA4_TYPES:
        d = {**GEMMA4_DEFAULTS, **d}
    elif model_type in GEMMA_TYPES:  # Gemma3TextConfig's defaults for the keys a config.json may leave out
        d = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
             "max_position_embeddings": 131072, **{k: v for k, v in d.items() if v is not None or k not in (
                 "head_dim", "query_pre_attn_scalar")}}
    max_position = int(d.get("max_position_embeddings") or 8192)
    n_heads = int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or 0) or int(d["hidden_size"]) // n_heads
    gemma = model_type in GEMMA_TYPES
    if gemma:
        rope_theta, rope_scaling, local = _gemma_ropes(d, max_position, unsupported, model_type in GEMMA4_TYPES)
    else:
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        partial = float(rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
        if partial != 1.0 and model_type not in PARTIAL_ROTARY_TYPES:
            raise unsupported(f"rope_parameters.partial_rotary_factor={partial}")
        if rope.get("rope_type", rope.get("type")) in ("longrope", "su") and model_type != "phi3":
            raise unsupported(f"rope_type={rope.get('rope_type', rope.get('type'))!r} on model_type {model_type} "
                              "(ringctx reads LongRoPE from phi3 configs)")
        if model_type == "phi3" and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
            rope["rope_type"] = "longrope"  # Phi3Config's renaming of its older spellings
        original = d.get("original_max_position_embeddings") if model_type == "phi3" else None
        rope_scaling = RopeScaling.from_hf(rope, max_position, unsupported, original)
    linear: tuple = ()
    if model_type in LLAMA4_TYPES:
        layers = _llama4_layers(d, unsupported, invalid)
    elif model_type in HYBRID_TYPES:
        layers, linear = (), read_hybrid_layers(d, invalid)
    else:
        layers = read_layer_attention(d, model_type, unsupported, invalid)
    if model_type == "gpt_oss":  # a learned sink logit per head on every layer (GptOssAttention.sinks)
        layers = tuple(dataclasses.replace(layer, sinks=True) for layer in layers or (LayerAttention(),) * int(
            d["num_hidden_layers"]))
    if d.get("dual_chunk_attention_config"):
        layers = _dual_chunk_layers(d, model_type, layers, rope_scaling, unsupported, invalid)
    if gemma:
        layers = _gemma_layers(d, layers, head_dim, local, gemma4=model_type in GEMMA4_TYPES)
        if model_type in GEMMA4_TYPES:
            layers = _gemma4_head_shapes(d, layers, invalid)
    elif model_type in PARTIAL_ROTARY_TYPES and partial != 1.0:
        rotary_dim = int(head_dim * partial)  # transformers: int(head_dim * partial_rotary_factor)
        if rotary_dim % 2 or rotary_dim <= 0:
            raise unsupported(f"partial_rotary_factor={partial} (rotates {rotary_dim} of {head_dim} dims: not a "
                              "positive even count)")
        layers = tuple(dataclasses.replace(layer, rotary_dim=rotary_dim)
                       for layer in (layers or (LayerAttention(),) * int(d["num_hidden_layers"])))
    attention_bias = bool(d.get("attention_bias", model_type == "seed_oss"))  # SeedOssConfig's default: True
    if model_type == "seed_oss":
        qkv_bias, attn_out_bias = attention_bias, bool(d.get("attention_out_bias", False))
    else:
        # Qwen2 always has q/k/v biases; Llama, Qwen3 and Gemma 3's attention_bias puts one on o_proj too.
        qkv_bias = model_type == "qwen2" or attention_bias
        attn_out_bias = model_type in ("llama", "qwen3", "qwen3_moe", "gemma3_text", "gemma4_text",
                                       "llama4_text", "gpt_oss") and attention_bias
    eos = _as_id_list(d.get("eos_token_id"))
    eos += [i for i in extra_eos if i not in eos]
    return ModelConfig(
        name=name or "hf-model",
        vocab_size=int(d["vocab_size"]),
        dim=int(d["hidden_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        # Llama 4's dense layers are as wide as intermediate_size_mlp (intermediate_size: an expert's)
        ffn_dim=int(d["intermediate_size_mlp" if model_type in LLAMA4_TYPES else "intermediate_size"]),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(d.get("rms_norm_eps", 1e-5 if model_type == "phi3" else 1e-6)),  # mixtral's: MOE_DEFAULTS
        qkv_bias=qkv_bias,
        attn_out_bias=attn_out_bias,
        tie_embeddings=bool(d.get("tie_word_embeddings", gemma)),  # Gemma 3's configs tie by default
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text", *HYBRID_TYPES),
        max_seq_len=max_position,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        layer_attention=layers,
        mlp_activation="gelu_tanh" if gemma else "silu",
        norm_plus_one=model_type in ("gemma3_text", *HYBRID_TYPES),  # Qwen3.5's zero-centred norms too
        post_norms=gemma,
        embed_scale=float(int(d["hidden_size"]) ** 0.5) if gemma else 1.0,
        final_softcap=float(d.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        v_norm=model_type in GEMMA4_TYPES,
        layer_scalars=model_type in GEMMA4_TYPES,
        layer_experts=(read_experts(d, model_type, invalid) if model_type in MOE_DEFAULTS
                       else read_llama4_experts(d, invalid) if model_type in LLAMA4_TYPES
                       else read_gemma4_experts(d, invalid) if model_type in GEMMA4_TYPES else ()),
        layer_linear=linear,
        attn_output_gate=model_type in HYBRID_TYPES,
    )


def read_hybrid_layers(d: Mapping[str, Any], invalid) -> tuple[LinearShape | None, ...]:
    """Each layer's Gated DeltaNet shape (None: a full-attention layer) of a Qwen3.5 / Qwen3-Next
    config (HYBRID_DEFAULTS filled in): layer_types' "linear_attention" entries, or, without
    layer_types, every layer but each full_attention_interval-th (Qwen3_5TextConfig's rule).
    invalid(text) -> the ValueError for a value no model can have."""
    n_layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        interval = d.get("full_attention_interval")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise invalid(f"full_attention_interval={interval!r} (a positive layer count: every n-th layer attends)")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise invalid(f"layer_types={types!r}: give one of 'linear_attention' / 'full_attention' per layer "
                      f"({n_layers})")
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")
    try:
        shape = LinearShape(*(int(d[k]) for k in keys))
    except (TypeError, ValueError) as e:
        raise invalid(", ".join(f"{k}={d.get(k)!r}" for k in keys) + f": {str(e).removeprefix('LinearShape: ')}") \
            from None
    return tuple(shape if t == "linear_attention" else None for t in types)


def read_experts(d: Mapping[str, Any], model_type: str, invalid) -> tuple[Experts | None, ...]:
    """Each layer's mixture of experts (None: a dense MLP of intermediate_size) from a mixtral or
    qwen3_moe config (MOE_DEFAULTS filled in), as transformers 5.25's decoder layers decide it:

    - mixtral: every layer, num_local_experts experts of intermediate_size, top num_experts_per_tok,
      the k weights always renormalised and kept in float32 (MixtralTopKRouter);
    - qwen3_moe: layer i is sparse unless it is in mlp_only_layers, when num_experts > 0 and
      (i + 1) % decoder_sparse_step == 0; experts of moe_intermediate_size, top num_experts_per_tok,
      renormalised iff norm_topk_prob, the weights rounded to the model dtype (Qwen3MoeTopKRouter);
    - qwen3_5_moe_text: every layer, as qwen3_moe with the weights always renormalised, and a shared
      expert of shared_expert_intermediate_size gated by sigmoid(x w) (Qwen3_5MoeSparseMoeBlock);
      qwen3_next: qwen3_moe's rule and the same gated shared expert (Qwen3NextSparseMoeBlock);
    - gpt_oss: every layer, num_local_experts experts of intermediate_size with biases and the
      clamped SwiGLU (swiglu_alpha, swiglu_limit), the router's bias added to its logits, the top
      num_experts_per_tok logits softmaxed over those k, in the model dtype (GptOssTopKRouter).
    The expert count is num_local_experts (read_hf_config renames the alias num_experts to it).
    invalid(text) -> the ValueError for a value no model can have."""
    n_layers = int(d["num_hidden_layers"])
    key = "num_local_experts"
    n_experts, per_token = d.get(key), d.get("num_experts_per_tok")
    width_key = "intermediate_size" if model_type in ("mixtral", "gpt_oss") else "moe_intermediate_size"
    for name, value in ((key, n_experts), ("num_experts_per_tok", per_token), (width_key, d.get(width_key))):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid(f"{name}={value!r} (a count of experts or units)")
    gpt_oss = {}
    if model_type in ("qwen3_5_moe_text", "qwen3_next"):  # a gated shared expert beside the routed ones
        shared = d.get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise invalid(f"shared_expert_intermediate_size={shared!r} (a count of units)")
        gpt_oss = dict(shared_ffn_dim=shared, shared_gate=shared > 0)
    if model_type == "mixtral":
        sparse = [True] * n_layers
        renormalize, rounded = True, False
    elif model_type == "qwen3_5_moe_text":  # Qwen3_5MoeSparseMoeBlock on every layer, always renormalised
        sparse = [True] * n_layers
        renormalize, rounded = True, True
    elif model_type == "gpt_oss":  # GptOssMLP on every layer: router bias, top-k then softmax, biased experts
        sparse = [True] * n_layers
        renormalize, rounded = False, True
        gpt_oss = dict(router="topk-softmax", router_bias=True, bias=True, activation="clamped-swiglu",
                       swiglu_alpha=float(d["swiglu_alpha"]), swiglu_limit=float(d["swiglu_limit"]))
    else:
        step, dense = d.get("decoder_sparse_step"), d.get("mlp_only_layers") or []
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise invalid(f"decoder_sparse_step={step!r} (a positive layer count: every n-th layer is sparse)")
        if not all(isinstance(i, int) and 0 <= i < n_layers for i in dense):
            raise invalid(f"mlp_only_layers={dense!r} names layers outside 0..{n_layers - 1}")
        sparse = [i not in dense and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]
        renormalize, rounded = bool(d.get("norm_topk_prob")), True
    if not any(sparse):
        return ()
    try:
        experts = Experts(n_experts=n_experts, experts_per_token=per_token, expert_ffn_dim=int(d[width_key]),
                          renormalize=renormalize, weights_in_model_dtype=rounded, **gpt_oss)
    except ValueError as e:  # Experts names the field; the config's keys say which entry to fix
        raise invalid(f"{key}={n_experts}, num_experts_per_tok={per_token}, {width_key}={d[width_key]}: "
                      f"{str(e).removeprefix('Experts: ')}") from None
    return tuple(experts if s else None for s in sparse)


def read_gemma4_experts(d: Mapping[str, Any], invalid) -> tuple[Experts | None, ...]:
    """A Gemma 4 text config's experts (Gemma4TextConfig's enable_moe_block, the 26B-A4B's): with
    it every layer has num_experts experts of moe_intermediate_size beside its dense MLP of
    intermediate_size, top top_k_experts by Gemma4TextRouter ("gemma4": `Experts`); without it
    none (transformers then ignores the expert keys). invalid(text) -> the ValueError."""
    if not d.get("enable_moe_block"):
        return ()
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    for key in keys:
        value = d.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise invalid(f"enable_moe_block=true with {key}={value!r} (a positive count of experts or units)")
    try:
        experts = Experts(n_experts=d["num_experts"], experts_per_token=d["top_k_experts"],
                          expert_ffn_dim=d["moe_intermediate_size"], router="gemma4", beside_dense=True)
    except ValueError as e:
        raise invalid(", ".join(f"{key}={d[key]}" for key in keys) + f": {str(e).removeprefix('Experts: ')}") from None
    return (experts,) * int(d["num_hidden_layers"])


def llama4_moe_layers(d: Mapping[str, Any]) -> list[int]:
    """The mixture-of-experts layers of a Llama 4 text config, as Llama4TextConfig decides them:
    `moe_layers` when given (an empty list: every layer dense), else every
    `interleave_moe_layer_step`-th layer from step - 1 (step 1, the default: every layer)."""
    if d.get("moe_layers") is not None:
        return [int(i) for i in d["moe_layers"]]
    step = int(d.get("interleave_moe_layer_step") or 1)
    return list(range(step - 1, int(d["num_hidden_layers"]), step))


def read_llama4_experts(d: Mapping[str, Any], invalid) -> tuple[Experts | None, ...]:
    """Each layer's mixture of experts (None: a dense MLP of intermediate_size_mlp) from a Llama 4
    text config (LLAMA4_DEFAULTS filled in), as Llama4TextDecoderLayer decides it: the layers of
    `llama4_moe_layers` have num_local_experts experts of intermediate_size, top
    num_experts_per_tok by the "sigmoid-topk" router (Llama4Router: the scores rounded to the model
    dtype, scaling the experts' inputs), plus a shared expert of intermediate_size (Llama4TextMoe)."""
    n_layers = int(d["num_hidden_layers"])
    moe = llama4_moe_layers(d)
    if not all(isinstance(i, int) and 0 <= i < n_layers for i in moe):
        raise invalid(f"moe_layers={moe!r} names layers outside 0..{n_layers - 1}")
    if not moe:
        return ()
    n_experts, per_token, width = d.get("num_local_experts"), d.get("num_experts_per_tok"), d["intermediate_size"]
    for name, value in (("num_local_experts", n_experts), ("num_experts_per_tok", per_token),
                        ("intermediate_size", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise invalid(f"{name}={value!r} (a positive count of experts or units)")
    try:
        experts = Experts(n_experts=n_experts, experts_per_token=per_token, expert_ffn_dim=width,
                          router="sigmoid-topk", renormalize=False, weights_in_model_dtype=True,
                          shared_ffn_dim=width)
    except ValueError as e:  # Experts names the field; the config's keys say which entry to fix
        raise invalid(f"num_local_experts={n_experts}, num_experts_per_tok={per_token}: "
                      f"{str(e).removeprefix('Experts: ')}") from None
    return tuple(experts if i in moe else None for i in range(n_layers))


def _llama4_layers(d: Mapping[str, Any], unsupported, invalid) -> tuple[LayerAttention, ...]:
    """Llama 4's layers, as Llama4TextAttention computes them. `no_rope_layers[i]` is 1 where layer
    i rotates (the name says the opposite; empty or absent: every `no_rope_layer_interval`-th layer,
    from the interval's last, is NoPE). A RoPE layer attends within aligned chunks of
    attention_chunk_size (`layer_types` "chunked_attention") and, with use_qk_norm, normalises q and
    k after RoPE; a NoPE layer attends to every earlier key and, with attn_temperature_tuning,
    multiplies its queries by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1."""
    n_layers = int(d["num_hidden_layers"])
    ropes = d.get("no_rope_layers") or [int((i + 1) % int(d["no_rope_layer_interval"]) != 0) for i in range(n_layers)]
    if len(ropes) != n_layers:
        raise invalid(f"no_rope_layers lists {len(ropes)} layers for num_hidden_layers={n_layers}: give one "
                      "entry per layer")
    chunk = d.get("attention_chunk_size")
    kinds = d.get("layer_types") or ["chunked_attention" if rope and chunk is not None else "full_attention"
                                     for rope in ropes]
    spans = read_layer_attention({**d, "layer_types": kinds, "sliding_window": None}, "llama4_text", unsupported,
                                 invalid)
    spans = spans or (LayerAttention(),) * n_layers
    floor_scale = float(d["floor_scale"])
    if d["attn_temperature_tuning"] and (floor_scale <= 0 or not floor_scale.is_integer()):
        raise unsupported(f"floor_scale={d['floor_scale']} (a positive whole number of positions)")
    layers = []
    for span, rope in zip(spans, ropes):
        if rope:
            layers.append(dataclasses.replace(span, qk_norm_after_rope=bool(d["use_qk_norm"])))
        elif d["attn_temperature_tuning"]:
            layers.append(dataclasses.replace(span, rope=False, temperature_floor=int(floor_scale),
                                              temperature_scale=float(d["attn_scale"])))
        else:
            layers.append(dataclasses.replace(span, rope=False))
    return tuple(layers)


def _gemma_ropes(d: Mapping[str, Any], max_position: int, unsupported, gemma4: bool = False
                 ) -> tuple[float, RopeScaling | None, tuple[float, RopeScaling | None]]:
    """Gemma 3's (and 4's) two RoPEs: (global base, global scaling, (local base, local scaling)).

    transformers 5 keys `rope_parameters` by layer type ({"full_attention": ..., "sliding_attention":
    ...}); older configs have rope_theta (+ rope_scaling) for the full layers and
    rope_local_base_freq, unscaled, for the sliding ones. Defaults as Gemma3TextConfig: 1e6 and 1e4."""
    params = d.get("rope_parameters") or {}
    if not params and gemma4:  # Gemma4TextConfig's default RoPEs
        params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0}}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or params or {})
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    full_theta = float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0)))
    return (full_theta, RopeScaling.from_hf(full, max_position, unsupported),
            (local_theta, RopeScaling.from_hf(local, max_position, unsupported)))


def _dual_chunk_layers(d: Mapping[str, Any], model_type: str, layers: tuple[LayerAttention, ...],
                       rope_scaling: RopeScaling | None, unsupported, invalid) -> tuple[LayerAttention, ...]:
    """Every layer with Dual Chunk Attention, from a qwen2 config's `dual_chunk_attention_config`
    (Qwen2.5-7B/14B-Instruct-1M: chunk_size 262144, local_size 8192, original_max_position_embeddings
    262144), as vLLM's Qwen2 reads it (its defaults: chunk_size 8192, local_size 1024, no length
    scaling). Only the dense attention is computed: the sparse_attention_* entries (vLLM's
    vertical-and-slash approximation for long prompts) are ignored."""
    config = d["dual_chunk_attention_config"]
    if model_type != "qwen2":
        raise unsupported("dual_chunk_attention_config (ringctx reads it from qwen2 configs, as vLLM)")
    if not isinstance(config, Mapping):
        raise invalid(f"dual_chunk_attention_config={config!r}: give a dict with chunk_size and local_size")
    if rope_scaling is not None:
        raise unsupported(f"dual_chunk_attention_config with rope_type {rope_scaling.rope_type!r} "
                          "(DCA rotates with plain RoPE, as vLLM)")
    if layers:
        raise unsupported("dual_chunk_attention_config with sliding-window layers")
    try:
        dca = DualChunk(int(config.get("chunk_size", 8192)), int(config.get("local_size", 1024)),
                        int(config.get("original_max_position_embeddings") or 0))
    except (TypeError, ValueError) as e:
        raise invalid(f"dual_chunk_attention_config={dict(config)}: {e}") from None
    return (LayerAttention(dual_chunk=dca),) * int(d["num_hidden_layers"])


def _gemma_layers(d: Mapping[str, Any], layers: tuple[LayerAttention, ...], head_dim: int,
                  local: tuple[float, RopeScaling | None], gemma4: bool = False) -> tuple[LayerAttention, ...]:
    """Gemma 3's and 4's layers: the sliding ones rotate with the local RoPE; every one scales its
    queries by query_pre_attn_scalar^-0.5 (Gemma3Attention.scaling) where that differs from
    head_dim^-0.5, or (Gemma 4, whose q and k are RMS-normed) by 1."""
    scalar = d.get("query_pre_attn_scalar")
    scale = 1.0 if gemma4 else float(scalar) ** -0.5 if scalar is not None else 0.0
    if scale == head_dim ** -0.5:
        scale = 0.0  # the default: keeps plain layers plain
    layers = layers or (LayerAttention(),) * int(d["num_hidden_layers"])
    return tuple(dataclasses.replace(layer, scale=scale, **(
        {"rope_theta": local[0], "rope_scaling": local[1]} if layer.window else {})) for layer in layers)


def _gemma4_refusals(d: Mapping[str, Any], unsupported) -> None:
    """Raise unsupported(...) for the Gemma 4 features ringctx does not compute (before defaults:
    a key absent takes Gemma4TextConfig's default, which for per-layer embeddings is on)."""
    if d.get("hidden_size_per_layer_input", 256):
        raise unsupported(f"per-layer embeddings (hidden_size_per_layer_input="
                          f"{d.get('hidden_size_per_layer_input', 256)}; 0 turns them off)")
    if d.get("num_kv_shared_layers"):
        raise unsupported(f"KV sharing across layers (num_kv_shared_layers={d['num_kv_shared_layers']})")
    if d.get("use_bidirectional_attention") == "all":
        raise unsupported("use_bidirectional_attention='all' (not a causal decoder)")


def _gemma4_head_shapes(d: Mapping[str, Any], layers: tuple[LayerAttention, ...], invalid
                        ) -> tuple[LayerAttention, ...]:
    """Gemma 4's full-attention layers with their own head shape (`LayerAttention.head_dim`,
    `n_kv_heads`; the 31B's: 512-dim heads, 4 KV heads, where its sliding layers have 256 and 16),
    as Gemma4TextConfig reads them: `per_layer_config` when the config has one (as transformers
    saves it: {layer index: overrides}, only the layers whose shape differs), else global_head_dim
    (default 512) on every full layer and, with attention_k_eq_v, num_global_key_value_heads."""
    head_dim = int(d.get("head_dim") or 0) or int(d["hidden_size"]) // int(d["num_attention_heads"])
    n_kv = int(d.get("num_key_value_heads") or d["num_attention_heads"])
    if d.get("per_layer_config") is not None:
        try:
            overrides = {int(i): dict(c) for i, c in d["per_layer_config"].items()}
        except (AttributeError, TypeError, ValueError):
            raise invalid(f"per_layer_config={d['per_layer_config']!r}: give {{layer index: {{head_dim, "
                          "num_key_value_heads}}}}") from None
    else:
        global_kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v") else None
        full = {"head_dim": d["global_head_dim"], **({"num_key_value_heads": global_kv} if global_kv else {})}
        overrides = {i: full for i, layer in enumerate(layers) if not layer.window}
    out = list(layers)
    for i, override in overrides.items():
        if not 0 <= i < len(out):
            raise invalid(f"per_layer_config names layer {i} of a model of {len(out)} layers")
        try:
            shape = (int(override.get("head_dim") or head_dim), int(override.get("num_key_value_heads") or n_kv))
        except (TypeError, ValueError):
            raise invalid(f"per_layer_config[{i}]={override!r}: head_dim and num_key_value_heads are counts") from None
        if shape[1] <= 0 or shape[0] <= 0 or int(d["num_attention_heads"]) % shape[1]:
            raise invalid(f"per_layer_config[{i}]: {shape[1]} KV heads of {shape[0]} dims for "
                          f"{d['num_attention_heads']} query heads: n_heads is not a multiple of layer {i}'s n_kv_heads")
        out[i] = with_head_shape(out[i], *shape, head_dim, n_kv)  # the model's shape stays implicit
    return tuple(out)


def hf_config_dict(self: ModelConfig) -> dict:
    """A transformers `config.json` dict for this config (LlamaConfig, Qwen2Config or Qwen3Config fields)."""
    if not self.has_plain_attention:
        raise ValueError(f"ModelConfig {self.name!r}: hf_config_dict writes plain Llama/Qwen configs; this one's "
                         "layers have windows, chunks, dual chunk attention or their own RoPE")
    if self.has_experts:
        raise ValueError(f"ModelConfig {self.name!r}: hf_config_dict writes dense Llama/Qwen configs; this one's "
                         "layers have experts")
    if not self.is_llama_block or (self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope"):
        raise ValueError(f"ModelConfig {self.name!r}: hf_config_dict writes plain Llama/Qwen configs; this one "
                         "has Gemma's block or LongRoPE")
    qwen3 = self.qk_norm
    qwen2 = not qwen3 and self.qkv_bias and not self.attn_out_bias
    if qwen3 and self.qkv_bias != self.attn_out_bias:
        raise ValueError(f"ModelConfig {self.name!r}: Qwen3 has biases on all of q, k, v, o or on none")
    model_type = "qwen3" if qwen3 else "qwen2" if qwen2 else "llama"
    d: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [{"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[model_type] + "ForCausalLM"],
        "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
        "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
        "intermediate_size": self.ffn_dim, "head_dim": self.head_dim, "hidden_act": "silu",
        "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_embeddings,
        "max_position_embeddings": self.max_seq_len, "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
        (self.eos_token_ids[0] if self.eos_token_ids else None),
        "rope_theta": self.rope_theta,
    }
    if not qwen2:
        d["attention_bias"] = self.attn_out_bias
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
        rope.update(self.rope_scaling.to_hf())
    d["rope_parameters"] = rope
    d["rope_scaling"] = rope  # the transformers 4 spelling
    return d
