#!/usr/bin/env python
"""Decode steps of this checkout against another git revision, in alternating processes.

    python scripts/bench_kernel_ab.py --base HEAD~1                      # bf16 2K, fp32 2K
    python scripts/bench_kernel_ab.py --base main --configs bf16:8192:avx2 fp32:2048 --rounds 5
    python scripts/bench_kernel_ab.py --base HEAD --base-env RINGCTX_HUGE_PAGES=0   # a setting

For a change to the CPU kernels (csrc/) or the decode path, on a machine too noisy for a single
before/after: the base revision's `ringctx` package and C sources are exported into a temporary
directory (git archive), and each round runs every configuration once per side, base then this
checkout, each in a fresh Python process (its own kernel build, cached by source digest). A
process loads SmolLM2-135M, prefills random tokens and decodes 64 greedy tokens through
`model.generate`, and reports the median step. Printed: per configuration, the median over
rounds per side and the median of the per-round ratios (this checkout / base), which cancels
most of the machine's drift. Configurations are DTYPE:PROMPT[:VARIANT] (VARIANT: a CPU kernel
variant, see ringctx.kernels.build; default: the widest this CPU runs). `--base-env KEY=VALUE`
sets an environment variable in the base side's processes only: with `--base HEAD`, the same code
with and without a setting. Each process also reports its read bandwidth
(ringctx.planning.machine_speed.read_bandwidth, where the revision has it), printed per side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_MEASURE = """
import json, statistics, sys, torch
torch.set_num_threads(2)
try:
    from ringctx.kernels import build
except ImportError:  # a revision before ringctx/kernels/
    from ringctx import cpu_kernels as build
from ringctx.model import load_model, resolve_dtype
dtype, prompt, variant = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
build.use_variant(variant)
model = load_model("smollm2-135m", dtype=resolve_dtype(dtype), device="cpu")
ids = torch.randint(0, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
model.generate(ids[:256], max_new_tokens=3, stop_token_ids=[])  # build and warm the kernels
result = model.generate(ids, max_new_tokens=65, stop_token_ids=[])
import ringctx
try:
    from ringctx.planning.machine_speed import read_bandwidth
    read_gbps = read_bandwidth(threads=2) / 1e9
except ImportError:  # an older revision
    read_gbps = None
print(json.dumps({"step_ms": 1e3 * statistics.median(result.token_times_s), "tokens": result.token_ids[:8],
                  "variant": getattr(build.active_variant(), "name", None), "package": ringctx.__file__,
                  "read_gbps": read_gbps}))
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare against (e.g. HEAD~1, main)")
    p.add_argument("--configs", nargs="+", default=["bf16:2048", "fp32:2048"], help="DTYPE:PROMPT[:VARIANT]")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--base-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the base side's processes only (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    args = p.parse_args()
    if any("=" not in item for item in args.base_env):
        p.error(f"--base-env takes KEY=VALUE, got {args.base_env}")
    return args


def export_revision(revision: str, into: Path) -> Path:
    """The revision's ringctx package with its C sources inside it (as an installed wheel has them)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "ringctx", "csrc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package_sources = into / "ringctx" / "csrc"
    if package_sources.is_symlink() or package_sources.is_file():
        package_sources.unlink()
    if not package_sources.exists():
        (into / "csrc").rename(package_sources)
    return into


def measure(path: Path, config: str, extra_env: dict[str, str]) -> dict:
    dtype, prompt, *variant = config.split(":")
    # Run from inside the tree measured: `python -c` puts the working directory first on sys.path,
    # ahead of PYTHONPATH, so a run from this checkout would import this checkout's ringctx.
    env = dict(os.environ, PYTHONPATH=str(path), **extra_env)
    done = subprocess.run([sys.executable, "-c", _MEASURE, dtype, prompt, variant[0] if variant else ""],
                          env=env, cwd=path, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{config} under {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    rows = {config: {"base": [], "this": []} for config in args.configs}
    with tempfile.TemporaryDirectory(prefix="ringctx-ab-") as tmp:
        sides = {"base": export_revision(args.base, Path(tmp)), "this": ROOT}
        envs = {"base": dict(item.split("=", 1) for item in args.base_env), "this": {}}
        for round_index in range(args.rounds):
            for config in args.configs:
                for side, path in sides.items():
                    rows[config][side].append(measure(path, config, envs[side]))
                base, this = rows[config]["base"][-1], rows[config]["this"][-1]
                print(f"round {round_index + 1}  {config:18s} base {base['step_ms']:6.2f} ms  "
                      f"this {this['step_ms']:6.2f} ms  ({this['variant']})", flush=True)
    base_env = " ".join(args.base_env)
    print(f"\nmedian decode step over {args.rounds} rounds (base = {args.base}{', ' + base_env if base_env else ''}):")
    for side, path in (("base", "ringctx-ab-"), ("this", str(ROOT))):  # each side ran its own code
        assert all(path in r["package"] for sides_of in rows.values() for r in sides_of[side]), side
    for config, sides_of in rows.items():
        base = [r["step_ms"] for r in sides_of["base"]]
        this = [r["step_ms"] for r in sides_of["this"]]
        ratio = statistics.median(t / b for t, b in zip(this, base))
        same = all(b["tokens"] == t["tokens"] for b, t in zip(sides_of["base"], sides_of["this"]))
        print(f"  {config:18s} base {statistics.median(base):6.2f} ms  this {statistics.median(this):6.2f} ms  "
              f"paired ratio {ratio:.3f}  {'same tokens' if same else 'TOKENS DIFFER'}")
    reads = {side: [r["read_gbps"] for sides_of in rows.values() for r in sides_of[side]] for side in ("base", "this")}
    if all(v is not None for values in reads.values() for v in values):
        ratio = statistics.median(t / b for t, b in zip(reads["this"], reads["base"]))
        print(f"  read bandwidth     base {statistics.median(reads['base']):6.1f} GB/s  "
              f"this {statistics.median(reads['this']):6.1f} GB/s  paired ratio {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "base_env": args.base_env, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
