"""Byte counts and durations as text, the one place that says how ringctx writes a size or a time.

Two styles, each kept where people read it already: binary units for what a process holds or
may hold (`fmt_bytes`: RSS, free memory, a KV budget), decimal gigabytes for the planner's
per-device figures, which profiles state in decimal bytes (`fmt_gb`).
"""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """n bytes in the largest binary unit below 1024 of it: '512 B', '1.5 KiB' ... '3.0 TiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_gb(n: float, places: int | None = None) -> str:
    """n bytes in decimal gigabytes, thousands separated. In prose (places None): one decimal from
    1 GB up ('141.1 GB'), three significant digits below ('0.0123 GB'). In a table column (places
    given): that many decimals below 100 GB ('0.012 GB'), whole gigabytes from there ('1,234 GB')."""
    if places is not None:
        return f"{n / 1e9:,.{places}f} GB" if n < 1e11 else f"{n / 1e9:,.0f} GB"
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e9:.3g} GB"


def fmt_duration(seconds: float) -> str:
    """A duration in the unit a person reads it in: '850 us', '12.5 ms', '3.2 s', '14 min', '5.3 h',
    '7.5 days' (three significant digits below 100 of a unit, whole ones from there); none is '0 s'."""
    if seconds == 0:
        return "0 s"
    for unit, size, below in (("us", 1e-6, 1e-3), ("ms", 1e-3, 1.0), ("s", 1.0, 120.0), ("min", 60.0, 7200.0),
                              ("h", 3600.0, 2 * 86400.0), ("days", 86400.0, float("inf"))):
        if abs(seconds) < below:
            value = seconds / size
            return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{seconds:g} s"
