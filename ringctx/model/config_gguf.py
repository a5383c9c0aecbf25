"""Reading a GGUF file's header: the `ModelConfig` it describes and its typed fields, beside the
GGUF weight loader (weights_gguf.py) and the planner call `read_gguf_config`."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from .config import (_MISSING, Experts, LayerAttention, LinearShape, ModelConfig, RopeScaling, with_head_shape,
                     yarn_attention_factor)


def read_gguf_field(field: Any) -> Any:
    """The Python value of a `gguf.ReaderField` (`reader.fields[key]`): int, float, bool, str, or a list of them."""
    from gguf import GGUFValueType

    def scalar(part: Any, vtype: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        if vtype == GGUFValueType.FLOAT32:  # 1e-5 stored as float32 reads back as 9.99999974e-06
            return float(str(part.astype("float32")[0]))
        return bool(value) if vtype == GGUFValueType.BOOL else value

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


GGUF_HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
"""Linear-attention hybrids (`_gguf_linear_layers`): Qwen3.5 / 3.6 dense (qwen35) and mixture of
experts (qwen35moe), Qwen3-Next (qwen3next); weights_gguf.py undoes their converter's transforms."""

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "seed_oss", "phi3", "gemma3", "gemma4", "qwen3moe", "gpt-oss",
                      "llama4", *GGUF_HYBRID_ARCHITECTURES)
"""GGUF `general.architecture`s ringctx's decoder runs (llama also holds Mistral, Mistral-Small's
text model, Llama 3 and Mixtral files; phi3 Phi-3/3.5/4-mini; gemma3 Gemma 3's text model; gemma4
Gemma 4's text models, the 31B's own head shape on its full layers and the 26B-A4B's experts
included; qwen3moe Qwen3-MoE, 2507 and Qwen3-Coder included; gpt-oss its mixture of experts, sinks
and biases: `_gpt_oss_gguf`; llama4 Llama 4 Scout and Maverick's text models, experts included;
the hybrids GGUF_HYBRID_ARCHITECTURES)."""

GGUF_EXPERT_ARCHITECTURES = ("llama", "qwen3moe", "gemma4", "qwen35moe", "qwen3next")
"""Architectures whose {arch}.expert_count `_gguf_experts` reads: Mixtral, Qwen3-MoE, Gemma 4
26B-A4B, Qwen3.5-MoE and Qwen3-Next (gpt-oss's: `_gpt_oss_gguf`; Llama 4's: `_gguf_llama4_experts`)."""

GGUF_RECURRENT = {
    "mamba": "Mamba's selective state space", "mamba2": "Mamba-2's state space",
    "jamba": "Jamba's Mamba layers", "falcon-h1": "Falcon-H1's Mamba-2 layers",
    "granitehybrid": "Granite 4's Mamba-2 layers", "nemotron_h": "Nemotron-H's Mamba-2 layers",
    "nemotron_h_moe": "Nemotron-H's Mamba-2 layers", "plamo2": "PLaMo 2's Mamba layers",
    "rwkv6": "RWKV-6's time mixing", "rwkv6qwen2": "RWKV-6's time mixing", "rwkv7": "RWKV-7's time mixing",
    "arwkv7": "RWKV-7's time mixing", "kimi-linear": "Kimi Linear's delta attention (KDA)",
    "lfm2": "LFM2's short convolutions", "lfm2moe": "LFM2's short convolutions",
}
"""Architectures whose layers carry a recurrence ringctx does not compute (it computes Qwen3.5's
and Qwen3-Next's Gated DeltaNet), refused naming it."""

GGUF_REFUSED = {
    "gemma3n": "gemma3n.embedding_length_per_layer_input (Gemma 3n's per-layer inputs, AltUp, LAuReL)",
    "gemma2": "general.architecture='gemma2' (ringctx runs Gemma 3: gemma3)",
}
"""Architectures refused with the key that makes them unsupported ("... is not supported yet")."""

GEMMA3_PATTERN = 6
"""llama.cpp's Gemma 3: every 6th layer full, the others sliding (`set_swa_pattern(6)`), whatever
the header says; transformers' Gemma3TextConfig derives the same layers from its default pattern."""
GEMMA3_LOCAL_BASE = 10_000.0
"""llama.cpp's Gemma 3: the sliding layers' RoPE base, unscaled (`rope_freq_base_train_swa`)."""
GEMMA4_STILL_DIVISOR = 1e20
"""A `rope_freqs` entry of a gemma4 file at least this large stops its pair: llama.cpp's converter
writes 1.0 for the pairs Gemma 4's proportional RoPE turns and 1e30 for the others (ggml divides
each pair's angle by its entry, so 1e30 leaves cos 1, sin < 1e-20 at any position); ringctx turns
those pairs by exactly 0, as transformers does."""
GEMMA3_27B_LAYERS = 62
"""llama.cpp's Gemma 3 scales queries by 1/sqrt(head_dim), except the 27B model (62 layers):
1/sqrt(embedding_length / head_count), its query_pre_attn_scalar (168 = 5376 / 32, head_dim 128)."""


