"""Predicted versus measured time to first token of the engine's prefill at W = 1, 2, 4.

    python scripts/bench_ttft_prediction.py [--hardware PROFILE] [--worlds 1,2,4]
        [--tokens 4096] [--chunk-tokens 4096] [--dtype bfloat16] [--rule alg5] [--repeats 2]
        [--json .bench/ttft.json]

For each W: Engine(model, nproc=W, dtype, hardware=profile, chunk_tokens, rule) - the same code as
`ringctx prefill` - prefills random token ids (one warm-up prefill of 256 tokens first), --repeats
times; the median PrefillStats.ttft_s is compared with plan_prefill(...).ttft_ms for the same
model, W, chunking, dtype and rule on the profile. The strategies the engine chose per chunk are
checked against the plan's. Target: within 25%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from ringctx.engine import Engine
from ringctx.planning.hardware import calibrated_profile_path, load_profile
from ringctx.planning.prefill_plan import plan_prefill, resolve_model_config

console = Console(width=160)


def measure(model: str, world: int, hw, tokens: int, chunk: int, dtype: str, rule: str, repeats: int) -> dict:
    threads = torch.get_num_threads()
    ids = torch.randint(0, resolve_model_config(model).vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    try:
        with Engine(model, nproc=world, dtype=dtype, hardware=hw, chunk_tokens=chunk, rule=rule) as engine:
            engine.prefill(ids[:256])
            runs = []
            for _ in range(repeats):
                result = engine.prefill(ids)
                runs.append(result.stats)
    finally:
        torch.set_num_threads(threads)  # the engine set this process's threads for its rank
    ttfts = [s.ttft_s for s in runs]
    last = runs[-1]
    return {"ttft_s": statistics.median(ttfts), "runs_s": ttfts, "handoff_s": statistics.median(s.handoff_s for s in runs),
            "chunks": [{"tokens": c.tokens, "cached": c.cached, "strategy": c.strategy, "seconds": c.seconds}
                       for c in last.chunks]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default=str(calibrated_profile_path()), help="profile (default: the one `ringctx calibrate` wrote)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=None, help="default: --tokens (one chunk)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rule", default="alg5")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    hw = load_profile(args.hardware)
    chunk = args.chunk_tokens or args.tokens
    config = resolve_model_config(args.model)
    report = {"model": args.model, "hardware": hw.name, "hardware_source": hw.source_path, "tokens": args.tokens,
              "chunk_tokens": chunk, "dtype": args.dtype, "rule": args.rule, "repeats": args.repeats,
              "load_average_start": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "worlds": {}}
    table = Table(title=f"TTFT of {args.tokens} tokens ({args.model}, {args.dtype}, chunks of {chunk}, rule {args.rule})")
    for col in ("W", "measured s", "runs s", "predicted s", "predicted / measured", "within 25%", "strategies",
                "plan strategies", "hand-off s (meas / pred)"):
        table.add_column(col, justify="right")
    for world in [int(w) for w in args.worlds.split(",")]:
        plan = plan_prefill(config, world, hw, args.tokens, chunk_tokens=chunk, dtype=args.dtype, rule=args.rule)
        t0 = time.perf_counter()
        got = measure(args.model, world, hw, args.tokens, chunk, args.dtype, args.rule, args.repeats)
        predicted = plan.ttft_ms / 1e3
        ratio = predicted / got["ttft_s"]
        strategies = [c["strategy"] for c in got["chunks"]]
        planned = [e.strategy for e in plan.entries]
        report["worlds"][str(world)] = {**got, "predicted_s": predicted, "ratio": ratio, "plan": plan.to_dict(),
                                        "plan_strategies": planned, "wall_s": time.perf_counter() - t0}
        table.add_row(str(world), f"{got['ttft_s']:.2f}", ", ".join(f"{t:.2f}" for t in got["runs_s"]),
                      f"{predicted:.2f}", f"{ratio:.2f}", "yes" if abs(ratio - 1) <= 0.25 else "[red]no[/red]",
                      " ".join(s.removeprefix("pass-") for s in strategies),
                      " ".join(s.removeprefix("pass-") for s in planned),
                      f"{got['handoff_s']:.2f} / {plan.handoff_ms / 1e3:.2f}")
        console.print(f"W = {world}: measured {got['ttft_s']:.2f} s, predicted {predicted:.2f} s")
    report["load_average_end"] = os.getloadavg()
    console.print(table)
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
