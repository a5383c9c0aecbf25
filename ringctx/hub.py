"""Model names as transformers and vLLM users type them: `ORG/NAME`, found in the local Hugging
Face cache.

    >>> resolve_cached_model("Qwen/Qwen3-8B")          # doctest: +SKIP
    '/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/<revision>'

ringctx never downloads: the lookup is huggingface_hub's own (`snapshot_download` with
`local_files_only=True`, so HF_HOME / HF_HUB_CACHE choose the cache, `refs/main` the revision,
and HF_HUB_OFFLINE changes nothing: no request is ever made). A model that is not cached is a
one-line error naming the cache searched and the command that fetches it.
"""

from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_repo_id(text: str) -> bool:
    """True for `ORG/NAME` (one slash, Hugging Face's characters) that is not an existing path."""
    return bool(_REPO_ID.match(text)) and not os.path.exists(text) and not text.endswith(".gguf")


def hub_cache_dir() -> str:
    """The cache directory huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/...)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_cached_model(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of Hugging Face model `repo_id` (e.g. "Qwen/Qwen3-8B").

    Raises FileNotFoundError (one line: the cache searched, how to fetch the model) when the model
    is not in the cache; never touches the network.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=cache)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache {cache} and ringctx never downloads: run "
            f"`huggingface-cli download {repo_id}` (on a machine with access; copy the cache here or point "
            "HF_HUB_CACHE / HF_HOME at it), or name a local directory, .gguf file or preset") from None


def local_model_path(name_or_path: str) -> str:
    """`name_or_path` itself, or for ORG/NAME (see looks_like_repo_id) its snapshot directory in the
    local cache (resolve_cached_model's error when it is not there): what every model loader reads."""
    return resolve_cached_model(name_or_path) if looks_like_repo_id(name_or_path) else name_or_path