def _gguf_rope_scaling(arch: str, get, source: str) -> RopeScaling | None:
    """The linear or YaRN scaling named by a GGUF header's rope.scaling.* keys (None: plain, or a
    table read separately: Llama-3.1's rope_freqs, LongRoPE's factor tensors, whose type key
    llama.cpp's converter writes as 'longrope')."""
    kind = get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", "", "longrope"):
        return None
    factor = float(get(f"{arch}.rope.scaling.factor", 1.0))
    original = int(get(f"{arch}.rope.scaling.original_context_length", 0) or get(f"{arch}.context_length", 8192))
    if kind == "linear":
        return RopeScaling(factor=factor, rope_type="linear", original_max_position=original)
    if kind == "yarn":
        for key in ("yarn_ext_factor", "yarn_log_multiplier"):
            if get(f"{arch}.rope.scaling.{key}", None) not in (None, -1.0, 0.0):
                raise ValueError(f"{source}: {arch}.rope.scaling.{key}={get(f'{arch}.rope.scaling.{key}')} is "
                                 "not supported (ringctx computes transformers' YaRN)")
        attn = float(get(f"{arch}.rope.scaling.attn_factor", 1.0))
        return RopeScaling(factor=factor, rope_type="yarn", original_max_position=original,
                           beta_fast=float(get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=attn * yarn_attention_factor(factor))
    raise ValueError(f"{source}: {arch}.rope.scaling.type={kind!r} is not supported "
                     "(ringctx reads plain, linear, yarn and Llama-3.1 RoPE from GGUF files)")


def _fit_llama3_rope(cfg: ModelConfig, table: list[float], hint: int | None, source: str) -> RopeScaling:
    """The Llama-3.1 RopeScaling whose frequency divisors reproduce a GGUF `rope_freqs` table."""
    if len(table) != cfg.head_dim // 2:
        raise ValueError(f"{source}: rope_freqs has {len(table)} entries, expected head_dim/2 = {cfg.head_dim // 2}")
    plain = dataclasses.replace(cfg, rope_scaling=None).rope_inv_freq()
    factor = max(table)
    contexts = [hint] if hint else []
    contexts += [c for c in (8192, 4096, 2048, 16384, 32768, 65536, 131072) if c not in contexts]
    for original in contexts:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (1.0, 1.0)):  # 1, 1: Llama 4 Scout
            candidate = RopeScaling(factor, low, high, int(original))
            divisors = candidate.frequency_divisors(plain)
            if all(abs(a - b) <= 1e-4 * b for a, b in zip(divisors, table)):
                return candidate
    raise ValueError(f"{source}: the rope_freqs table does not follow the Llama-3.1 scaling formula; "
                     "this RoPE variant is not supported")


