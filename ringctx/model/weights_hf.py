"""Hugging Face checkpoints: a directory with config.json and one or many *.safetensors files.

Sharded checkpoints are read through `model.safetensors.index.json` (or, without an index, every
*.safetensors file in the directory). Tensors are read one at a time with `safetensors.safe_open`
(memory-mapped) and copied straight into the model's parameters in the requested dtype.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import NamedTuple

import torch

from .config import ModelConfig
from .config_hf import GEMMA4_TYPES, LLAMA4_TYPES, WRAPPERS, read_hf_config
from .expert_parallel import NO_EP, ExpertParallel
from .tensor_parallel import NO_TP, TensorParallel
from .weights import WeightFiller, WeightPiece, empty_model, mlp_rows, qkv_rows, tp_take, unpermute_rotary_rows
from .weights_gptoss import GptOssExperts
from .weights_hybrid import HybridTensors, hybrid_pieces

INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that are not parameters (older Llama saves kept RoPE's inv_freq).
_NOT_PARAMETERS_SUFFIXES = (".rotary_emb.inv_freq",)


class ExpertNames(NamedTuple):
    """How a family's checkpoints name a layer's mixture of experts: model.layers.{i}.{block}.{router}
    [E, dim] and model.layers.{i}.{block}.experts.{e}.{gate|up|down}.weight, each expert's 2-D
    matrices ([F, dim], [F, dim], [dim, F])."""

    block: str
    router: str
    gate: str
    up: str
    down: str
    shared: str = "shared_expert"
    """The shared expert's module: model.layers.{i}.{block}.{shared}.{gate|up|down}_proj.weight (Llama 4)."""


