"""Hugging Face checkpoints: a directory with config.json and one or many *.safetensors files.

Sharded checkpoints are read through `model.safetensors.index.json` (or, without an index, every
*.safetensors file in the directory). Tensors are read one at a time with `safetensors.safe_open`
(memory-mapped) and copied straight into the model's parameters in the requested dtype.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from .config import ModelConfig
from .config_hf import read_hf_config
from .tensor_parallel import NO_TP, TensorParallel
from .weights import WeightFiller, WeightPiece, empty_model, mlp_rows, qkv_rows, tp_take

INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that are not parameters (older Llama saves kept RoPE's inv_freq).
_NOT_PARAMETERS_SUFFIXES = (".rotary_emb.inv_freq",)


def expected_hf_tensors(config: ModelConfig, tp: TensorParallel = NO_TP) -> dict[str, WeightPiece]:
    """Hugging Face tensor name -> where it goes (Llama / Mistral / Qwen2 / Qwen3 naming), and
    which slice of it TP rank `tp.rank` holds. `config` is the whole model's."""
    pieces: dict[str, WeightPiece] = {}
    local = tp.shard_config(config)

    def add(hf_name: str, param: str, rows=None, kind: str = ""):
        pieces[hf_name] = WeightPiece(param, rows, hf_name, tp_take(config, tp, kind))

    add("model.embed_tokens.weight", "tok_embeddings.weight", kind="vocab")
    add("model.norm.weight", "norm.weight")
    if not config.tie_embeddings:
        add("lm_head.weight", "output.weight", kind="vocab")
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        add(f"{hf}.input_layernorm.weight", f"{ours}.attention_norm.weight")
        add(f"{hf}.post_attention_layernorm.weight", f"{ours}.ffn_norm.weight")
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            for which in "qkv":
                add(f"{hf}.self_attn.{which}_proj.{kind}", f"{ours}.attention.wqkv.{kind}", qkv_rows(local, which),
                    which)
        add(f"{hf}.self_attn.o_proj.weight", f"{ours}.attention.wo.weight", kind="o")
        if config.qk_norm:  # [head_dim], shared by all heads: every TP rank reads it whole
            add(f"{hf}.self_attn.q_norm.weight", f"{ours}.attention.q_norm.weight")
            add(f"{hf}.self_attn.k_norm.weight", f"{ours}.attention.k_norm.weight")
        if config.attn_out_bias:
            add(f"{hf}.self_attn.o_proj.bias", f"{ours}.attention.wo.bias")
        add(f"{hf}.mlp.gate_proj.weight", f"{ours}.feed_forward.w13.weight", mlp_rows(local, "gate"), "gate")
        add(f"{hf}.mlp.up_proj.weight", f"{ours}.feed_forward.w13.weight", mlp_rows(local, "up"), "up")
        add(f"{hf}.mlp.down_proj.weight", f"{ours}.feed_forward.w2.weight", kind="down")
    return pieces


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


def load_hf_weights(model, directory: str) -> None:
    """Fill `model` (built from this directory's config.json) with its safetensors tensors."""
    from safetensors import safe_open

    config = model.full_config
    filler = WeightFiller(model, directory, expected_hf_tensors(config, model.tp))
    for path in safetensors_files(directory):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError for a bad header, OSError...
            raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); it is "
                             "truncated or corrupt, re-download it") from None
        with handle:
            for name in handle.keys():
                if name.endswith(_NOT_PARAMETERS_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_embeddings:
                    continue  # some saves write the tied head too; it equals the embedding
                piece = filler.piece(name)
                filler.check_shape(piece, tuple(handle.get_slice(name).get_shape()))
                try:  # a TP rank reads only its slice of the memory-mapped file
                    value = handle.get_tensor(name) if piece.take is None else \
                        handle.get_slice(name)[piece.take.index()]
                except Exception as e:
                    raise ValueError(f"{path}: cannot read tensor {name!r} ({type(e).__name__}: {e}); the file "
                                     "is truncated or corrupt, re-download it") from None
                filler.put(piece, value)
                del value
    filler.finish()


def load_hf(directory: str | os.PathLike, *, dtype: torch.dtype | None, device, name: str | None = None,
            tp: TensorParallel = NO_TP, adjust_config=None):
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
    model = empty_model(config, dtype=dtype, device=device, tp=tp)
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
