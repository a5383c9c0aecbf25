#!/usr/bin/env bash
# The GPU check of ringctx, in one command, in under 8 minutes on one H100/H200-class GPU:
#
#     bash scripts/gpu_check.sh OUT_DIR [--dry-run]
#
# 1. The GPU unit tests of tests/gpu/test_csrc.py and tests/gpu/test_triton_attn.py on the device (the
#    compile-only tests are CI's job and are left out), capped at 120 s.
# 2. `ringctx serve`'s HTTP path (scripts/serve_check.py): an 8K-token document
#    ingested over POST /v1/documents, one streamed question, then a plain client's prompt of the
#    same length twice (a miss, then a prefix-cache hit: cached tokens and time to first token);
#    capped at 90 s. Writes OUT_DIR/serve_check.json.
# 3. Linear attention through flash-linear-attention (optional, as flash-attn is; fla-core imported,
#    or installed offline from a wheel in $FLA_WHEELS, default .gpu_wheels/, which `pip download
#    --no-deps fla-core==0.6.0 -d .gpu_wheels` fills on a machine with the registry): the tests of
#    tests/attention/test_gated_delta_gpu.py on the GPU (60 s cap: Triton compiles fla's kernels for
#    each test shape), then
#    scripts/bench_gated_delta_gpu.py (fla's chunked kernel from an initial state and a CP piece at
#    Hv = 48, 32, Dk = Dv = 128, T = 8K-64K, bf16 inputs, float32 state; 50 s budget, 80 s cap).
#    Writes OUT_DIR/gated_delta_gpu.json and OUT_DIR/pytest_fla.log; skipped, with a line, without fla.
# 4. scripts/gpu_check.py with the rest of the 8 minutes: environment and measured peaks, every
#    attention backend and both CUDA kernels against the float64 reference (sliding-window and
#    soft-capped blocks too: Triton, flash-attn's band path, the PyTorch band fallback; sink logits), kernel
#    timings (TFLOP/s, GB/s; a 32K windowed block, W = 1024 and 4096, against the full causal
#    block; the split-K decode kernel's K/V read bandwidth at B = 1..16 query tokens
#    against a 32K and a 256K-key cache), continuous batching (8 questions on one 8K-token document
#    together against each alone: answers and tokens/s), the TP all-reduce (symmetric-memory one-shot
#    and two-shot against NCCL, 4 KiB - 16 MiB), the EP dispatch (the two-shot all-to-all of
#    model/expert_parallel.py over NCCL, 1 - 8192 tokens a rank, checked bit for bit and timed),
#    grouped experts (torch._grouped_mm against moe.py's per-expert loop at Qwen3-30B-A3B's expert
#    shape, bf16, 512-16K tokens), the csrc build (in the background), and a
#    single-GPU chunked prefill of
#    the SmolLM2-135M shapes at 128K and 1M tokens. Writes OUT_DIR/gpu_check.json.
#
# Everything printed also goes to OUT_DIR/gpu_check.log; pytest's output to OUT_DIR/pytest.log.
# Exit status: non-zero when a correctness check or a test failed (speed targets are reported in
# the JSON under "targets", never turned into failures). Needs python3 with a CUDA build of
# torch, triton, ninja and nvcc (for the extension); flash-attn and fla-core are used when installed.
# --dry-run: the same steps on a CPU machine with tiny shapes (Triton interpreter, torch
# fallbacks), to check the script itself; its numbers mean nothing.
set -uo pipefail

OUT="${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run]}"
DRY=()
if [ "${2:-}" = "--dry-run" ]; then DRY=(--dry-run); export TRITON_INTERPRET=1; fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TOTAL_S=470   # leaves a margin under 8 minutes
START=$(date +%s)

{
  echo "== ringctx gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 || true
  git rev-parse --short HEAD 2>/dev/null || echo "(no git revision)"

  # 1. GPU unit tests first, capped: they are quick, and the prefill below may use all time left.
  xdist=()
  "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
  echo "== GPU unit tests"
  # One tile config per kernel variant: autotuning every test shape would take minutes.
  RINGCTX_TRITON_AUTOTUNE=0 timeout 120 "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
    -k "not compile" tests/gpu/test_csrc.py tests/gpu/test_triton_attn.py 2>&1 | tee "$OUT/pytest.log"
  test_rc=${PIPESTATUS[0]}
  [ "$test_rc" -eq 124 ] && echo "pytest hit its 120 s cap"

  # 2. The serving path, capped.
  echo "== serve: one request over HTTP"
  timeout 100 "$PY" scripts/serve_check.py --out "$OUT" --budget-s 90 "${DRY[@]}"
  serve_rc=$?

  # 3. Linear attention through fla, capped (140 s at most together).
  echo "== linear attention: flash-linear-attention"
  fla_rc=0
  has_fla() { "$PY" -c "import fla.ops.gated_delta_rule" >/dev/null 2>&1; }
  if ! has_fla; then
    wheel=$(ls "${FLA_WHEELS:-.gpu_wheels}"/fla_core-*.whl 2>/dev/null | tail -n 1)
    if [ -n "$wheel" ]; then
      fla_dir=$(mktemp -d)
      "$PY" -m pip install -q --no-deps --no-index --target "$fla_dir" "$wheel" && export PYTHONPATH="$PYTHONPATH:$fla_dir"
    fi
  fi
  if has_fla; then
    timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_gated_delta_gpu.py 2>&1 | tee "$OUT/pytest_fla.log"
    fla_rc=${PIPESTATUS[0]}
    [ "$fla_rc" -eq 124 ] && echo "the fla tests hit their 60 s cap"
    timeout 80 "$PY" scripts/bench_gated_delta_gpu.py --out "$OUT" --budget-s 50 "${DRY[@]}"
    bench_rc=$?
    if [ "$bench_rc" -eq 124 ]; then echo "the fla timings hit their 80 s cap (what was measured is in the JSON)"
    elif [ "$bench_rc" -ne 0 ]; then fla_rc=1; fi
  else
    echo "flash-linear-attention (fla-core) not installed: step skipped (pip install 'ringctx[fla]', or a wheel in .gpu_wheels/)"
  fi

  # 4. Checks, timings and the prefill, with the time left (the script skips what cannot fit).
  budget=$(( TOTAL_S - ($(date +%s) - START) - 15 ))
  timeout $(( budget + 10 )) "$PY" scripts/gpu_check.py --out "$OUT" --budget-s "$budget" "${DRY[@]}"
  check_rc=$?
  [ "$check_rc" -eq 124 ] && echo "gpu_check.py hit its timeout (partial results are in the JSON)"
  echo "== done in $(( $(date +%s) - START )) s: gpu_check.py rc=$check_rc, pytest rc=$test_rc, serve rc=$serve_rc, fla rc=$fla_rc"
  [ "$check_rc" -eq 0 ] && [ "$test_rc" -eq 0 ] && [ "$serve_rc" -eq 0 ] && [ "$fla_rc" -eq 0 ]
} 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
