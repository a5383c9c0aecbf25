"""Files written whole or not at all: what a crash, a kill or a full disk leaves is the old file or
the new one, never a part of the new one."""

from __future__ import annotations

import json
import os
import tempfile


def write_json_atomically(path, data, *, indent: int | None = None) -> None:
    """`data` as JSON at `path`: a temporary file beside it, fsync, rename (removed on failure)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".record-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
