"""What each phase computes in: `phase_dtypes` and `compute_dtype` follow `computes_in_float32`."""

import pytest
import torch

from ringctx.kernels import cpu_features, report, selection


@pytest.mark.parametrize("fast", [True, False])
def test_phase_dtypes_say_what_the_prefill_and_decode_compute_in(monkeypatch, fast):
    monkeypatch.setattr(cpu_features, "cpu_has_fast_bf16", lambda: fast)
    bf16 = report.phase_dtypes(torch.bfloat16, "cpu")
    assert set(bf16) == {"prefill", "decode"}
    assert cpu_features.compute_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if fast else torch.float32)
    # the sentence and the rule agree: float32 exactly where a big half-precision matmul runs in float32
    big = torch.zeros(selection.UPCAST_MIN_ROWS, 8, dtype=torch.bfloat16)
    assert cpu_features.computes_in_float32(big) is not fast
    assert bf16["prefill"].startswith("bfloat16, natively" if fast else "float32, rounded back to bfloat16")
    assert bf16["decode"].startswith("bfloat16")
    assert report.phase_dtypes(torch.float32, "cpu")["prefill"].startswith("float32")
    assert cpu_features.compute_dtype(torch.float32, "cpu") == torch.float32
    assert "GPUs compute it natively" in report.phase_dtypes(torch.bfloat16, "cuda:0")["prefill"]
    assert cpu_features.compute_dtype(torch.bfloat16, "cuda:0") == torch.bfloat16
