"""Llama-family decoder, GGUF and safetensors weights, tokenizer, static KV cache, decode loop.

    from ringctx.model import load_model
    model = load_model()                          # embedded SmolLM2-135M-Instruct
    print(model.generate("What is 2+2?", chat=True, max_new_tokens=32).text)

The decoder takes its attention as a callable (`Transformer.forward(token_ids, positions, attend)`)
so that the prefill engine can plug in ring attention; `KVCache` and `forward_with_cache` give the
single-device default. This package never imports ringctx.parallel or ringctx.engine.
"""

from .generate import GenerationResult, Sampler, generate, sequence_logits, stream
from .kvcache import CachedAttend, KVCache, forward_with_cache
from .loader import DEFAULT_MODEL, embedded_gguf_path, load_model, resolve_dtype
from .tokenizer import IncrementalDecoder, encode_prompt, load_tokenizer
from .transformer import Attend, Block, RopeAngles, Transformer, apply_rotary, check_token_ids
from .weights_gguf import dequantize_tensor, load_gguf, unpermute_rotary_rows
from .weights_hf import load_hf

__all__ = [
    "Attend", "Block", "CachedAttend", "DEFAULT_MODEL", "GenerationResult", "IncrementalDecoder", "KVCache",
    "RopeAngles", "Sampler", "Transformer", "apply_rotary", "check_token_ids", "dequantize_tensor",
    "embedded_gguf_path", "encode_prompt", "forward_with_cache", "generate", "load_gguf", "load_hf",
    "load_model", "load_tokenizer", "resolve_dtype", "sequence_logits", "stream", "unpermute_rotary_rows",
]