EXPERT_NAMES = {"mixtral": ExpertNames("block_sparse_moe", "gate", "w1", "w3", "w2"),
                "qwen3_moe": ExpertNames("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
                "llama4_text": ExpertNames("feed_forward", "router", "gate_proj", "up_proj", "down_proj"),
                "gpt_oss": ExpertNames("mlp", "router", "gate", "up", "down")}
"""model_type -> its expert tensors' names, as the published checkpoints have them and as
transformers 5.25's save_pretrained writes them by default (it converts its fused in-memory
tensors back to these per-expert ones; `fused_expert_parts` reads the fused ones too). gpt-oss's
checkpoints hold fused tensors only (`GPT_OSS_EXPERTS`); its per-expert names are ringctx's own,
the parts weights_gptoss.py's `GptOssExperts` cuts those into, with `.bias` parts for the
experts' biases."""

_FUSED_EXPERTS = re.compile(r"(model\.layers\.(\d+))\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def fused_expert_parts(name: str, config: ModelConfig, names: ExpertNames
                       ) -> tuple[tuple[int, ...], list[tuple[str, tuple]]] | None:
    """For a layer's experts as transformers 5 holds them in memory and saves them with
    save_pretrained(save_original_format=False) (and when offloaded): mlp.gate.weight [E, dim],
    mlp.experts.gate_up_proj [E, 2F, dim] (each expert's gate rows, then its up rows) and
    mlp.experts.down_proj [E, dim, F]: (the shape the config needs, [(the per-expert tensor it
    holds (`names`' naming), its index in the fused tensor)]). None for any other tensor, or one on
    a layer without experts."""
    match = _FUSED_EXPERTS.match(name)
    layer = int(match.group(2)) if match else config.n_layers
    experts = config.experts(layer) if layer < config.n_layers else None
    if experts is None:
        return None
    stem, what = f"{match.group(1)}.{names.block}", match.group(3)
    E, F = experts.n_experts, experts.expert_ffn_dim
    if what == "gate.weight":
        return (E, config.dim), [(f"{stem}.{names.router}.weight", ())]
    if what == "experts.down_proj":
        return (E, config.dim, F), [(f"{stem}.experts.{e}.{names.down}.weight", (e,)) for e in range(E)]
    return (E, 2 * F, config.dim), [(f"{stem}.experts.{e}.{which}.weight", (e, rows)) for e in range(E)
                                    for which, rows in ((names.gate, slice(0, F)), (names.up, slice(F, 2 * F)))]


_LLAMA4_EXPERTS = re.compile(r"(model\.layers\.(\d+))\.feed_forward\.experts\.(gate_up_proj|down_proj)$")


def llama4_expert_parts(name: str, config: ModelConfig) -> tuple[tuple[int, ...], list[tuple[str, tuple]]] | None:
    """As `fused_expert_parts`, for Llama 4's experts as its checkpoints (and transformers 5.25's
    save_pretrained) store them, transposed relative to Qwen3-MoE's: feed_forward.experts.gate_up_proj
    [E, dim, 2F] (x @ gate_up: each expert's gate columns, then its up columns) and
    feed_forward.experts.down_proj [E, F, dim]. Each part's index cuts one expert's matrix, which
    its transpose turns into EXPERT_NAMES["llama4_text"]'s [F, dim] / [dim, F] (`_fill_fused_experts`
    with transposed=True). None for any other tensor, or one on a layer without experts."""
    match = _LLAMA4_EXPERTS.match(name)
    layer = int(match.group(2)) if match else config.n_layers
    experts = config.experts(layer) if layer < config.n_layers else None
    if experts is None:
        return None
    stem, names = f"{match.group(1)}.feed_forward", EXPERT_NAMES["llama4_text"]
    E, F = experts.n_experts, experts.expert_ffn_dim
    if match.group(3) == "down_proj":
        return (E, F, config.dim), [(f"{stem}.experts.{e}.{names.down}.weight", (e,)) for e in range(E)]
    return (E, config.dim, 2 * F), [(f"{stem}.experts.{e}.{which}.weight", (e, slice(None), cols)) for e in range(E)
                                    for which, cols in ((names.gate, slice(0, F)), (names.up, slice(F, 2 * F)))]


def expected_hf_tensors(config: ModelConfig, tp: TensorParallel = NO_TP,
                        mlp: str = "mlp", experts: ExpertNames = EXPERT_NAMES["qwen3_moe"]) -> dict[str, WeightPiece]:
    """Hugging Face tensor name -> where it goes (Llama / Mistral / Qwen2 / Qwen3 / Seed-OSS /
    Gemma 3 / Llama 4 naming, text models of image-text checkpoints renamed by `text_tensor_name`),
    and which slice of it TP rank `tp.rank` holds. `config` is the whole model's. Phi-3's fused
    qkv_proj and gate_up_proj appear here as their parts (`FUSED_PARTS`), each read from its rows
    of the file's tensor by `load_hf_weights`. mlp: the MLP's module name ("feed_forward" in
    Llama 4's dense layers); experts: the names of a mixture of experts' tensors (`EXPERT_NAMES`), each
    expert's matrices going to its slab of the layer's 3-D parameters."""
    pieces: dict[str, WeightPiece] = {}
    local = tp.shard_config(config)

    def add(hf_name: str, param: str, rows=None, kind: str = "", layer: int | None = None, expert=None):
        pieces[hf_name] = WeightPiece(param, rows, hf_name, tp_take(config, tp, kind, layer), expert)

    add("model.embed_tokens.weight", "tok_embeddings.weight", kind="vocab")
    add("model.norm.weight", "norm.weight")
    if not config.tie_embeddings:
        add("lm_head.weight", "output.weight", kind="vocab")
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        add(f"{hf}.input_layernorm.weight", f"{ours}.attention_norm.weight")
        if config.has_linear or config.attn_output_gate:  # Qwen3.5 / Qwen3-Next (weights_hybrid.py)
            pieces.update(hybrid_pieces(config, local, i, hf, ours))
        if config.post_norms:  # Gemma: post_attention_layernorm norms the attention output
            add(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_attention_norm.weight")
            add(f"{hf}.pre_feedforward_layernorm.weight", f"{ours}.ffn_norm.weight")
            add(f"{hf}.post_feedforward_layernorm.weight", f"{ours}.post_ffn_norm.weight")
        else:
            add(f"{hf}.post_attention_layernorm.weight", f"{ours}.ffn_norm.weight")
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            for which in () if config.linear(i) is not None else "kv" if config.attn_output_gate else "qkv":
                add(f"{hf}.self_attn.{which}_proj.{kind}", f"{ours}.attention.wqkv.{kind}", qkv_rows(local, which, i),
                    which, i)
        if config.linear(i) is None:
            add(f"{hf}.self_attn.o_proj.weight", f"{ours}.attention.wo.weight", kind="o", layer=i)
        if config.qk_norm and config.linear(i) is None:  # [head_dim], shared by all heads: every TP rank reads it whole
            add(f"{hf}.self_attn.q_norm.weight", f"{ours}.attention.q_norm.weight")
            add(f"{hf}.self_attn.k_norm.weight", f"{ours}.attention.k_norm.weight")
        if config.attn_out_bias:
            add(f"{hf}.self_attn.o_proj.bias", f"{ours}.attention.wo.bias")
        if config.layer_scalars:  # Gemma 4: [1], replicated
            add(f"{hf}.layer_scalar", f"{ours}.layer_scalar")
        if config.attention(i).sinks:  # [Hq]: by query heads under TP
            add(f"{hf}.self_attn.sinks", f"{ours}.attention.sinks", kind="sinks")
        if config.experts(i) is not None and config.experts(i).beside_dense:  # Gemma 4 26B-A4B
            pieces.update(gemma4_moe_pieces(config, tp, i))
            continue
        if config.experts(i) is not None:  # the router replicated, each expert's rows / columns split under TP
            moe, ff = f"{hf}.{experts.block}", f"{ours}.feed_forward"
            add(f"{moe}.{experts.router}.weight", f"{ff}.router.weight")
            if config.experts(i).router_bias:
                add(f"{moe}.{experts.router}.bias", f"{ff}.router.bias")
            biases = ("weight", "bias") if config.experts(i).bias else ("weight",)
            for e in range(config.experts(i).n_experts):
                for kind in biases:  # biases: gate and up units split as their rows; the down bias whole
                    for which, name in (("gate", experts.gate), ("up", experts.up)):
                        add(f"{moe}.experts.{e}.{name}.{kind}", f"{ff}.{'w13' if kind == 'weight' else 'b13'}",
                            mlp_rows(local, which, i), f"expert_{which}", i, e)
                    add(f"{moe}.experts.{e}.{experts.down}.{kind}", f"{ff}.{'w2' if kind == 'weight' else 'b2'}",
                        None, "expert_down" if kind == "weight" else "", i, e)
            shared = config.experts(i).shared_ffn_dim and local.experts(i).shared_ffn_dim
            for which in ("gate", "up") if shared else ():  # the shared expert: the dense MLP's layout
                add(f"{moe}.{experts.shared}.{which}_proj.weight", f"{ff}.shared_w13",
                    (0, shared) if which == "gate" else (shared, 2 * shared), f"shared_{which}", i)
            if shared:
                add(f"{moe}.{experts.shared}.down_proj.weight", f"{ff}.shared_w2", None, "shared_down", i)
            if config.experts(i).shared_gate:  # [1, dim], replicated
                add(f"{moe}.{experts.shared}_gate.weight", f"{ff}.shared_gate")
            continue
        add(f"{hf}.{mlp}.gate_proj.weight", f"{ours}.feed_forward.w13.weight", mlp_rows(local, "gate"), "gate")
        add(f"{hf}.{mlp}.up_proj.weight", f"{ours}.feed_forward.w13.weight", mlp_rows(local, "up"), "up")
        add(f"{hf}.{mlp}.down_proj.weight", f"{ours}.feed_forward.w2.weight", kind="down")
    return pieces


def gemma4_moe_pieces(config: ModelConfig, tp: TensorParallel, i: int) -> dict[str, WeightPiece]:
    """Layer i's feed-forward tensors of a Gemma 4 26B-A4B checkpoint (experts beside the dense MLP):
    mlp.{gate,up,down}_proj (the dense MLP), post_feedforward_layernorm_1, pre_feedforward_layernorm_2,
    post_feedforward_layernorm_2, router.proj.weight [E, dim], router.scale [dim],
    router.per_expert_scale [E] (replicated under TP), and experts.gate_up_proj [E, 2F, dim] and
    experts.down_proj [E, dim, F], fused as transformers saves them: these two appear here as
    one piece per expert and half (`gemma4_expert_parts` names them), each with the fused tensor's
    name as its source, so that a missing one is named as the checkpoint names it."""
    pieces: dict[str, WeightPiece] = {}
    local = tp.shard_config(config)
    hf, ours = f"model.layers.{i}", f"layers.{i}"

    def add(name: str, param: str, rows=None, kind: str = "", layer: int | None = None, expert=None, source=None):
        pieces[name] = WeightPiece(param, rows, source or name, tp_take(config, tp, kind, layer), expert)

    add(f"{hf}.mlp.gate_proj.weight", f"{ours}.dense_mlp.w13.weight", mlp_rows(local, "gate"), "gate")
    add(f"{hf}.mlp.up_proj.weight", f"{ours}.dense_mlp.w13.weight", mlp_rows(local, "up"), "up")
    add(f"{hf}.mlp.down_proj.weight", f"{ours}.dense_mlp.w2.weight", kind="down")
    for theirs, norm in (("post_feedforward_layernorm_1", "post_dense_norm"),
                         ("pre_feedforward_layernorm_2", "pre_experts_norm"),
                         ("post_feedforward_layernorm_2", "post_experts_norm")):
        add(f"{hf}.{theirs}.weight", f"{ours}.{norm}.weight")
    ff = f"{ours}.feed_forward"
    add(f"{hf}.router.proj.weight", f"{ff}.router.weight")
    add(f"{hf}.router.scale", f"{ff}.router_scale")
    add(f"{hf}.router.per_expert_scale", f"{ff}.per_expert_scale")
    gate_up, down = f"{hf}.experts.gate_up_proj", f"{hf}.experts.down_proj"
    for e in range(config.experts(i).n_experts):
        for which in ("gate", "up"):
            add(f"{gate_up}[{e}].{which}", f"{ff}.w13", mlp_rows(local, which, i), f"expert_{which}", i, e, gate_up)
        add(f"{down}[{e}]", f"{ff}.w2", None, "expert_down", i, e, down)
    return pieces


_GEMMA4_EXPERTS = re.compile(r"model\.layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")


def gemma4_expert_parts(name: str, config: ModelConfig, source: str
                        ) -> tuple[tuple[int, ...], list[tuple[str, tuple]]] | None:
    """For a Gemma 4 checkpoint's fused experts.gate_up_proj [E, 2F, dim] (each expert's gate rows,
    then its up rows) or experts.down_proj [E, dim, F]: (the shape the config needs, [(the piece
    `gemma4_moe_pieces` names, its index in the fused tensor)]), as `fused_expert_parts`; None for
    any other tensor. A layer the config gives no experts is a ValueError naming the tensor."""
    match = _GEMMA4_EXPERTS.match(name)
    if match is None:
        return None
    layer = int(match.group(1))
    experts = config.experts(layer) if layer < config.n_layers else None
    if experts is None or not experts.beside_dense:
        raise ValueError(f"{source}: tensor {name!r} holds experts of layer {layer}, but the config gives that "
                         "layer none (enable_moe_block is not true, or the layer count differs); the weights do not "
                         "match the config")
    E, F = experts.n_experts, experts.expert_ffn_dim
    if match.group(2) == "down_proj":
        return (E, config.dim, F), [(f"{name}[{e}]", (e,)) for e in range(E)]
    return (E, 2 * F, config.dim), [(f"{name}[{e}].{which}", (e, rows)) for e in range(E)
                                    for which, rows in (("gate", slice(0, F)), ("up", slice(F, 2 * F)))]


FUSED_PARTS = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
               "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
"""Phi-3's fused tensors (name suffix) -> the tensors they stack by rows, in order: q, k, v heads;
gate then up (transformers' Phi3MLP chunks gate_up in two, gate first)."""

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
"""Image-text checkpoints' text-model prefixes -> the causal LM's: transformers 5 saves
Mistral3/Gemma3ForConditionalGeneration as model.language_model.* (+ lm_head.*), the checkpoints
published before it as language_model.model.* (+ language_model.lm_head.*)."""

_NOT_TEXT_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
                      "model.vision_model.", "vision_model.", "model.embed_vision.", "model.audio_tower.",
                      "model.embed_audio.", "model.visual.", "visual.", "mtp.")
"""Tensors of an image-text checkpoint's vision side (Qwen3.5's: model.visual.*), and Qwen3.5 /
Qwen3-Next's multi-token-prediction head (mtp.*, a speculative-decoding extra): ringctx runs the
text model only, these are skipped."""


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name as the causal LM's (image-text checkpoints' text model renamed),
    or None for a vision tensor ringctx skips."""
    if name.startswith(_NOT_TEXT_PREFIXES):
        return None
    for prefix, causal in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return causal + name[len(prefix):]
    return name


def fused_parts(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """For a fused tensor (Phi-3's qkv_proj / gate_up_proj), its parts: [(part's name, first row,
    row after the last)] in the file's tensor; None for any other tensor."""
    for suffix, parts in FUSED_PARTS.items():
        if name.endswith("." + suffix):
            stem = name[: -len(suffix)]
            D = config.head_dim
            sizes = ([config.n_heads * D, config.n_kv_heads * D, config.n_kv_heads * D]
                     if suffix.startswith("self_attn") else [config.ffn_dim, config.ffn_dim])
            out, start = [], 0
            for part, size in zip(parts, sizes):
                out.append((stem + part, start, start + size))
                start += size
            return out
    return None


