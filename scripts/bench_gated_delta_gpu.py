"""flash-linear-attention's gated delta kernel on the GPU at the real linear-attention shapes, for
scripts/gpu_check.sh (and --dry-run on a CPU, in Triton's interpreter).

    python scripts/bench_gated_delta_gpu.py --out DIR [--budget-s 60] [--dry-run]

For Hv = 48 and 32 value heads over Hk = 16 key heads (Qwen3.5/3.6-27B; Qwen3-Next-80B),
Dk = Dv = 128, T = 8K, 16K, 32K, 64K tokens, bf16 q, k, v and a float32 start state, times:

    fla     fla's chunk_gated_delta_rule from the start state, final state out: the kernel alone
    build   attention/gated_delta_gpu.FlaPiece.build: a context-parallel piece's outputs from
            zero, transition and contribution (one call with the values widened to Dv + Dk)
    piece   build + scan(start): and its outputs from the start state (a matmul); against
            build + fla, the other way to have them

and, at 8K and Hv = 48, ringctx's own ChunkForm (build, PieceSummary.of, scan from the start) on the
same GPU. Each size also checks the piece's outputs and end state against fla's plain call (both
bf16: their difference is rounding). Times are CUDA-event medians after one warm-up call (the
first call's seconds, Triton's compile and fla's autotuning, are reported apart). Writes
DIR/gated_delta_gpu.json and prints a table; sizes that no longer fit --budget-s are skipped and
listed. Exit status 1 when fla is missing or a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECK_TOL = 5e-2  # piece against fla's plain call, both from bf16 inputs


def inputs(T: int, Hk: int, Hv: int, D: int, dtype, device, seed: int = 0):
    """q, k [T, Hk, D] normalised (q scaled by D^-0.5, as the layer hands them over), v [T, Hv, D],
    g, beta [T, Hv] float32, and a start state [Hv, D, D] float32."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(T, Hk, D, generator=gen, device=device), dim=-1)
            for _ in "qk")
    v = torch.randn(T, Hv, D, generator=gen, device=device)
    g = torch.nn.functional.logsigmoid(torch.randn(T, Hv, generator=gen, device=device) + 4)  # slow decay
    beta = torch.rand(T, Hv, generator=gen, device=device)
    start = torch.randn(Hv, D, D, generator=gen, device=device) * 0.1
    return (q * D ** -0.5).to(dtype), k.to(dtype), v.to(dtype), g, beta, start


def timed(fn, dry: bool, reps: int = 5) -> tuple[float, float]:
    """(seconds of the first call, median seconds of the next `reps`): CUDA events on a GPU
    (gpu_check.py's `time_once`)."""
    import torch

    from gpu_check import time_once  # scripts/ is this script's directory

    t = time.perf_counter()
    fn()
    if not dry:
        torch.cuda.synchronize()
    first = time.perf_counter() - t
    return first, statistics.median(time_once(fn, dry) for _ in range(1 if dry else reps))


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def measure(T: int, Hk: int, Hv: int, D: int, dry: bool, with_torch: bool) -> dict:
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from ringctx.attention.gated_delta import ChunkForm, PieceSummary
    from ringctx.attention.gated_delta_gpu import FlaPiece

    device = "cpu" if dry else "cuda"
    q, k, v, g, beta, start = inputs(T, Hk, Hv, D, torch.float32 if dry else torch.bfloat16, device)

    def fla_call():
        return chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                      initial_state=start[None], output_final_state=True)

    def build():
        return FlaPiece.build(q, k, v, g, beta)

    def piece():
        return build().scan(start)

    row: dict = {"T": T, "Hk": Hk, "Hv": Hv, "D": D, "dtype": str(q.dtype).removeprefix("torch.")}
    for name, fn in (("fla", fla_call), ("build", build), ("piece", piece)):
        first, median = timed(fn, dry)
        row[f"{name}_first_s"] = round(first, 3)
        row[f"{name}_ms"] = round(median * 1e3, 3)
        row[f"{name}_mtok_s"] = round(T / median / 1e6, 2)
    o, end = fla_call()
    out, piece_end = piece()
    row["piece_vs_fla_rel_err"] = max(rel_err(out, o[0]), rel_err(piece_end, end[0]))
    if with_torch:
        group = Hv // Hk
        qr, kr = (x.repeat_interleave(group, dim=1) for x in (q, k))

        def chunk_form():
            form = ChunkForm.build(qr, kr, v, g, beta)
            PieceSummary.of(form)
            return form.scan(start)

        first, median = timed(chunk_form, dry, reps=2)
        row["chunkform_ms"] = round(median * 1e3, 3)
        row["chunkform_mtok_s"] = round(T / median / 1e6, 2)
    if not dry:
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--budget-s", type=float, default=50.0, help="start no size after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = p.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before fla's kernels are decorated
    import contextlib

    from ringctx.attention.gated_delta_gpu import fla_available, interpreter_shims

    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"rows": [], "skipped": [], "ok": False}
    path = args.out / "gated_delta_gpu.json"
    if not fla_available():
        result["error"] = "flash-linear-attention (fla-core) does not import: pip install 'ringctx[fla]'"
        print(result["error"])
        path.write_text(json.dumps(result, indent=1))
        return 1
    import fla
    import torch

    result["fla_core"] = fla.__version__
    if args.dry_run:
        sizes = [(128, 2, 4, 16)]
    else:
        result["gpu"] = torch.cuda.get_device_name(0)
        sizes = [(T, 16, Hv, 128) for Hv in (48, 32) for T in (8192, 16384, 32768, 65536)]
    deadline = time.monotonic() + args.budget_s
    ok = True
    with interpreter_shims() if args.dry_run else contextlib.nullcontext():
        for i, (T, Hk, Hv, D) in enumerate(sizes):
            if time.monotonic() > deadline:
                result["skipped"].append({"T": T, "Hv": Hv})
                continue
            row = measure(T, Hk, Hv, D, args.dry_run, with_torch=(i == 0))
            row["check_ok"] = row["piece_vs_fla_rel_err"] < CHECK_TOL
            ok &= row["check_ok"]
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=1))
    result["ok"] = ok
    path.write_text(json.dumps(result, indent=1))
    print(f"{'T':>6} {'Hv':>3} {'fla ms':>9} {'build ms':>9} {'piece ms':>9} {'fla Mtok/s':>10} "
          f"{'piece Mtok/s':>12} {'rel err':>8} {'first s':>8}")
    for r in result["rows"]:
        print(f"{r['T']:>6} {r['Hv']:>3} {r['fla_ms']:>9} {r['build_ms']:>9} {r['piece_ms']:>9} {r['fla_mtok_s']:>10} "
              f"{r['piece_mtok_s']:>12} {r['piece_vs_fla_rel_err']:>8.1e} {r['fla_first_s'] + r['build_first_s']:>8.1f}"
              + (f"   ChunkForm {r['chunkform_ms']} ms" if "chunkform_ms" in r else ""))
    if result["skipped"]:
        print("skipped (budget):", ", ".join(f"T={s['T']} Hv={s['Hv']}" for s in result["skipped"]))
    print("gated delta on GPU:", "ok" if ok else f"FAILED (piece against fla's call above {CHECK_TOL})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
