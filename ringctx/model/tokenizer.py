"""Tokenizers: transformers' AutoTokenizer from a model directory or a GGUF file, offline.

A tokenizer built from a GGUF file takes seconds (transformers converts the vocabulary and merges
stored in the header), so tokenizers are cached per file for the life of the process.

`encode_prompt` turns what a user passes as a prompt (text, chat messages, or token ids) into
token ids, applying the chat template where asked.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from typing import Any, Sequence

import torch


def load_tokenizer(path: str | os.PathLike, *, disk_cache: bool = True):
    """AutoTokenizer for a GGUF file or a Hugging Face directory, never reaching a model hub.

    Building a tokenizer from a GGUF header takes seconds, so the result is kept in memory for the
    process and, with `disk_cache`, saved as a regular tokenizer directory under
    $RINGCTX_CACHE_DIR (default ~/.cache/ringctx)/tokenizers/, keyed by the file's path, size and
    modification time; later loads read that instead (a fraction of a second). An unwritable
    cache directory only disables the disk cache.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory to load a tokenizer from")
    stat = os.stat(path)
    return _load_cached(path, stat.st_size, stat.st_mtime_ns, disk_cache and os.path.isfile(path))


def tokenizer_cache_dir(path: str, size: int, mtime_ns: int) -> str:
    """Where the disk cache keeps the tokenizer of the GGUF file `path`."""
    import transformers

    root = os.environ.get("RINGCTX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ringctx")
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{transformers.__version__}".encode()).hexdigest()[:24]
    return os.path.join(root, "tokenizers", f"{os.path.basename(path)}-{key}")


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, size: int, mtime_ns: int, disk_cache: bool):
    from transformers import AutoTokenizer

    if disk_cache:
        cached = tokenizer_cache_dir(path, size, mtime_ns)
        if os.path.isdir(cached):
            try:
                return AutoTokenizer.from_pretrained(cached, local_files_only=True)
            except Exception:  # a damaged cache entry: rebuild it below
                shutil.rmtree(cached, ignore_errors=True)
    try:
        if os.path.isdir(path):
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  local_files_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot build a tokenizer ({type(e).__name__}: {e}); a model directory needs "
                         "tokenizer.json or tokenizer.model (+ tokenizer_config.json), a GGUF file needs "
                         "tokenizer.ggml.* keys") from None
    if disk_cache:
        _save_quietly(tokenizer, cached)
    return tokenizer


def _save_quietly(tokenizer, directory: str) -> None:
    """Save into `directory` atomically (write a temporary sibling, then rename); ignore failures."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(directory), prefix=".tmp-")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, directory)  # fails if another process won the race: keep theirs
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


Prompt = Any
"""str | list of chat messages ({"role": ..., "content": ...}) | sequence of token ids | LongTensor [T]."""


def encode_prompt(tokenizer, prompt: Prompt, *, chat: bool | None = None, device=None) -> torch.Tensor:
    """Token ids [T] long for a prompt.

    Args:
        prompt: text; a list of chat messages; or token ids (used as they are).
        chat: apply the tokenizer's chat template (with the assistant turn opened). None: only for
            message lists. True with text: the text becomes one user message.
    """
    if isinstance(prompt, torch.Tensor):
        ids = prompt.reshape(-1).to(torch.long)
        return ids if device is None else ids.to(device)
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
        return torch.tensor(list(prompt), dtype=torch.long, device=device)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (a random-weight preset): pass token ids, not text")
    is_messages = isinstance(prompt, Sequence) and not isinstance(prompt, str)
    if chat is None:
        chat = is_messages
    if chat:
        messages = list(prompt) if is_messages else [{"role": "user", "content": str(prompt)}]
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass plain text with chat=False")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
    elif is_messages:
        raise ValueError("a list of chat messages needs chat=True (or None)")
    else:
        ids = tokenizer.encode(str(prompt))
    return torch.tensor(list(ids), dtype=torch.long, device=device)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character.

    Decodes a short window (from a few tokens before the last emitted text) instead of the whole
    sequence at every step, so streaming costs O(1) per token. A piece ending in U+FFFD (an
    incomplete multi-byte character) is held back until the next token completes it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens decoded only for context
        self.read_offset = 0  # tokens up to here have been emitted as text

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
