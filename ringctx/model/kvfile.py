"""KV cache files: a prefilled prompt saved to disk and loaded back for more questions.

Format: one safetensors file (no pickle) holding
    k.{layer}, v.{layer}   [length, Hkv, D] in the model's dtype, rows in sequence order
    token_ids              [length] int64
and string metadata: format version, ringctx version, model fingerprint (shapes), weights digest,
dtype, length, a SHA-256 over all tensor bytes, and caller fields (e.g. the chat frame of a
document). Files are written to a temporary name and renamed, so a crash never leaves half a file;
loading checks the format, the model, the shapes and the checksum, and names the file and the
problem in the error.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from .kvcache import KVCache

FORMAT = "ringctx-kv/1"


def weights_digest(model) -> str:
    """A hash of a few weight slices: cheap, and different for different checkpoints or seeds.

    Always the whole model's: a tensor-parallel shard returns the digest `share_weights_digest`
    computed with its TP group, so a cache saved under one TP size loads under another."""
    if model.tp.size > 1:
        digest = getattr(model, "full_weights_digest", None)
        if digest is None:
            raise RuntimeError("a tensor-parallel shard's weights digest needs share_weights_digest(model) on "
                               "every TP rank first")
        return digest
    return _digest(model.tok_embeddings.weight, last_attention(model).wo.weight, model.norm.weight)


def last_attention(model):
    """The last attention layer's Attention (a hybrid's last layer may be a linear one)."""
    return next(block.attention for block in reversed(model.layers) if block.attention is not None)


def _digest(embedding: torch.Tensor, wo: torch.Tensor, norm: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (embedding, wo, norm):
        h.update(t.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def share_weights_digest(model) -> str:
    """The whole model's `weights_digest`, computed by every TP rank of a shard together, and kept
    on the model: the embedding rows it reads are split by vocabulary over the ranks, the rows of
    the last wo by columns."""
    tp = model.tp
    embedding = _gather_over_tp(model.tok_embeddings.weight, tp, dim=0)
    wo = _gather_over_tp(last_attention(model).wo.weight, tp, dim=1)
    model.full_weights_digest = _digest(embedding, wo, model.norm.weight)
    return model.full_weights_digest


def _gather_over_tp(weight: torch.Tensor, tp, dim: int) -> torch.Tensor:
    """The first rows of a weight split over the TP ranks along `dim` (rows 0, columns 1), put back
    together: enough whole rows of the whole weight for the 4096 values `_digest` reads."""
    full_cols = weight.shape[1] * (tp.size if dim == 1 else 1)
    rows = -(-4096 // full_cols)
    mine = weight[:rows].float()
    padded = mine.new_zeros(rows, weight.shape[1])
    padded[:mine.shape[0]] = mine
    pieces = tp.all_gather(padded)
    counts = tp.all_gather(torch.tensor([mine.shape[0]], device=weight.device))
    if dim == 1:  # every rank has the same rows (a weight with fewer than `rows`: all of them, no padding)
        return torch.cat(pieces, dim=1)[:mine.shape[0]]
    return torch.cat([p[:int(c)] for p, c in zip(pieces, counts)])[:rows]


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_kv_cache(path: str | os.PathLike, cache: KVCache, model, token_ids: torch.Tensor,
                  extra: dict | None = None) -> None:
    """Write the first `cache.length` rows of every layer and the token ids to `path` atomically."""
    from safetensors.torch import save_file

    from ..version import __version__

    length = cache.length
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).cpu()
    if token_ids.numel() != length:
        raise ValueError(f"save_kv_cache: the cache holds {length} tokens but {token_ids.numel()} token ids were given")
    cache.check_model(model.full_config)
    if cache.trimmed:
        raise ValueError("save_kv_cache: the cache's windowed or chunked layers dropped rows, which this single-file "
                         "format cannot say; save it as a document directory (Engine.save_document)")
    tensors = {"token_ids": token_ids}
    for layer in range(cache.n_layers):
        tensors[f"k.{layer}"] = cache.k[layer][:length].cpu().contiguous()
        tensors[f"v.{layer}"] = cache.v[layer][:length].cpu().contiguous()
    metadata = {
        "format": FORMAT, "ringctx_version": __version__, "model": model.full_config.name,
        "model_fingerprint": model.full_config.fingerprint(), "weights_digest": weights_digest(model),
        "dtype": str(cache.dtype).removeprefix("torch."), "length": str(length), "n_layers": str(cache.n_layers),
        "sha256": _checksum(tensors), "extra": json.dumps(extra or {}),
    }
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_made_with(what: str, meta: dict, model) -> None:
    """ValueError unless a saved cache (`meta`: dtype, model, model_fingerprint, weights_digest) was
    made with this model, weights and dtype; `what` names the file in the message."""
    dtype = str(model.dtype).removeprefix("torch.")
    if meta["dtype"] != dtype:
        raise ValueError(f"{what} holds {meta['dtype']} K/V but the model runs in {dtype}; load the model with "
                         f"dtype={meta['dtype']!r}")
    config = model.full_config  # a tensor-parallel shard checks against the whole model
    if meta["model_fingerprint"] != config.fingerprint() or meta["weights_digest"] != weights_digest(model):
        raise ValueError(f"{what} was made with model {meta.get('model')!r} "
                         f"(fingerprint {meta['model_fingerprint']}, weights {meta['weights_digest']}), not with the "
                         f"loaded {config.name!r} ({config.fingerprint()}, {weights_digest(model)}); "
                         "load the model it was made with, or ingest the document again")


def load_kv_cache(path: str | os.PathLike, model, *, room: int = 256) -> tuple[KVCache, torch.Tensor, dict]:
    """Load a KV file saved for `model`; returns (cache with `room` free rows, token_ids, extra).

    Raises ValueError naming the file when it is missing, truncated, altered, of another format,
    or made with another model, other weights or another dtype.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    meta = read_kv_metadata(path)  # format and header first: cheap, clear errors
    check_made_with(f"KV file {path!r}", meta, model)
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated data
        raise ValueError(f"KV file {path!r} is truncated or corrupt ({exc}); save it again") from None
    length, n_layers = int(meta["length"]), int(meta["n_layers"])
    expected = {"token_ids"} | {f"{kv}.{i}" for kv in "kv" for i in range(n_layers)}
    if set(tensors) != expected or tensors["token_ids"].numel() != length:
        raise ValueError(f"KV file {path!r} has unexpected tensors; it was altered or written by another tool")
    if _checksum(tensors) != meta["sha256"]:
        raise ValueError(f"KV file {path!r} fails its checksum: its contents were altered after saving")
    device = model.device
    cache = KVCache.from_tensors([tensors[f"k.{i}"].to(device) for i in range(n_layers)],
                                 [tensors[f"v.{i}"].to(device) for i in range(n_layers)],
                                 length=length, max_tokens=length + room)
    cache.check_model(model.config)
    return cache, tensors["token_ids"], json.loads(meta.get("extra") or "{}")


def read_kv_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a KV file (without loading its tensors); ValueError if unreadable."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"KV file {path!r} does not exist; create it with `ringctx ingest FILE --save {path}`")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
        raise ValueError(f"KV file {path!r} is truncated or corrupt ({exc}); save it again") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"KV file {path!r} is not a ringctx KV cache (format {meta.get('format')!r}, expected {FORMAT!r})")
    return meta