def read_gguf_config(gguf_file: "str | os.PathLike | Any", *, name: str | None = None) -> ModelConfig:
    """The config stored in a GGUF file's header (a path or an open `gguf.GGUFReader`).

    Supports general.architecture llama (also Mistral and Llama 3 files), qwen2, qwen3, seed_oss,
    phi3, gemma3 and gemma4, with llama.cpp's keys and tensors:

    - RoPE: linear and YaRN scaling from the rope.scaling.* keys (llama.cpp multiplies its
      `attn_factor` key by YaRN's own 0.1 ln(factor) + 1, so that product is transformers'
      attention_factor); Llama-3.1's `rope_freqs.weight` table, matched against the Llama-3.1
      formula; Phi-3's LongRoPE as the `rope_factors_long` / `rope_factors_short` tensors over
      rope.scaling.original_context_length (`_gguf_longrope`); phi3's partial rotary from
      rope.dimension_count.
    - Sliding windows (`_gguf_windows`): attention.sliding_window, on every layer or on those
      attention.sliding_window_pattern names; Gemma 3's layers, local RoPE and query scale as
      llama.cpp derives them (`_gemma3_layers`).
    - Gemma 3's block: llama.cpp's converter stores every norm weight as 1 + w (Gemma3RMSNorm's
      gain), so the config multiplies by the stored weight (norm_plus_one False); GeGLU, four
      norms a block, sqrt(dim)-scaled embeddings, final_logit_softcapping.
    - Gemma 4's dense text models (`_gemma4_layers`): Gemma's block with its norms stored as they
      are (w), a weightless v norm, softmax scale 1, the block scalars (blk.N.layer_output_scale),
      per-layer head shapes (attention.key_length / _swa, a per-layer attention.head_count_kv),
      keys as values where a layer has no attn_v, the sliding layers' RoPE base
      rope.freq_base_swa and the full layers' proportional RoPE from rope_freqs.weight.
    - Mixtures of experts (`_gguf_experts`): llama (Mixtral), qwen3moe and gemma4 (26B-A4B)
      files' expert_count, expert_used_count, expert width and 3-D expert tensors; gpt-oss's
      (`_gpt_oss_gguf`).
    - Llama 4 (llama4): the layers llama.cpp fixes (`_gguf_llama4_layers`) and the experts its
      header describes (`_gguf_llama4_experts`); q/k rows interleaved as in the checkpoint.
    - The linear-attention hybrids qwen35, qwen35moe, qwen3next (GGUF_HYBRID_ARCHITECTURES): their
      Gated DeltaNet layers (`_gguf_linear_layers`), gated attention layers with partial rotary
      (rope.dimension_count; Qwen3.5's multimodal sections checked: `_text_rope_sections`) and
      q/k norms, zero-centred norms (stored 1 + w; the loader subtracts the 1, so the config is
      config.json's), the experts and gated shared expert of qwen35moe / qwen3next
      (`_gguf_experts`); multi-token-prediction blocks past the trunk left out (`_nextn_layers`).
    Architectures of other recurrences (Mamba, RWKV, Kimi Linear...: GGUF_RECURRENT) are refused
    naming the recurrence.
    Keys that disagree with each other or with how llama.cpp runs the architecture, and kinds
    still unsupported (other mixtures of experts, Gemma 3n, Gemma 4's per-layer inputs and KV sharing),
    are one-line ValueErrors naming the key or tensor.
    """
    import gguf

    reader = gguf_file if isinstance(gguf_file, gguf.GGUFReader) else gguf.GGUFReader(os.fspath(gguf_file), "r")
    source = str(getattr(reader.data, "filename", None) or "GGUF file")
    fields = reader.fields

    def get(key: str, default: Any = _MISSING) -> Any:
        if key in fields:
            return read_gguf_field(fields[key])
        if default is _MISSING:
            raise ValueError(f"{source}: GGUF header lacks {key!r}; the file is incomplete or not a model file")
        return default

    arch = get("general.architecture")
    if arch in GGUF_RECURRENT:
        raise ValueError(f"{source}: general.architecture={arch!r} computes {GGUF_RECURRENT[arch]}, a recurrence "
                         f"ringctx does not compute; it runs the Gated DeltaNet hybrids "
                         f"{', '.join(GGUF_HYBRID_ARCHITECTURES)} and attention decoders (GGUF architecture "
                         f"{', '.join(a for a in GGUF_ARCHITECTURES if a not in GGUF_HYBRID_ARCHITECTURES)})")
    if arch in GGUF_REFUSED:
        raise ValueError(f"{source}: {GGUF_REFUSED[arch]} is not supported yet; ringctx runs GGUF architecture "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    if arch not in GGUF_ARCHITECTURES:
        experts = get(f"{arch}.expert_count", None)
        what = f" (a mixture of experts: {arch}.expert_count={experts}, not supported yet)" if experts else ""
        raise ValueError(f"{source}: unsupported architecture general.architecture={arch!r}{what}; "
                         f"ringctx runs Llama-family decoders: GGUF architecture {', '.join(GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if arch == "gemma4":
        _gemma4_refusals(arch, get, tensors, source)
    if get(f"{arch}.expert_count", None) and arch not in GGUF_EXPERT_ARCHITECTURES + ("gpt-oss", "llama4"):
        raise ValueError(f"{source}: {arch}.expert_count={get(f'{arch}.expert_count')} (a mixture of experts) is not "
                         f"supported yet on architecture {arch}; ringctx reads the experts of "
                         f"{', '.join(GGUF_EXPERT_ARCHITECTURES + ('gpt-oss', 'llama4'))} files (Mixtral, Qwen3-MoE, "
                         "Gemma 4 26B-A4B, gpt-oss, Llama 4)")
    gemma = arch in ("gemma3", "gemma4")
    for key in ("attn_logit_softcapping",) + (() if gemma else ("final_logit_softcapping",)):
        if get(f"{arch}.{key}", None):
            raise ValueError(f"{source}: {arch}.{key}={get(f'{arch}.{key}')} is not supported (ringctx reads "
                             "gemma3's and gemma4's final_logit_softcapping only; Gemma 3 and 4 have no attention "
                             "soft-cap, llama.cpp and transformers ignore one); remove the key")
    hybrid = arch in GGUF_HYBRID_ARCHITECTURES
    dim = int(get(f"{arch}.embedding_length"))
    n_layers = int(get(f"{arch}.block_count"))
    if hybrid:  # llama.cpp's qwen35 / qwen35moe: multi-token-prediction blocks follow the trunk's (not run)
        n_layers -= _nextn_layers(arch, get, n_layers, source)
    n_heads = int(_one_value(arch, "attention.head_count", get(f"{arch}.attention.head_count"), source))
    n_kv = get(f"{arch}.attention.head_count_kv", n_heads)
    kv_counts = [int(n) for n in n_kv] if isinstance(n_kv, list) else [int(n_kv)] * n_layers
    if len(kv_counts) != n_layers:
        raise ValueError(f"{source}: {arch}.attention.head_count_kv lists {len(kv_counts)} layers, but "
                         f"{arch}.block_count={n_layers}: give one count per layer, or one for all")
    if arch != "gemma4":  # Gemma 4's full layers may have their own count (`_gemma4_layers`)
        n_kv = _one_value(arch, "attention.head_count_kv", n_kv, source)
    head_dim = int(get(f"{arch}.attention.key_length", dim // n_heads))
    value_dim = int(get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{source}: {arch}.attention.key_length={head_dim} but {arch}.attention.value_length="
                         f"{value_dim}: ringctx needs one head width for keys and values (the file may be an MLA "
                         "model, which is not supported)")
    rotary_dim = int(get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim and arch != "phi3" and not hybrid:
        raise ValueError(f"{source}: partial rotary embeddings ({arch}.rope.dimension_count={rotary_dim} < head "
                         f"dim {head_dim}) are not supported for architecture {arch} (phi3, "
                         f"{', '.join(GGUF_HYBRID_ARCHITECTURES)} only)")
    if rotary_dim > head_dim or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"{source}: {arch}.rope.dimension_count={rotary_dim} for a head of {head_dim}: the rotated "
                         "dims must be a positive even count up to the head width; fix the key")
    if hybrid:
        _text_rope_sections(arch, get, rotary_dim, source)
    rope_scaling = _gguf_rope_scaling(arch, get, source)
    rope_theta = float(get(f"{arch}.rope.freq_base", 10000.0))
    vocab = get(f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else \
            int(tensors["token_embd.weight"].shape[-1])
    eos = [get(k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id")]
    max_seq_len = int(get(f"{arch}.context_length", 8192))
    if get(f"{arch}.rope.scaling.type", None) == "longrope" or any(
            name in tensors for name in ("rope_factors_long.weight", "rope_factors_short.weight")):
        rope_scaling = _gguf_longrope(arch, get, tensors, rope_scaling, rotary_dim, max_seq_len, source)
    windows = [] if arch == "llama4" else _gguf_windows(arch, get, n_layers, source)
    if arch == "llama4":
        layers = _gguf_llama4_layers(arch, get, n_layers, source)
    elif arch == "gemma4":
        layers, head_dim, n_kv, rope_scaling = _gemma4_layers(arch, get, tensors, windows, kv_counts, head_dim,
                                                              rope_scaling, max_seq_len, source)
    elif gemma:
        layers = _gemma3_layers(arch, get, windows, dim, n_heads, head_dim, source)
    else:
        layers = tuple(LayerAttention(window=w, rotary_dim=0 if rotary_dim == head_dim else rotary_dim)
                       for w in windows)
    # Qwen3.5-MoE's configs have no dense width: its converter writes none, config_hf takes the experts'
    ffn_key = "expert_feed_forward_length" if arch == "qwen35moe" and f"{arch}.feed_forward_length" not in fields \
        else "feed_forward_length"
    cfg = ModelConfig(
        name=name or os.path.basename(source),
        vocab_size=int(vocab),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        ffn_dim=int(_one_value(arch, ffn_key, get(f"{arch}.{ffn_key}"), source)),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5)),
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        attn_out_bias="blk.0.attn_output.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        # llama.cpp's always have attn_q_norm / attn_k_norm (the hybrids' on their attention layers)
        qk_norm=arch in ("qwen3", "gemma3", "gemma4", "qwen3moe", *GGUF_HYBRID_ARCHITECTURES),
        max_seq_len=max_seq_len,
        bos_token_id=get("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        layer_attention=layers,
        mlp_activation="gelu_tanh" if gemma else "silu",
        # Gemma 3's (1 + w) gains are stored with the 1 added (see the docstring); the hybrids' too, but
        # their loader subtracts it again (weights_gguf.gguf_norm_shift), giving config.json's config
        norm_plus_one=hybrid,
        post_norms=gemma,
        embed_scale=float(dim ** 0.5) if gemma else 1.0,
        final_softcap=float(get(f"{arch}.final_logit_softcapping", 0.0) or 0.0) if gemma else 0.0,
        v_norm=arch == "gemma4",  # llama.cpp's gemma4 graph RMS-normalises every layer's v, without a weight
        # a block scalar where the file has one (llama.cpp's gemma4: optional, none means 1)
        layer_scalars=arch == "gemma4" and any(f"blk.{i}.layer_output_scale.weight" in tensors
                                               for i in range(n_layers)),
        layer_experts=(_gguf_llama4_experts(arch, get, n_layers, source) if arch == "llama4" else
                       _gguf_experts(arch, get, n_layers, source) if arch in GGUF_EXPERT_ARCHITECTURES else ()),
        layer_linear=_gguf_linear_layers(arch, get, n_layers, source) if hybrid else (),
        attn_output_gate=hybrid,  # the hybrids' attn_q: each head's query rows, then its gate rows
    )
    if arch == "gpt-oss":
        cfg = _gpt_oss_gguf(cfg, arch, get, source)
    if "rope_freqs.weight" in tensors and rope_scaling is None and arch != "gemma4":
        table = _gguf_table(tensors["rope_freqs.weight"])
        hint = get(f"{arch}.rope.scaling.original_context_length", None)
        cfg = dataclasses.replace(cfg, rope_scaling=_fit_llama3_rope(cfg, table, hint, source))
    return cfg


def _gguf_experts(arch: str, get, n_layers: int, source: str) -> tuple[Experts | None, ...]:
    """Every layer's mixture of experts from llama.cpp's header keys, as its llama (Mixtral),
    qwen3moe and gemma4 graphs run them (none when {arch}.expert_count is absent or 0: a dense model):
    expert_count experts, top expert_used_count, each of expert_feed_forward_length units (llama:
    feed_forward_length, Mixtral's expert width); softmax gating, the k weights renormalised
    unless {arch}.expert_weights_norm is false (llama.cpp's default for both: true, Mixtral's and
    Qwen3-MoE's norm_topk_prob as released), rounded to the model dtype on qwen3moe, qwen35moe and
    qwen3next as transformers' routers do (read_hf_config reads the same `Experts`); the latter two
    add a shared expert of expert_shared_feed_forward_length units gated by sigmoid(x
    ffn_gate_inp_shexp) (llama.cpp's qwen3next graph), on every layer as llama.cpp requires; gemma4: Gemma 4
    26B-A4B's experts beside the dense MLP, routed as Gemma4TextRouter ("gemma4": the router's
    scale is ffn_gate_inp.scale, per_expert_scale ffn_down_exps.scale, as llama.cpp's converter
    writes them; the gguf package names neither). The tensors (ffn_gate_inp, ffn_{gate,up,down}_exps,
    gemma4's ffn_gate_up_exps) are checked against these counts when loaded."""
    count = get(f"{arch}.expert_count", None)
    if not count:
        return ()
    used = get(f"{arch}.expert_used_count", None)
    width_key = "feed_forward_length" if arch == "llama" else "expert_feed_forward_length"
    width = _one_value(arch, width_key, get(f"{arch}.{width_key}", None), source)
    for key, value in (("expert_count", count), ("expert_used_count", used), (width_key, width)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{source}: {arch}.{key}={value!r} (a positive count of experts or units) with "
                             f"{arch}.expert_count={count}; fix the key or re-convert the model")
    gating = get(f"{arch}.expert_gating_func", None)
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"{source}: {arch}.expert_gating_func={gating} is not supported (ringctx's {arch} experts "
                         "are gated by a softmax: 1)")
    kind = {"router": "gemma4", "beside_dense": True} if arch == "gemma4" else {}
    if arch in GGUF_HYBRID_ARCHITECTURES:  # Qwen3.5-MoE's and Qwen3-Next's gated shared expert
        shared = _one_value(arch, "expert_shared_feed_forward_length",
                            get(f"{arch}.expert_shared_feed_forward_length", 0), source)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"{source}: {arch}.expert_shared_feed_forward_length={shared!r} (a count of units); "
                             "fix the key or re-convert the model")
        kind = {"shared_ffn_dim": shared, "shared_gate": shared > 0}
    try:
        experts = Experts(n_experts=count, experts_per_token=used, expert_ffn_dim=width,
                          renormalize=bool(get(f"{arch}.expert_weights_norm", True)),
                          weights_in_model_dtype=arch in ("qwen3moe", "qwen35moe", "qwen3next"), **kind)
    except ValueError as e:  # Experts names the field; the header's keys say which entry to fix
        raise ValueError(f"{source}: {arch}.expert_count={count}, {arch}.expert_used_count={used}: "
                         f"{str(e).removeprefix('Experts: ')}; fix the keys or re-convert the model") from None
    return (experts,) * n_layers


def _nextn_layers(arch: str, get, block_count: int, source: str) -> int:
    """How many of block_count blocks are multi-token-prediction blocks ({arch}.nextn_predict_layers;
    llama.cpp's qwen35 stores them after the trunk's and runs them only to draft tokens): the
    trunk is the rest. Their tensors (blk.N for N past the trunk) are not read."""
    nextn = get(f"{arch}.nextn_predict_layers", 0)
    if not isinstance(nextn, int) or isinstance(nextn, bool) or not 0 <= nextn < block_count:
        raise ValueError(f"{source}: {arch}.nextn_predict_layers={nextn!r} with {arch}.block_count={block_count}: "
                         "a count of prediction blocks below the block count; fix the key or re-convert the model")
    return nextn


def _text_rope_sections(arch: str, get, rotary_dim: int, source: str) -> None:
    """Check Qwen3.5's multimodal RoPE sections ({arch}.rope.dimension_sections: pairs turned by
    the time, height and width positions, llama.cpp's converter's mrope_section). A text token
    has one position in all three, so the sections turn as plain RoPE when they cover the
    rotated pairs, as transformers' Qwen3.5 computes text; other sections are refused."""
    sections = get(f"{arch}.rope.dimension_sections", None)
    if sections is None:
        return
    pairs = sum(int(s) for s in (sections if isinstance(sections, list) else [sections]))
    if 2 * pairs != rotary_dim:
        raise ValueError(f"{source}: {arch}.rope.dimension_sections={sections} turn {2 * pairs} dims, but "
                         f"{arch}.rope.dimension_count={rotary_dim}: the multimodal RoPE sections must cover the "
                         "rotated dims (ringctx runs text positions); fix the keys or re-convert the model")


def _gguf_linear_layers(arch: str, get, n_layers: int, source: str) -> tuple[LinearShape | None, ...]:
    """Each layer's Gated DeltaNet (None: attention) of a hybrid's header, as llama.cpp's qwen35 /
    qwen35moe / qwen3next loaders read it:

    - the layer kinds: {arch}.attention.recurrent_layers (true: a linear layer, one per block) or
      else every layer but each full_attention_interval-th (default 4), Qwen3.5's layer_types;
    - its widths (llama.cpp's converter's ssm keys): ssm.group_count key heads (linear_num_key_heads)
      of ssm.state_size dims, ssm.time_step_rank value heads (linear_num_value_heads) of
      ssm.inner_size / time_step_rank dims, ssm.conv_kernel taps."""
    names = ("group_count", "time_step_rank", "state_size", "inner_size", "conv_kernel")
    values = {name: get(f"{arch}.ssm.{name}") for name in names}
    keys = ", ".join(f"{arch}.ssm.{name}={value!r}" for name, value in values.items())
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()) \
            or values["inner_size"] % values["time_step_rank"]:
        raise ValueError(f"{source}: {keys}: each must be a positive count, inner_size a multiple of time_step_rank "
                         "(the value heads); fix the header or re-convert the model")
    try:
        shape = LinearShape(values["group_count"], values["time_step_rank"], values["state_size"],
                            values["inner_size"] // values["time_step_rank"], values["conv_kernel"])
    except ValueError as e:
        raise ValueError(f"{source}: {keys}: {str(e).removeprefix('LinearShape: ')}") from None
    recurrent = get(f"{arch}.attention.recurrent_layers", None)
    if recurrent is None:
        interval = get(f"{arch}.full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ValueError(f"{source}: {arch}.full_attention_interval={interval!r}: a positive layer count (every "
                             "n-th layer attends); fix the key")
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    elif not isinstance(recurrent, list) or len(recurrent) < n_layers:
        raise ValueError(f"{source}: {arch}.attention.recurrent_layers={recurrent!r}: give one bool per block "
                         f"({n_layers}; true: a linear-attention layer)")
    if all(recurrent[:n_layers]):
        raise ValueError(f"{source}: every layer of the file is linear attention ({arch}.attention.recurrent_layers / "
                         "full_attention_interval); ringctx runs hybrids that keep some attention layers")
    return tuple(shape if r else None for r in recurrent[:n_layers])


def _gguf_llama4_layers(arch: str, get, n_layers: int, source: str) -> tuple[LayerAttention, ...]:
    """Llama 4's layers as llama.cpp's llama4 loader fixes them whatever else the header says (its
    hparams: chunks of 8,192, every 4th layer NoPE with the query temperature of floor 8,192 and
    scale 0.1, L2 q/k norms except on the 128-expert model, Maverick, whose config has
    use_qk_norm false): Llama4TextConfig's defaults (config_hf.LLAMA4_DEFAULTS), read by the Hugging
    Face reader's `_llama4_layers`. A sliding_window of 0 (llama.cpp's every-layer-RoPE variant
    for MobileLLM-R1) is refused."""
    from .config_hf import LLAMA4_DEFAULTS, _llama4_layers

    if get(f"{arch}.attention.sliding_window", None) == 0:
        raise ValueError(f"{source}: {arch}.attention.sliding_window=0 (llama.cpp's Llama 4 without chunks or "
                         "NoPE layers, MobileLLM-R1) is not supported yet; ringctx reads Llama 4 Scout and Maverick")

    def refused(what: str, yet: bool = False) -> ValueError:
        return ValueError(f"{source}: {what}")

    use_qk_norm = int(get(f"{arch}.expert_count", 0) or 0) != 128
    return _llama4_layers({**LLAMA4_DEFAULTS, "num_hidden_layers": n_layers, "use_qk_norm": use_qk_norm},
                          refused, refused)


def _gguf_llama4_experts(arch: str, get, n_layers: int, source: str) -> tuple[Experts | None, ...]:
    """Llama 4's mixtures of experts from a llama4 header, as llama.cpp's converter writes them and
    its graph runs them: expert_count experts of expert_feed_forward_length units, top
    expert_used_count by the sigmoid router scaling the inputs, a shared expert as wide, on layer i
    when (i + 1) % interleave_moe_layer_step == 0 (transformers' moe_layers of the same step); no
    expert_count: every layer dense (feed_forward_length)."""
    n_experts = get(f"{arch}.expert_count", None)
    if not n_experts:
        return ()
    step, per_token = get(f"{arch}.interleave_moe_layer_step", 1), get(f"{arch}.expert_used_count", 1)
    width = get(f"{arch}.expert_feed_forward_length")
    keys = (f"{arch}.expert_count={n_experts}, {arch}.expert_used_count={per_token}, "
            f"{arch}.expert_feed_forward_length={width}, {arch}.interleave_moe_layer_step={step}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n_experts, per_token, width, step)):
        raise ValueError(f"{source}: {keys}: each must be a positive count; fix the header or re-convert the model")
    try:
        experts = Experts(n_experts=n_experts, experts_per_token=per_token, expert_ffn_dim=width,
                          router="sigmoid-topk", renormalize=False, weights_in_model_dtype=True, shared_ffn_dim=width)
    except ValueError as e:  # Experts names the field; the header's keys say which entry to fix
        raise ValueError(f"{source}: {keys}: {str(e).removeprefix('Experts: ')}") from None
    return tuple(experts if (i + 1) % step == 0 else None for i in range(n_layers))


def _one_value(arch: str, key: str, value: Any, source: str) -> Any:
    """A header value llama.cpp reads "key or array" (one per layer) as the one value ringctx keeps
    for every layer: the value, or an array's entries when they are all equal."""
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise ValueError(f"{source}: per-layer {arch}.{key} {sorted(set(value))} is not supported (ringctx "
                         "runs one value on every layer)")
    return value[0]


def _gguf_table(tensor: Any) -> list[float]:
    """A small float tensor of a GGUF file (a RoPE factor table) as a list."""
    from gguf.quants import dequantize

    return [float(x) for x in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]


def _gguf_longrope(arch: str, get, tensors: Mapping[str, Any], scaling: RopeScaling | None, rotary_dim: int,
                   context: int, source: str) -> RopeScaling:
    """Phi-3's LongRoPE from a GGUF file, as llama.cpp's converter writes it (rope.scaling.type
    'longrope' in recent versions, no type key in older ones): the long and short factors as the
    tensors rope_factors_long.weight / rope_factors_short.weight [rotary_dim / 2], the
    pre-extension length as rope.scaling.original_context_length, the cos/sin factor as
    rope.scaling.attn_factor (sqrt(1 + ln(s) / ln(original)), s = context_length / original, as
    transformers computes it when that key is absent), factor s."""
    if scaling is not None:
        raise ValueError(f"{source}: the file has LongRoPE factor tensors and {arch}.rope.scaling.type="
                         f"{scaling.rope_type!r}; a model has one RoPE scaling: remove one of them")
    if arch != "phi3":
        raise ValueError(f"{source}: rope_factors_long/short tensors (LongRoPE) on architecture {arch} are not "
                         "supported (ringctx reads LongRoPE from phi3 files)")
    missing = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n not in tensors]
    if missing:
        raise ValueError(f"{source}: LongRoPE ({arch}.rope.scaling.type='longrope' or a factor tensor) needs both "
                         f"rope_factors_long.weight and rope_factors_short.weight; {missing[0]} is missing: "
                         "re-convert the model")
    long, short = _gguf_table(tensors["rope_factors_long.weight"]), _gguf_table(tensors["rope_factors_short.weight"])
    for label, table in (("rope_factors_long.weight", long), ("rope_factors_short.weight", short)):
        if len(table) != rotary_dim // 2:
            raise ValueError(f"{source}: {label} has {len(table)} entries, but {arch}.rope.dimension_count="
                             f"{rotary_dim} rotates {rotary_dim // 2} frequencies: the table and the key disagree; "
                             "re-convert the model")
    original = get(f"{arch}.rope.scaling.original_context_length", None)
    if not original:
        raise ValueError(f"{source}: LongRoPE factor tensors without {arch}.rope.scaling.original_context_length "
                         "(the context the short factors cover); add the key or re-convert the model")
    original = int(original)
    factor = context / original
    attention = get(f"{arch}.rope.scaling.attn_factor", None)
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(factor=factor, original_max_position=original, rope_type="longrope",
                       attention_factor=float(attention), long_factor=tuple(long), short_factor=tuple(short))


def _gguf_windows(arch: str, get, n_layers: int, source: str) -> list[int]:
    """Per layer, its sliding window (0: full attention), from attention.sliding_window and
    attention.sliding_window_pattern.

    No window key: every layer full. A window and no pattern: every layer slides (transformers'
    Mistral and Phi-3 with sliding_window set; llama.cpp itself runs llama, qwen2 and phi3 files
    without windows, so a file of a windowed model written for it drops them). A pattern: an
    integer n slides layer i iff i % n < n - 1 (llama.cpp's set_swa_pattern: every n-th layer
    full; n need not divide the layer count, Gemma 3 1B has 26 layers and n = 6), or one bool per
    layer (true: sliding; Qwen2's max_window_layers is written this way). gemma3: llama.cpp's
    fixed pattern of 6 (GEMMA3_PATTERN); a pattern key there must say the same. gemma4: both keys
    required, as llama.cpp's gemma4 loader requires them."""
    required = _MISSING if arch == "gemma4" else None
    window = get(f"{arch}.attention.sliding_window", required)
    pattern = get(f"{arch}.attention.sliding_window_pattern", required)
    if window is None:
        if pattern is not None:
            raise ValueError(f"{source}: {arch}.attention.sliding_window_pattern without "
                             f"{arch}.attention.sliding_window: add the window or remove the pattern")
        return [0] * n_layers
    window = int(window)
    if window <= 0:
        raise ValueError(f"{source}: {arch}.attention.sliding_window={window}: a window is a positive token count; "
                         "remove the key for full attention on every layer")
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"{source}: {arch}.attention.sliding_window_pattern lists {len(pattern)} layers, but "
                             f"{arch}.block_count={n_layers}: give one entry per layer (true: sliding)")
        sliding = [bool(p) for p in pattern]
    elif pattern is not None:
        if int(pattern) <= 0:
            raise ValueError(f"{source}: {arch}.attention.sliding_window_pattern={pattern}: the pattern is a "
                             "positive layer count (every n-th layer full; 1: none slides); omit the key for a "
                             "window on every layer")
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(n_layers)]
    else:
        sliding = [True] * n_layers
    if arch == "gemma3":
        gemma = [i % GEMMA3_PATTERN < GEMMA3_PATTERN - 1 for i in range(n_layers)]
        if pattern is not None and sliding != gemma:
            raise ValueError(f"{source}: gemma3.attention.sliding_window_pattern={pattern} disagrees with Gemma 3's "
                             f"layers (every {GEMMA3_PATTERN}th full, as llama.cpp runs every gemma3 file); "
                             "remove the key")
        sliding = gemma
    if arch == "gpt-oss":  # llama.cpp's gpt-oss: set_swa_pattern(2), the even layers slide (GptOssConfig's too)
        alternating = [i % 2 == 0 for i in range(n_layers)]
        if pattern is not None and sliding != alternating:
            raise ValueError(f"{source}: gpt-oss.attention.sliding_window_pattern={pattern} disagrees with gpt-oss's "
                             "layers (the even ones sliding, as llama.cpp runs every gpt-oss file); remove the key")
        sliding = alternating
    return [window if s else 0 for s in sliding]


def _gemma3_layers(arch: str, get, windows: list[int], dim: int, n_heads: int, head_dim: int,
                   source: str) -> tuple[LayerAttention, ...]:
    """Gemma 3's layers as llama.cpp derives them: the sliding ones rotate with base
    GEMMA3_LOCAL_BASE, unscaled; every layer scales its queries by GEMMA3_27B_LAYERS' rule (the
    header has no query_pre_attn_scalar). A rope.freq_base_swa or attention.scale key that says
    otherwise is an error: llama.cpp would ignore it."""
    n_layers = len(windows)
    query_scalar = dim / n_heads if n_layers == GEMMA3_27B_LAYERS else head_dim
    scale = float(query_scalar) ** -0.5
    stated = get(f"{arch}.attention.scale", None)
    if stated is not None and abs(float(stated) - scale) > 1e-6 * scale:
        raise ValueError(f"{source}: {arch}.attention.scale={stated} disagrees with Gemma 3's query scale "
                         f"1/sqrt({query_scalar:g}) = {scale:.6g} (llama.cpp derives it from the layer count and "
                         "ignores the key); remove the key")
    local_base = get(f"{arch}.rope.freq_base_swa", None)
    if local_base is not None and float(local_base) != GEMMA3_LOCAL_BASE:
        raise ValueError(f"{source}: {arch}.rope.freq_base_swa={local_base} disagrees with Gemma 3's sliding-layer "
                         f"RoPE base {GEMMA3_LOCAL_BASE:g} (llama.cpp's, whatever the key says); remove the key")
    scale = 0.0 if scale == head_dim ** -0.5 else scale  # the default: keeps plain layers plain
    return tuple(LayerAttention(window=w, scale=scale, **({"rope_theta": GEMMA3_LOCAL_BASE} if w else {}))
                 for w in windows)


GEMMA4_UNSUPPORTED = "Gemma 4's per-layer inputs (E2B, E4B)", "KV sharing across layers"
"""What llama.cpp's gemma4 carries that ringctx does not compute (`_gemma4_refusals`; its experts
are read: `_gguf_experts`)."""


def _gemma4_refusals(arch: str, get, tensors: Mapping[str, Any], source: str) -> None:
    """Refuse, naming the key or tensor, what llama.cpp's gemma4 runs and ringctx does not compute:
    per-layer inputs (embedding_length_per_layer_input > 0, per_layer_token_embd) and KV sharing
    (attention.shared_kv_layers > 0). llama.cpp's converter writes both keys as 0 for the 31B and
    the 26B-A4B."""
    inputs, sharing = GEMMA4_UNSUPPORTED
    found = []
    for key, what in (("embedding_length_per_layer_input", inputs), ("attention.shared_kv_layers", sharing)):
        if get(f"{arch}.{key}", None):
            found.append(f"{arch}.{key}={get(f'{arch}.{key}')} ({what})")
    for name in tensors:
        if name.startswith("per_layer_") or ".inp_gate." in name:
            found.append(f"tensor {name} ({inputs})")
    if found:
        raise ValueError(f"{source}: {found[0]} is not supported yet; ringctx runs Gemma 4's 31B and 26B-A4B text "
                         "models")


def _gemma4_layers(arch: str, get, tensors: Mapping[str, Any], windows: list[int], kv_counts: list[int],
                   full_dim: int, scaling: RopeScaling | None, context: int, source: str
                   ) -> tuple[tuple[LayerAttention, ...], int, int, RopeScaling | None]:
    """Gemma 4's layers as llama.cpp's gemma4 runs them: (layers, the model's head_dim and
    n_kv_heads, the full layers' RopeScaling).

    - Sliding layers (attention.sliding_window_pattern true): heads of attention.key_length_swa
      dims, RoPE base rope.freq_base_swa (llama.cpp's default: rope.freq_base), unscaled.
    - Full layers: heads of attention.key_length dims (full_dim), the model's base rope.freq_base;
      with rope_freqs.weight, Gemma 4's proportional RoPE (`_gemma4_proportion`).
    - KV heads per layer from attention.head_count_kv (`kv_counts`: an array on the 31B, 4 on the
      full layers and 16 on the sliding ones).
    - Softmax scale 1 on every layer (llama.cpp fixes it; a different attention.scale is an error).
    The model's head shape is the sliding layers' (as Gemma4TextConfig's head_dim and
    num_key_value_heads); a layer of another shape carries its own (`with_head_shape`).
    Both RoPEs rotate whole heads and are otherwise unscaled, as llama.cpp's converter writes
    them; other rope keys are errors."""
    swa_dim = int(get(f"{arch}.attention.key_length_swa", full_dim))
    swa_value = int(get(f"{arch}.attention.value_length_swa", swa_dim))
    if swa_value != swa_dim:
        raise ValueError(f"{source}: {arch}.attention.key_length_swa={swa_dim} but {arch}.attention.value_length_swa="
                         f"{swa_value}: Gemma 4's sliding layers have one head width for keys and values; fix the key")
    swa_rotary = int(get(f"{arch}.rope.dimension_count_swa", get(f"{arch}.rope.dimension_count", full_dim)))
    if swa_rotary != swa_dim:
        raise ValueError(f"{source}: {arch}.rope.dimension_count_swa={swa_rotary} for sliding heads of {swa_dim} dims: "
                         "ringctx rotates Gemma 4's sliding heads whole, as llama.cpp's converter writes them; fix "
                         "the key")
    if scaling is not None:
        raise ValueError(f"{source}: {arch}.rope.scaling.type={get(f'{arch}.rope.scaling.type')!r} is not supported "
                         "on gemma4 (Gemma 4's RoPEs are unscaled; its full layers' proportional RoPE is the "
                         "rope_freqs.weight table); remove the rope.scaling keys")
    stated = get(f"{arch}.attention.scale", None)
    if stated is not None and float(stated) != 1.0:
        raise ValueError(f"{source}: {arch}.attention.scale={stated} disagrees with Gemma 4's softmax scale 1 "
                         "(llama.cpp's gemma4 fixes it and ignores the key); remove the key")
    sliding = [i for i, w in enumerate(windows) if w]
    model_kv = kv_counts[sliding[0] if sliding else 0]
    local = {"rope_theta": float(get(f"{arch}.rope.freq_base_swa", get(f"{arch}.rope.freq_base", 10000.0)))}
    layers = tuple(with_head_shape(LayerAttention(window=w, scale=1.0, **(local if w else {})),
                                   swa_dim if w else full_dim, kv, swa_dim, model_kv)
                   for w, kv in zip(windows, kv_counts))
    proportional = None
    if "rope_freqs.weight" in tensors:
        proportion = _gemma4_proportion(_gguf_table(tensors["rope_freqs.weight"]), full_dim, source)
        proportional = RopeScaling(factor=1.0, rope_type="proportional", proportion=proportion,
                                   original_max_position=context)
    return layers, swa_dim, model_kv, proportional


def _gemma4_proportion(table: list[float], full_dim: int, source: str) -> float:
    """The share of a full layer's head that turns, from llama.cpp's rope_freqs.weight table
    [full_dim / 2]: 1.0 for each pair that turns, then GEMMA4_STILL_DIVISOR or more for each that
    does not (transformers' proportional RoPE: partial_rotary_factor, pairs counted from the first)."""
    if len(table) != full_dim // 2:
        raise ValueError(f"{source}: rope_freqs.weight has {len(table)} entries, but gemma4's full layers have "
                         f"heads of {full_dim} dims ({full_dim // 2} pairs): the table and attention.key_length "
                         "disagree; re-convert the model")
    turning = next((i for i, f in enumerate(table) if f != 1.0), len(table))
    if turning == 0 or any(f < GEMMA4_STILL_DIVISOR for f in table[turning:]):
        raise ValueError(f"{source}: rope_freqs.weight {table[:4]}... is not Gemma 4's proportional RoPE table "
                         f"(1.0 for the pairs that turn, then 1e30 for those that do not); ringctx reads no other "
                         "frequency factors on gemma4")
    proportion = 2 * turning / full_dim
    if int(proportion * full_dim // 2) != turning:  # RopeScaling's own rounding must give the same pairs back
        raise ValueError(f"{source}: rope_freqs.weight turns {turning} of {full_dim // 2} pairs, a share ringctx's "
                         "proportional RoPE cannot state exactly")
    return proportion


GPT_OSS_SWIGLU = (1.702, 7.0)
"""gpt-oss's clamped SwiGLU (alpha, limit): GptOssConfig's swiglu_alpha and swiglu_limit, the
published checkpoints' values. llama.cpp's converter writes no key for them; a file with the
`{arch}.swiglu_clamp_exp` key (one limit per layer, the gguf package's) gives its own limit."""


def _gpt_oss_gguf(cfg: ModelConfig, arch: str, get, source: str) -> ModelConfig:
    """A gpt-oss file's config as transformers' GptOssForCausalLM computes the checkpoint it came
    from (llama.cpp's converter): a sink logit per head on every layer (blk.N.attn_sinks), YaRN
    without truncation (GptOssConfig's truncate false; llama.cpp's ggml rounds the ramp's ends, a
    difference at a few frequencies), and on every layer expert_count experts of
    expert_feed_forward_length units, top expert_used_count, with the biased top-k-then-softmax
    router and biased clamped-SwiGLU experts (`GPT_OSS_SWIGLU`; the limit from swiglu_clamp_exp when
    the file has it)."""
    n_experts, per_token = get(f"{arch}.expert_count"), get(f"{arch}.expert_used_count")
    width = get(f"{arch}.expert_feed_forward_length", cfg.ffn_dim)
    limit = float(_one_value(arch, "swiglu_clamp_exp", get(f"{arch}.swiglu_clamp_exp", GPT_OSS_SWIGLU[1]), source))
    try:
        experts = Experts(n_experts=int(n_experts), experts_per_token=int(per_token), expert_ffn_dim=int(width),
                          router="topk-softmax", renormalize=False, weights_in_model_dtype=True,
                          activation="clamped-swiglu", bias=True, router_bias=True,
                          swiglu_alpha=GPT_OSS_SWIGLU[0], swiglu_limit=limit)
    except ValueError as e:
        raise ValueError(f"{source}: {arch}.expert_count={n_experts}, {arch}.expert_used_count={per_token}, "
                         f"{arch}.expert_feed_forward_length={width}: {str(e).removeprefix('Experts: ')}") from None
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn":
        scaling = dataclasses.replace(scaling, truncate=False)
    layers = tuple(dataclasses.replace(cfg.attention(i), sinks=True) for i in range(cfg.n_layers))
    return dataclasses.replace(cfg, rope_scaling=scaling, layer_attention=layers,
                               layer_experts=(experts,) * cfg.n_layers)
