"""Host memory for the big, long-lived CPU tensors: model weights and KV caches in 2 MiB pages.

A CPU decode step reads every weight and the whole KV cache once per token, as fast as memory
delivers. In ordinary 4 KiB pages that read is slower than it need be: the TLB covers a few MiB,
so a step walks the page tables every 4 KiB, and the hardware prefetchers stop at each page
boundary. Linux backs anonymous memory with 2 MiB pages (transparent huge pages) where the
memory asks for them (madvise MADV_HUGEPAGE) and the system allows it
(/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"). On a Sapphire Rapids
class Xeon, SmolLM2's decode step took 0.88-0.95x the time from such memory (bf16, and float32 at
2K keys; 0.99x in float32 at 8K), in every run; a plain sequential read gained 1.37x in one
measurement and nothing in another (docs/BENCHMARKS.md).

PyTorch's CPU allocator asks for huge pages only when THP_MEM_ALLOC_ENABLE=1 is set before its
first allocation, which a library cannot arrange. So ringctx places these tensors itself:
`host_tensors` carves several tensors out of one anonymous mapping that asks for 2 MiB pages,
back to back (so tensors smaller than 2 MiB share huge pages with their neighbours);
`place_in_host_arena` does it for a model's parameters (`empty_model` calls it for CPU models,
before the loaders fill them). The mapping is private and anonymous: the OS fills it with zeros,
pages it in on first touch (rows of a KV cache never written cost no memory, as with
torch.empty), and unmaps it when the last tensor viewing it is freed.

A KV cache filled in bulk (a prefill's, chunk by chunk; a hand-off's; a loaded document's) is the
exception: the first touch of a 2 MiB page can cost milliseconds on a VM, which the chunks (and
the answers waiting between two tokens while a server ingests) would pay one page at a time, so it
starts in ordinary pages (`host_tensors(..., small_pages=True)`) and a server moves it into 2 MiB
pages a page at a time when idle (`collapse_steps`; docs/BENCHMARKS.md).

Where huge pages are not offered (another OS, THP "never", RINGCTX_HUGE_PAGES=0), the same calls
return ordinary tensors, one allocation each: the values and the code paths are the same.

    k, v = host_tensors([((tokens, 8, 128), torch.bfloat16)] * 2)
    place_in_host_arena(model)        # every parameter of a model, ties kept
    huge_pages_report()               # what `ringctx info` prints
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64
"""Bytes each tensor's start is aligned to inside an arena (a cache line: whole-vector loads)."""
ENV = "RINGCTX_HUGE_PAGES"
"""Set to 0 to place nothing in huge pages (to measure what they bring, say)."""


def thp_mode() -> str:
    """The system's transparent huge page setting: "always", "madvise", "never", or "unavailable"
    (no such setting: another OS, or a kernel without THP)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    selected = [word[1:-1] for word in text.split() if word.startswith("[")]
    return selected[0] if selected else "unavailable"


def huge_pages_enabled() -> bool:
    """True when ringctx's host tensors ask for 2 MiB pages and the system gives them."""
    return _why_off() is None


def huge_pages_report() -> dict:
    """For `ringctx info`: whether weights and KV caches go to 2 MiB pages here, and why."""
    mode, off = thp_mode(), _why_off()
    why = f"off: {off}" if off else f"on: CPU weights and KV caches in 2 MiB pages (transparent huge pages: '{mode}')"
    return {"enabled": off is None, "thp_mode": mode, "why": why}


