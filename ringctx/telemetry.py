"""Timers, memory readings and a Chrome/Perfetto trace of compute and communication.

Tracing is off unless a `Tracer` is active; `span(name, kind)` then costs one perf_counter pair.
The trace file opens in chrome://tracing or ui.perfetto.dev: one process row per rank, one thread
row for compute and one for communication.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time

_active: "Tracer | None" = None


class Tracer:
    """Collects complete ("X") trace events of one rank."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.events: list[dict] = []
        self.t0 = time.perf_counter()

    def add(self, name: str, kind: str, start: float, end: float, **args) -> None:
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": kind,
                            "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6, "args": args})

    def __enter__(self) -> "Tracer":
        global _active
        self._previous, _active = _active, self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._previous


@contextlib.contextmanager
def span(name: str, kind: str = "compute", **args):
    """Time a region into the active tracer (no-op when none is active)."""
    tracer = _active
    if tracer is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        tracer.add(name, kind, start, time.perf_counter(), **args)


def write_chrome_trace(path: str, events_per_rank: list[list[dict]]) -> None:
    """Write all ranks' events as one Chrome trace JSON file (atomically)."""
    events = [e for rank_events in events_per_rank for e in rank_events]
    for rank in range(len(events_per_rank)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc `malloc_trim`; a no-op elsewhere).

    glibc keeps freed blocks below its mmap threshold (tens of MiB, the size of a chunk's
    activations) resident for reuse; before a phase that needs memory of a different shape (the
    hand-off gathers the whole KV cache on the decode rank) handing them back lowers the peak.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def reset_peak_rss() -> bool:
    """Start a new peak-memory window: on Linux the kernel's high-water mark (VmHWM) drops to the
    current RSS. Returns False where that is not possible (the window then spans the process)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def window_peak_rss_bytes() -> int:
    """Peak resident memory since the last `reset_peak_rss()` (Linux VmHWM), else the process peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return peak_rss_bytes()
