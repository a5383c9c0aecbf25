"""Windowed layers against global ones, side by side in one run: SmolLM2-135M's shapes with
Gemma 3's pattern (5 sliding layers of 1,024 to 1 global: the `smollm2-135m-sliding` preset,
random weights) against the same shapes with every layer global (`smollm2-135m`).

    python scripts/bench_windows.py [--tokens 32768] [--world 2] [--repeats 2] [--decode-steps 16]
                                    [--dtype auto] [--json out.json]

For each model, in a fresh process each time, alternating the two (a shared machine drifts):
  - a prefill of --tokens random tokens on --world ranks (the engine's default chunks): seconds;
  - the prefill's FLOPs as the planner counts them (`planning.work.chunk_flops`: GEMMs and each
    layer's attention over the keys its span lets it see), whose ratio is the speed-up the
    windows can give at most; the target is a measured speed-up of at least 0.8x that ratio;
  - a decode of --decode-steps tokens after the prefill (the document split over the ranks):
    ms per token against the memory floor, the bytes a step reads once (weights, and each
    layer's K/V rows it sees: the whole context in a global layer, W rows in a windowed one)
    at this machine's read bandwidth, measured in the same process; the target is within 1.3x.

Prints a table and the paired ratios (median over repeats); --json writes every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODELS = ("smollm2-135m-sliding", "smollm2-135m")


def run_one(model: str, tokens: int, world: int, decode_steps: int, dtype: str) -> dict:
    """One prefill and decode of `model` in this process (call it in a fresh one)."""
    import torch

    import ringctx
    from ringctx.planning.machine_speed import decode_bytes_per_token, read_bandwidth
    from ringctx.planning.work import prefill_chunk_flops

    ids = torch.randint(3, 49152, (tokens,), generator=torch.Generator().manual_seed(0))
    with ringctx.Engine(model, nproc=world, dtype=dtype, decode_ranks=world, allow_long_context=True) as engine:
        engine.prefill(ids[: 2 * world * 64], decode_room=0)  # warm-up: kernels built, pages touched
        t0 = time.perf_counter()
        document = engine.ingest(ids.tolist(), chat=False)
        prefill_s = time.perf_counter() - t0
        generation = engine.generate(document, [7, 11, 13], max_new_tokens=decode_steps, stop_token_ids=[])
        "".join(generation)
        result = generation.result
        config = engine.model.full_config
        flops = sum(prefill_chunk_flops([tokens], engine.chunk_tokens, config))
        model_dtype = str(engine.model.dtype).removeprefix("torch.")
        # every decode rank reads all weights and its share of the K/V rows, at the same time
        weights = decode_bytes_per_token(engine.model, 0)
        step_bytes = weights * world + decode_bytes_per_token(engine.model, tokens + 3 + decode_steps / 2) - weights
    bandwidth = read_bandwidth(threads=world)
    ms = result.decode_ms_per_token
    floor_ms = 1e3 * step_bytes / bandwidth
    return {"model": model, "tokens": tokens, "world": world, "dtype": model_dtype,
            "attention": config.attention_summary(), "prefill_s": prefill_s, "prefill_flops": flops,
            "decode_ms_per_token": ms, "decode_floor_ms": floor_ms, "decode_over_floor": ms / floor_ms,
            "read_bandwidth_gb_s": bandwidth / 1e9}


def in_fresh_process(model: str, args) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {repr(sys.path[0])}); from bench_windows import run_one; "
            f"print(json.dumps(run_one({model!r}, {args.tokens}, {args.world}, {args.decode_steps}, {args.dtype!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{model}: the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from ringctx.kernels.cpu_features import cpu_model

    runs: dict[str, list[dict]] = {m: [] for m in MODELS}
    for r in range(args.repeats):
        for model in (MODELS if r % 2 == 0 else MODELS[::-1]):
            run = in_fresh_process(model, args)
            runs[model].append(run)
            print(f"  {model:22} prefill {run['prefill_s']:7.1f} s  decode {run['decode_ms_per_token']:6.1f} ms/token "
                  f"(floor {run['decode_floor_ms']:.1f})", flush=True)
    windowed, global_ = (runs[m] for m in MODELS)
    speedups = [g["prefill_s"] / w["prefill_s"] for w, g in zip(windowed, global_)]
    flops_ratio = global_[0]["prefill_flops"] / windowed[0]["prefill_flops"]
    over_floor = [w["decode_over_floor"] for w in windowed]
    summary = {
        "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "world": args.world,
        "dtype": windowed[0]["dtype"], "prefill_speedup_median": statistics.median(speedups),
        "flops_ratio": flops_ratio, "speedup_share_of_flops_ratio": statistics.median(speedups) / flops_ratio,
        "speedup_target_met": statistics.median(speedups) >= 0.8 * flops_ratio,
        "windowed_decode_over_floor_median": statistics.median(over_floor),
        "decode_target_met": statistics.median(over_floor) <= 1.3, "runs": runs,
    }
    print(f"\n{summary['cpu']}, {summary['date']}, {args.tokens:,} tokens on {args.world} ranks, {summary['dtype']}")
    print(f"{'':24}{'prefill s':>10}{'GFLOP':>10}{'decode ms':>11}{'floor ms':>10}")
    for model in MODELS:
        run = runs[model]
        print(f"{model:24}{statistics.median(x['prefill_s'] for x in run):>10.1f}"
              f"{run[0]['prefill_flops'] / 1e9:>10.0f}{statistics.median(x['decode_ms_per_token'] for x in run):>11.1f}"
              f"{statistics.median(x['decode_floor_ms'] for x in run):>10.1f}")
    print(f"prefill speed-up {summary['prefill_speedup_median']:.2f}x; FLOPs ratio {flops_ratio:.2f}x; "
          f"share {summary['speedup_share_of_flops_ratio']:.2f} (target >= 0.8: "
          f"{'met' if summary['speedup_target_met'] else 'not met'})")
    print(f"windowed decode {summary['windowed_decode_over_floor_median']:.2f}x its memory floor (target <= 1.3: "
          f"{'met' if summary['decode_target_met'] else 'not met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