def safetensors_files(directory: str) -> list[str]:
    """The weight files of a checkpoint directory, from its index if it has one."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e}); "
                             "re-download or re-save the model") from None
        files = [os.path.join(directory, name) for name in dict.fromkeys(weight_map.values())]
        absent = [p for p in files if not os.path.isfile(p)]
        if absent:
            raise FileNotFoundError(f"{index} lists {len(absent)} missing weight file(s), e.g. {absent[0]}; "
                                    "the download is incomplete")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        hint = " (PyTorch .bin checkpoints are not supported: convert them to safetensors)" if glob.glob(
            os.path.join(directory, "*.bin")) else ""
        raise FileNotFoundError(f"{directory}: no *.safetensors weight files{hint}")
    return files


def text_config_dict(directory: str) -> dict:
    """config.json as a dict, the text model's (`text_config`) for an image-text wrapper (`WRAPPERS`)."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        d = json.load(f)
    return dict(d.get("text_config") or {}) if d.get("model_type") in WRAPPERS else d


def keys_as_values(text: dict, config: ModelConfig) -> dict[str, str]:
    """Gemma 4 with attention_k_eq_v: its full-attention layers have no v_proj, their values are
    the k projection's output (before k's norm and RoPE; v then gets its own weightless norm).
    ringctx's fused projection keeps v rows, so those layers' k_proj tensors fill them too (an
    exact copy): {k_proj name: v_proj name}, weights and biases."""
    if text.get("model_type") not in GEMMA4_TYPES or not text.get("attention_k_eq_v"):
        return {}
    return {f"model.layers.{i}.self_attn.k_proj.{kind}": f"model.layers.{i}.self_attn.v_proj.{kind}"
            for i in range(config.n_layers) if not config.attention(i).window for kind in ("weight", "bias")}