def _why_off() -> str | None:
    """Why host tensors get ordinary pages here, or None when they get huge pages."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this OS has no madvise(MADV_HUGEPAGE)"
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return f"transparent huge pages are '{mode}' ({THP_SETTING})"
    return None


def host_tensors(specs: Sequence[tuple[Sequence[int], torch.dtype]], *, zero: bool = False,
                 small_pages: bool = False) -> list[torch.Tensor]:
    """New contiguous CPU tensors of the given (shape, dtype)s, in one huge-page arena where offered.

    Args:
        specs: (shape, dtype) of each tensor.
        zero: the tensors must start as zeros (the arena always does; the fallback then uses
            torch.zeros instead of torch.empty).
        small_pages: one arena still, in ordinary pages: for memory filled bit by bit while other
            work waits on each write (a prefill's KV cache), as the first touch of a 2 MiB page can
            cost milliseconds on a VM.

    Returns:
        one tensor per spec, in order. Each is a view of the arena, which stays mapped while any
        of them lives; writing one never touches another.
    """
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    if not huge_pages_enabled() or sum(sizes) == 0:
        make = torch.zeros if zero else torch.empty
        return [make(tuple(shape), dtype=dtype) for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    arena = _huge_page_bytes(total, advise=not small_pages)
    return [arena[at:at + size].view(dtype).view(tuple(shape))
            for (shape, dtype), at, size in zip(specs, offsets, sizes)]


def place_in_host_arena(module: nn.Module) -> nn.Module:
    """Give every parameter of a module new CPU storage in one huge-page arena (in place).

    Parameters on the meta device get uninitialised storage (`empty_model` builds models so, and
    the loaders then fill them in place: the weights are written once, where they stay); others
    are copied. Parameters shared between submodules (tied embeddings) are one Parameter and stay
    one. Where huge pages are not offered, each parameter gets an ordinary allocation instead.
    Returns the module."""
    params = list(module.parameters())  # each shared Parameter once
    placed = host_tensors([(p.shape, p.dtype) for p in params])
    replacement = {}
    with torch.no_grad():
        for p, new in zip(params, placed):
            if p.device.type != "meta":
                new.copy_(p)
            replacement[id(p)] = nn.Parameter(new, requires_grad=p.requires_grad)
    for submodule in module.modules():
        for name, p in list(submodule._parameters.items()):
            if p is not None:
                submodule._parameters[name] = replacement[id(p)]
    return module


HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 (and most arm64 kernels)."""

MADV_COLLAPSE = 25
"""madvise advice (Linux 6.1+): move a range's pages into 2 MiB pages now, keeping every byte."""


def collapse_steps(tensors: Sequence[torch.Tensor]):
    """Move the memory under `tensors` (views of one `small_pages` arena) into 2 MiB pages, one
    page per step: a generator to advance when nothing else runs (the scheduler's idle turns).

    Why in steps, on the thread that runs the work: while the kernel moves a range it holds the
    process's memory map, so one call over a whole cache in a thread of its own stalled the
    scheduler's thread 1.2-1.7 s on this project's VM (docs/BENCHMARKS.md); a page at a time
    between requests stalls nothing but an arriving request, by one page at most. Every byte is
    kept. Ends early (the pages stay small) where huge pages are not offered or the kernel refuses.
    """
    if not tensors or not huge_pages_enabled() or not all(t.device.type == "cpu" for t in tensors):
        return
    page = mmap.PAGESIZE
    start = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    start -= start % page
    end += -end % page
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE) != 0:
        return
    for at in range(start - start % HUGE_PAGE, end, HUGE_PAGE):
        lo, hi = max(at, start), min(at + HUGE_PAGE, end)
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_COLLAPSE) != 0:
            return
        yield


def release_pages(t: torch.Tensor) -> int:
    """Give the whole memory pages under a contiguous CPU tensor back to the system (madvise
    MADV_DONTNEED); returns the bytes released. Its values then read as zeros: only for memory
    nobody reads again (rows a cache dropped). Nothing happens elsewhere (a GPU tensor, an OS
    without madvise): the memory stays, the values too."""
    if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous() or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    page = mmap.PAGESIZE
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    start += -start % page  # whole pages only: the partial ones at the edges hold kept bytes
    end -= end % page
    if end <= start:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED) != 0:
        return 0
    return end - start


def _huge_page_bytes(nbytes: int, advise: bool = True) -> torch.Tensor:
    """A uint8 tensor over a fresh private anonymous mapping of nbytes that asks for 2 MiB pages
    (advise=False: for ordinary pages, even where THP is "always").

    The tensor holds the mmap object (torch.frombuffer keeps a reference), so the mapping lives
    exactly as long as the tensor's storage. The advice comes before any page is touched: pages
    already faulted in as 4 KiB stay so until the kernel's background collapse."""
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise MemoryError(f"cannot map {nbytes / 2**30:.2f} GiB of host memory for weights or a KV cache "
                          f"({exc.strerror}); check what fits first with `ringctx plan`, or use fewer tokens, "
                          "a smaller model or more ranks") from exc
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE if advise else mmap.MADV_NOHUGEPAGE)
    except OSError:  # refused (an old kernel, a sandbox): ordinary pages, the same memory
        pass
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)

