"""The `ringctx` command line: parse options, call the Python API, render with rich.

No logic lives here that the Python API lacks.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

console = Console()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ringctx")
def main() -> None:
    """ringctx: exact context-parallel prefill of very long prompts (ring pass-KV / pass-Q)."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
def info(as_json: bool) -> None:
    """Devices, attention backends, distributed backends and versions."""
    from .environment import environment_report

    report = environment_report()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    table = Table(title="ringctx environment", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        table.add_row(key, str(value))
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