ROTARY_PROJECTIONS = tuple(f".self_attn.{which}_proj.{kind}" for which in "qk" for kind in ("weight", "bias"))
"""Name endings of the tensors whose rows RoPE rotates: q and k projections (weights, biases)."""


def permute_interleaved_rotary(value: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A Llama 4 q or k projection's rows (weight or bias, this TP rank's whole heads) [H * head_dim,
    ...] -> the same in ringctx's order.

    Llama 4 rotates each head's dims (2i, 2i+1) as a pair (complex multiplication); ringctx's RoPE
    (every path: PyTorch, the C and Triton kernels) rotates (i, i + D/2). Reordering each head's
    rows of q_proj and k_proj from (0, 1, 2, ..., D-1) to (0, 2, ..., D-2, 1, 3, ..., D-1) makes
    that rotation Llama 4's exactly: pair i keeps its frequency, and q.k, the weightless q/k norm
    and the query temperature do not depend on the order of a head's dims, which q and k share
    (v and the output are untouched). llama.cpp's Llama conversion keeps the same order in GGUF
    files (weights_gguf.py undoes it the same way). Every layer is permuted, NoPE ones too (a
    no-op for their scores), so that one rule covers the checkpoint."""
    return unpermute_rotary_rows(value, value.shape[0] // head_dim)


def load_hf_weights(model, directory: str) -> None:
    """Fill `model` (built from this directory's config.json) with its safetensors tensors (Llama 4's
    q/k rows reordered: `permute_interleaved_rotary`)."""
    from safetensors import safe_open

    config = model.full_config
    text = text_config_dict(directory)
    llama4 = text.get("model_type") in LLAMA4_TYPES
    as_values = keys_as_values(text, config)
    expert_names = EXPERT_NAMES.get(text.get("model_type"), EXPERT_NAMES["qwen3_moe"])
    gpt_oss = GptOssExperts(config, directory) if text.get("model_type") == "gpt_oss" else None
    filler = WeightFiller(model, directory, expected_hf_tensors(
        config, model.tp, mlp="feed_forward" if llama4 else "mlp", experts=expert_names))
    hybrid = HybridTensors(config, model.tp, filler) if config.has_linear or config.attn_output_gate else None
    for path in safetensors_files(directory):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError for a bad header, OSError...
            raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); it is "
                             "truncated or corrupt, re-download it") from None
        with handle:
            for file_name in handle.keys():
                name = text_tensor_name(file_name)
                if name is None or name.endswith(_NOT_PARAMETERS_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_embeddings:
                    continue  # some saves write the tied head too; it equals the embedding
                shape = tuple(handle.get_slice(file_name).get_shape())
                if gpt_oss is not None and gpt_oss.take(handle, path, file_name, shape, filler):
                    continue
                if hybrid is not None and hybrid.take(handle, path, name, shape, file_name):
                    continue
                fused = None if name in filler.expected else (
                    llama4_expert_parts(name, config) if llama4 else
                    fused_expert_parts(name, config, expert_names) or gemma4_expert_parts(name, config, directory))
                if fused is not None:
                    _fill_fused_experts(handle, path, file_name, shape, *fused, filler, transposed=llama4)
                    continue
                parts = fused_parts(name, config)
                if parts is not None and shape and shape[0] != parts[-1][2]:
                    raise ValueError(f"{directory}: tensor {file_name!r} has shape {shape}, but the model config "
                                     f"needs {parts[-1][2]} rows; the weights do not match the config")
                for part, start, stop in parts or [(name, 0, None)]:
                    if part not in filler.expected:
                        _check_expert_count(part, config, directory)
                    piece = filler.piece(part)
                    filler.check_shape(piece, shape if stop is None else (stop - start, *shape[1:]))
                    if not filler.holds(piece):  # an expert another EP rank holds: not read
                        filler.skip(piece)
                        continue
                    try:  # a TP rank reads only its slice of the memory-mapped file
                        value = _read(handle, file_name, piece, start, stop)
                    except Exception as e:
                        raise ValueError(f"{path}: cannot read tensor {file_name!r} ({type(e).__name__}: {e}); the "
                                         "file is truncated or corrupt, re-download it") from None
                    if llama4 and part.endswith(ROTARY_PROJECTIONS):
                        value = permute_interleaved_rotary(value, config.head_dim)  # Llama 4: one head shape
                    filler.put(piece, value)
                    if part in as_values:  # the same rows, TP slice included (k's and v's are both by KV heads)
                        filler.put(filler.piece(as_values[part]), value)
                    del value
    if gpt_oss is not None:
        gpt_oss.finish()
    filler.finish()


_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.")


def _check_expert_count(name: str, config: ModelConfig, directory: str) -> None:
    """A ValueError naming the count for an expert tensor the config has no place for (an expert
    past the layer's count, or experts on a layer the config makes dense); other names pass."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return
    layer, expert = int(match.group(1)), int(match.group(2))
    experts = config.experts(layer) if layer < config.n_layers else None
    what = "has a dense MLP" if experts is None else f"has {experts.n_experts} experts (0..{experts.n_experts - 1})"
    raise ValueError(f"{directory}: tensor {name!r} is expert {expert} of layer {layer}, but the config's layer "
                     f"{layer} {what}; the expert count (num_local_experts / num_experts, decoder_sparse_step, "
                     "mlp_only_layers) does not match the weights")


def _fill_fused_experts(handle, path: str, name: str, shape: tuple[int, ...], needed: tuple[int, ...],
                        parts: list[tuple[str, tuple]], filler: WeightFiller, transposed: bool = False) -> None:
    """Fill a layer's expert (or router) parameter from one fused tensor `name` of shape `shape`
    (`fused_expert_parts`: the shape the config needs, each part's name and index), one expert's
    matrix at a time (transposed: each part's matrix transposed first, `llama4_expert_parts`), each
    cut to this TP rank's share."""
    if shape != needed:
        raise ValueError(f"{filler.source}: tensor {name!r} has shape {shape}, but the model config needs {needed} "
                         "(experts, their width, the model width); the weights do not match the config")
    for part, index in parts:
        piece = filler.piece(part)
        if not filler.holds(piece):  # an expert another EP rank holds: not read
            filler.skip(piece)
            continue
        try:
            value = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{path}: cannot read tensor {name!r} ({type(e).__name__}: {e}); the file is "
                             "truncated or corrupt, re-download it") from None
        value = value.T if transposed else value
        filler.put(piece, value if piece.take is None else value[piece.take.index()])


