import os
import tempfile

# Every run without --hardware reads this machine's calibrated profile (ringctx.planning.hardware);
# the tests must not depend on one a developer wrote: point at a file that is not there.
os.environ["RINGCTX_HARDWARE_PROFILE"] = os.path.join(tempfile.mkdtemp(prefix="ringctx-tests-"), "hardware.json")

# In this process, OpenMP threads that find no work wait passively (sleep) instead of spinning for
# a while first: the tests run on a 2-core machine with more threads than cores (the kernel tests'
# 3-thread cases, a concurrent run), where spinning threads steal the cores of the ones with work
# (the kernel and flash-attention tests ran 3-5x slower). Only how idle threads wait changes, not
# the thread counts or the results. OpenMP reads the policy once, when torch loads it (the C
# kernels' library shares torch's libgomp.so.1); then it is taken out of the environment again, so
# that spawned ranks, servers and CLI subprocesses keep OpenMP's default (the 8-bit cache engine
# tests ran ~20% slower with passive ranks). A policy already set is left alone.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch  # noqa: E402,F401 - its OpenMP runtime reads the policy now
    del os.environ["OMP_WAIT_POLICY"]

import shutil

import pytest

from ringctx.kernels import build
from ringctx.parallel.launch import RankPool

KERNEL_VARIANTS = ([v.name for v in build.VARIANTS if build.runs_here(v) is None]
                   if shutil.which("cc") or shutil.which("gcc") else [])
"""The CPU kernel variants this machine runs (avx512, avx2, portable: see ringctx.kernels.build), all
of which the kernel tests check: an AVX-512 machine also checks the AVX2 and portable builds."""


@pytest.fixture(params=KERNEL_VARIANTS or [None])
def kernel_variant(request):
    """Each CPU kernel test runs once per variant this machine runs (once with none where there is
    no C compiler: the tests then check the PyTorch fallback)."""
    build.use_variant(request.param)
    yield request.param
    build.use_variant(None)

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def rank_pool():
    """rank_pool(W) -> a RankPool of W gloo ranks, started once per session and world size."""

    def get(world_size: int) -> RankPool:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size, backend="gloo")
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' model of the embedded SmolLM2-135M-Instruct GGUF, dequantized to float32 (the
    oracle of tests/model/test_model_smollm2.py and tests/engine/test_engine_smollm2.py), loaded once
    per session: its GGUF conversion takes 10+ s. Tests must not change it (copy it first)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ringctx.model import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, local_files_only=True).eval()
