"""Does the strategy heuristic pick the faster of ring pass-KV and pass-Q on this machine?

    python scripts/bench_strategy.py [--hardware PROFILE] [--worlds 2,4]
        [--tokens 64,128,...,8192] [--miss 0.01,0.02,0.05,0.1,0.2,0.5,1] [--repeats 3]
        [--max-case-seconds 1.0] [--max-full-seconds 4.0] [--json .bench/strategy.json]
        [--write-rules PROFILE.json] [--from-json EARLIER.json] [--quick]

On live gloo groups of W ranks (RankPool, max(1, cores // W) threads per rank), ring_attention is
timed with pass-KV and with pass-Q for every (T new tokens, miss rate m = T/(T+P)) of the grid: one
sequence, the model's attention shapes (default SmolLM2-135M: 9 query heads, 3 KV heads, head dim
64, bf16), one layer's attention only - the part the strategy decides. Each case: one warm-up of
each strategy, then --repeats rounds of both in alternating order, every run started at a
barrier and timed on the slowest rank; the median counts. Cases whose predicted time (cost model
of the profile) exceeds --max-case-seconds are skipped and listed.

Every rule (alg1, alg5, empirical with the profile's coefficients, cost) and an empirical rule
fitted to the measured winners (judged leave-one-out: each case predicted by a fit to the others)
is scored: share of right picks where the two strategies differ by more than 5%, mean and worst
regret (time lost against the faster one). Targets: >= 90% right, mean regret <= 3%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rich.console import Console
from rich.table import Table

from ringctx.planning.calibrate import ring_strategy_job
from ringctx.planning.hardware import calibrated_profile_path
from ringctx.planning.empirical import (
    evaluate_picks, faster, fit_rule_to_measurements, gap, leave_one_out_picks, rule_picks,
)
from ringctx.planning.hardware import canonical_dtype, load_profile, save_profile
from ringctx.parallel.launch import RankPool
from ringctx.planning.prefill_plan import resolve_model_config
from ringctx.planning.strategy import PASS_KV, PASS_Q, RULES, choose_strategy, predict_costs

console = Console(width=160)

DEFAULT_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_MISS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def grid(tokens, misses, model, world, hw, dtype, max_case_seconds, max_full_seconds):
    """(cases, skipped): (T, P) with P = round(T/m) - T, skipping predicted-slow ones (full
    prefills, P = 0, may take up to max_full_seconds)."""
    cases, skipped = [], []
    for T in tokens:
        for m in misses:
            P = max(0, round(T / m) - T)
            costs = predict_costs(T, P, model, world, hw, dtype=dtype)
            predicted = max(c.attention_s for c in costs.values())
            limit = max_full_seconds if P == 0 else max_case_seconds
            (cases if predicted <= limit else skipped).append((T, P))
    return cases, skipped


def evaluate(measurements, model, world, hw, dtype):
    """{rule: evaluate_picks(...)} plus baselines and the measured-fit rule (leave-one-out)."""
    out = {}
    for rule in RULES:
        picks = rule_picks(measurements, lambda T, P, rule=rule: choose_strategy(
            T, P, model, world, hw, rule, dtype=dtype).strategy)
        out[rule] = {**evaluate_picks(measurements, picks), "picks": picks}
    if len(measurements) >= 3:
        picks = leave_one_out_picks(measurements, model, world, dtype)
        out["measured-fit (LOO)"] = {**evaluate_picks(measurements, picks), "picks": picks}
    for name, s in (("always pass-kv", PASS_KV), ("always pass-q", PASS_Q)):
        out[name] = {**evaluate_picks(measurements, [s] * len(measurements)), "picks": [s] * len(measurements)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default=str(calibrated_profile_path()), help="profile (default: the one `ringctx calibrate` wrote)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--miss", default=",".join(map(str, DEFAULT_MISS)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-case-seconds", type=float, default=1.0,
                    help="skip cases whose predicted time (slower strategy) exceeds this")
    ap.add_argument("--max-full-seconds", type=float, default=4.0,
                    help="the same limit for full prefills (P = 0), so that T = 8K stays in")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--write-rules", default=None,
                    help="write a copy of the profile with empirical rules fitted to the measured winners")
    ap.add_argument("--quick", action="store_true", help="tiny grid (a smoke test of the script)")
    ap.add_argument("--from-json", default=None,
                    help="re-score the measurements of an earlier --json run against --hardware (no timing)")
    args = ap.parse_args(argv)

    model = resolve_model_config(args.model)
    hw = load_profile(args.hardware)
    dtype = canonical_dtype(args.dtype)
    worlds = [int(w) for w in args.worlds.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    misses = [float(m) for m in args.miss.split(",")]
    if args.quick:
        tokens, misses, args.repeats = [64, 512], [0.05, 1.0], 2
    cores = len(os.sched_getaffinity(0))
    report = {"model": model.name, "dtype": dtype, "hardware": hw.name, "hardware_source": hw.source_path,
              "repeats": args.repeats, "cores": cores, "load_average_start": os.getloadavg(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "worlds": {}}
    fitted = []
    t_start = time.perf_counter()
    earlier = None
    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        worlds = [int(w) for w in earlier["worlds"]]
        report.update({k: earlier[k] for k in ("repeats", "cores", "load_average_start", "started")})
        report["rescored_from"] = args.from_json
    for world in worlds:
        if earlier:
            old = earlier["worlds"][str(world)]
            measurements, skipped, seconds = old["cases"], old["skipped"], old["seconds"]
        else:
            cases, skipped = grid(tokens, misses, model, world, hw, dtype, args.max_case_seconds,
                                  args.max_full_seconds)
            console.print(f"[bold]W = {world}[/bold]: {len(cases)} cases, {len(skipped)} skipped as too slow "
                          f"(> {args.max_case_seconds:g} s predicted)")
            settings = {"model": model.to_dict(), "dtype": dtype, "cases": cases, "repeats": args.repeats}
            t0 = time.perf_counter()
            with RankPool(world, backend="gloo", threads_per_rank=max(1, cores // world), timeout=3600) as pool:
                measurements = pool.run(ring_strategy_job, settings)[0]
            seconds = time.perf_counter() - t0
        scores = evaluate(measurements, model, world, hw, dtype)
        rule = fit_rule_to_measurements(measurements, model, world, dtype)
        fitted.append(rule)
        for m in measurements:
            costs = predict_costs(m["new_tokens"], m["cached_tokens"], model, world, hw, dtype=dtype)
            m["predicted_s"] = {s: c.attention_s for s, c in costs.items()}
        report["worlds"][str(world)] = {"cases": measurements, "skipped": skipped, "scores": scores,
                                        "fitted_rule": rule.__dict__, "seconds": seconds}
        print_cases(world, measurements, scores)
        print_scores(world, scores)
    report["seconds"] = time.perf_counter() - t_start
    if not earlier:
        report["load_average_end"] = os.getloadavg()
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"wrote {args.json_path}")
    if args.write_rules:
        keep = [r for r in hw.empirical_rules
                if not any(r.matches(f.n_heads, f.n_kv_heads, f.cp_size, f.dtype) for f in fitted)]
        import dataclasses

        save_profile(dataclasses.replace(hw, empirical_rules=tuple(fitted) + tuple(keep)), args.write_rules)
        console.print(f"wrote {args.write_rules} with empirical rules fitted to the measured winners")
    return 0


def print_cases(world, measurements, scores):
    table = Table(title=f"W = {world}: ring_attention per layer, median ms (slowest rank)")
    for col in ("T", "P", "miss", "pass-KV", "pass-Q", "faster", "gap*", "alg5", "empirical", "cost", "pred KV",
                "pred Q"):
        table.add_column(col, justify="right")
    for i, m in enumerate(measurements):
        s = m["seconds"]
        marks = []
        for rule in ("alg5", "empirical", "cost"):
            pick = scores[rule]["picks"][i]
            ok = pick == faster(m) or gap(m) <= 0.05
            marks.append(("" if ok else "[red]") + pick.removeprefix("pass-") + ("" if ok else "[/red]"))
        table.add_row(str(m["new_tokens"]), str(m["cached_tokens"]),
                      f"{m['new_tokens'] / (m['new_tokens'] + m['cached_tokens']):.2f}",
                      f"{s[PASS_KV] * 1e3:.2f}", f"{s[PASS_Q] * 1e3:.2f}", faster(m).removeprefix("pass-"),
                      f"{gap(m) * 100:.0f}%", *marks,
                      f"{m['predicted_s'][PASS_KV] * 1e3:.2f}", f"{m['predicted_s'][PASS_Q] * 1e3:.2f}")
    console.print(table)
    console.print("* faster and gap from the median over rounds of time(pass-KV)/time(pass-Q) (paired, both "
                  "strategies back to back); red: a wrong pick where the gap exceeds 5%")


def print_scores(world, scores):
    table = Table(title=f"W = {world}: rules against the measured faster strategy")
    for col in ("rule", "right where gap > 5%", "agree (all)", "mean regret", "worst regret", "worst case"):
        table.add_column(col, justify="right" if col != "rule" else "left")
    for name, s in scores.items():
        w = s["worst_case"]
        table.add_row(name, f"{s['right_decisive']}/{s['decisive']} = {s['accuracy_decisive'] * 100:.0f}%",
                      f"{s['agreement_all'] * 100:.0f}%", f"{s['mean_regret'] * 100:.2f}%",
                      f"{s['worst_regret'] * 100:.1f}%",
                      f"T={w['new_tokens']} P={w['cached_tokens']} ({w['pick']})" if w else "")
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