def _read(handle, name: str, piece: WeightPiece, start: int, stop: int | None) -> torch.Tensor:
    """The values of `piece` from tensor `name` of an open safetensors file: all of it (stop None)
    or its rows start..stop-1 (a fused tensor's part), cut to the piece's TP slice (rows or columns)."""
    if stop is None:
        return handle.get_tensor(name) if piece.take is None else handle.get_slice(name)[piece.take.index()]
    take = piece.take
    if take is None:
        return handle.get_slice(name)[start:stop]
    if take.dim == 0:
        return handle.get_slice(name)[start + take.start:start + take.stop]
    return handle.get_slice(name)[start:stop][take.index()]


def load_hf(directory: str | os.PathLike, *, dtype: torch.dtype | None, device, name: str | None = None,
            tp: TensorParallel = NO_TP, adjust_config=None, ep: ExpertParallel = NO_EP):
    """Config and model (this TP rank's shard under `tp`) from a Hugging Face directory:
    (ModelConfig, Transformer with its weights). adjust_config(config) -> the config the model is
    built with (loader.py's --rope-scaling), or None.

    dtype None: the checkpoint's `torch_dtype`/`dtype` from config.json (float32 if absent).
    """
    directory = os.fspath(directory)
    config = read_hf_config(directory, name=name)
    if adjust_config is not None:
        config = adjust_config(config)
    if dtype is None:
        dtype = checkpoint_dtype(directory)
    model = empty_model(config, dtype=dtype, device=device, tp=tp, ep=ep)
    if torch.device(device).type != "meta":
        load_hf_weights(model, directory)
    return config, model


def checkpoint_dtype(directory: str) -> torch.dtype:
    """The dtype config.json says the weights are stored in (float32 if it does not say)."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        d = json.load(f)
    name = d.get("torch_dtype") or d.get("dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
