"""Where ringctx's kernel sources are: one lookup for the C kernels (kernels/build.py builds them
with the system compiler) and the CUDA ones (attention/cuda_ext.py builds them with torch's
extension builder), so that both find the same copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence


def csrc_dir(files: Sequence[str]) -> Path | None:
    """Where the kernel sources `files` are: $RINGCTX_CSRC_DIR, ringctx/csrc (an installed
    package), or csrc/ at the repository root (a source checkout). None when none has them all."""
    package = Path(__file__).resolve().parents[1]  # ringctx/
    candidates = [os.environ.get("RINGCTX_CSRC_DIR"), package / "csrc", package.parent / "csrc"]
    for c in candidates:
        if c and all((Path(c) / s).is_file() for s in files):
            return Path(c)
    return None
