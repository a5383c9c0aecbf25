"""docs/ARCHITECTURE.md is true to the code: every module is named in its package's row of the
layer table, every file the page names exists, and its list of long files is exactly the files
over 500 lines (each with its reason)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
LONG_LINES = 500
"""A file longer than this must be named, with its reason, under "Files over 500 lines"."""


def layer_rows() -> dict[str, str]:
    """The layer table: its package or module cell (e.g. '`model/`') and what-it-holds cell, by layer."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("layer", "---") and not cells[0].startswith("-"):
            rows[cells[0]] = cells[1] + " " + cells[2]
    return rows


def test_every_module_is_named_in_its_packages_row():
    rows = layer_rows()
    package = ROOT / "ringctx"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if path.name in ("__init__.py", "__main__.py") or "csrc" in relative.parts:
            continue
        layer = relative.parts[0] if len(relative.parts) > 1 else "core"
        if layer not in rows:
            missing.append(f"{relative}: no row for {layer!r}")
        elif f"`{path.name}`" not in rows[layer] and f"`{relative}`" not in rows[layer]:
            missing.append(f"{relative}: not named in the {layer} row")
    assert not missing, "docs/ARCHITECTURE.md's layer table misses:\n" + "\n".join(missing)


def test_every_file_the_page_names_exists():
    text = PAGE.read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_0-9]+\.(?:py|c|h|md))`", text))
    missing = [name for name in sorted(named)
               if not any((base / name).exists() for base in (ROOT, ROOT / "ringctx", ROOT / "docs"))]
    assert not missing, "docs/ARCHITECTURE.md names files that do not exist: " + ", ".join(missing)


def test_the_long_files_are_exactly_those_listed():
    text = PAGE.read_text()
    section = text[text.index("## Files over 500 lines, and why"):]
    section = section[:section.index("\n## ", 5)] if "\n## " in section[5:] else section
    listed = set(re.findall(r"`((?:ringctx|csrc|scripts)/[A-Za-z_0-9/]+\.(?:py|c|h))`", section))
    long_files = {str(p.relative_to(ROOT)) for folder in ("ringctx", "csrc", "scripts")
                  for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file()
                  and "csrc" not in p.relative_to(ROOT).parts[1:]
                  and len(p.read_text().splitlines()) > LONG_LINES}
    assert listed == long_files, (f"over {LONG_LINES} lines but not listed: {sorted(long_files - listed)}; "
                                  f"listed but not over: {sorted(listed - long_files)}")
