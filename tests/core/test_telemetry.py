"""Peak-memory windows: the prefill reports its own peak, not the model load's."""

import subprocess
import sys

import pytest

# In a fresh process: inside pytest, memory freed by earlier tests is still resident and gets reused,
# so a new allocation need not raise RSS at all.
WINDOW_CHECK = """
import torch
from ringctx.telemetry import reset_peak_rss, window_peak_rss_bytes
MiB = 2**20
assert reset_peak_rss()
before = window_peak_rss_bytes()
transient = torch.ones(96 * MiB, dtype=torch.uint8)  # touched, then freed (returned to the OS)
del transient
after = window_peak_rss_bytes()
assert after - before >= 90 * MiB, (before, after)
assert reset_peak_rss()
assert window_peak_rss_bytes() < after - 80 * MiB, "the freed transient is still in the new window"
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM windows are Linux-only")
def test_peak_window_resets_and_catches_a_transient_allocation():
    out = subprocess.run([sys.executable, "-c", WINDOW_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
