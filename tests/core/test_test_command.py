"""The README's test command and CI: CI runs the README's line itself, and the install script it
calls stops with one line naming the apt command where it cannot install Debian's packages."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# Install and run the tests"))
    return lines[at + 1]


def test_ci_runs_the_readme_test_command():
    """.ci/run extracts the line after the README's heading comment: the same line this test reads."""
    command = readme_test_command()
    assert command.startswith("bash scripts/install_test_deps.sh && ") and "pytest" in command
    script = (ROOT / ".ci" / "run").read_text()
    extracted = subprocess.run(["bash", "-c", script.split("command=$(", 1)[1].split(")\n", 1)[0]],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert extracted == command


def test_install_script_names_the_apt_command_without_root(tmp_path):
    """Not root, no sudo, no browser: one line on stderr naming what to install, exit 1, nothing run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")  # not root
    (bin_dir / "id").chmod(0o755)
    (bin_dir / "python3").write_text("#!/bin/sh\necho ran python3 >&2\nexit 7\n")  # must never be reached
    (bin_dir / "python3").chmod(0o755)
    result = subprocess.run([str(bin_dir / "bash"), str(ROOT / "scripts" / "install_test_deps.sh")],
                            env={"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/")},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "sudo apt-get install -y iproute2 chromium chromium-driver" in lines[0]
    assert "ran python3" not in result.stderr
