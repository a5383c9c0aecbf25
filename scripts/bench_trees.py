#!/usr/bin/env python
"""Two checkouts of ringctx side by side: did a change make anything hot slower?

    python scripts/bench_trees.py --old ../ringctx-before [--new .] [--rounds 2] [--tokens 8192]
                                  [--serve-tokens 4000] [--questions 8] [--json out.json]

Each round runs both checkouts in turn, their order swapped every round (a noisy machine then slows
both alike), each in fresh processes with PYTHONPATH set to that checkout:

    prefill   `python -m ringctx prefill --tokens T --nproc 2 --dtype bfloat16 --hardware cpu
              --strategy pass-kv --json -`: the prefill's time to first token, a 48-token
              follow-up on top of it, and the decode step (ms per token); the strategy and the
              profile fixed, so that both sides run the same work
    serve     the checkout's own `scripts/bench_serve.py --skip-llama --concurrency` (ringctx serve
              alone): a document's ingest, later questions' time to first token (by id) and the
              inter-token time

The table gives each side's median over the rounds and the median of the per-round ratios
new / old (below 1: the new checkout is faster). Timings only: the answers' bits are the tests'
business (tests/runtime/test_alone_equals_batch.py and the rest).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_prefill(tree: Path, tokens: int) -> dict[str, float]:
    command = [sys.executable, "-m", "ringctx", "prefill", "--tokens", str(tokens), "--nproc", "2",
               "--dtype", "bfloat16", "--hardware", "cpu", "--strategy", "pass-kv", "--decode", "32", "--json", "-"]
    out = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"{tree}: prefill failed:\n{out.stderr[-2000:]}")
    report = json.loads(out.stdout)
    efficiency = report.get("efficiency") or {}
    return {"prefill TTFT s": report["ttft_s"],
            "follow-up s": sum(c["seconds"] for c in (report.get("follow_up") or {}).get("chunks", [])),
            "decode ms/token": efficiency.get("decode_ms_per_token") or float("nan")}


def run_serve(tree: Path, tokens: int, questions: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "serve.json"
        command = [sys.executable, str(tree / "scripts" / "bench_serve.py"), "--tokens", str(tokens), "--questions",
                   str(questions), "--skip-llama", "--concurrency", "--json", str(path)]
        out = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                             text=True, timeout=3600)
        if out.returncode:
            raise SystemExit(f"{tree}: bench_serve failed:\n{out.stderr[-2000:]}\n{out.stdout[-2000:]}")
        (row,) = json.loads(path.read_text())["summary"]["rows"]
    nan = float("nan")
    return {"serve ingest s": row.get("first_ringctx_ready_s", nan),
            "serve TTFT ms": 1e3 * row.get("ringctx id|ttft_s", nan),
            "serve ITL ms": 1e3 * row.get("ringctx id|itl_s", nan),
            "engine TTFT ms": 1e3 * row.get("engine_ttft_s", nan),
            "engine step ms": 1e3 * row.get("engine_step_s", nan)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, type=Path, help="the checkout before the change")
    p.add_argument("--new", default=Path("."), type=Path, help="the checkout with it (default: here)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192, help="prefill tokens (0: skip the prefill runs)")
    p.add_argument("--serve-tokens", type=int, default=4000, help="the served document's tokens (0: skip)")
    p.add_argument("--questions", type=int, default=8, help="later questions to the served document")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    rounds = []
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        numbers = {}
        for side in order:
            got = {}
            if args.tokens:
                got.update(run_prefill(trees[side], args.tokens))
            if args.serve_tokens:
                got.update(run_serve(trees[side], args.serve_tokens, args.questions))
            numbers[side] = got
            print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.4g}" for k, v in got.items()), file=sys.stderr)
        rounds.append(numbers)
    metrics = list(rounds[0]["old"])
    print(f"{'metric':<18}{'old':>12}{'new':>12}{'new/old':>10}   per round")
    summary = {}
    for m in metrics:
        old = statistics.median(x["old"][m] for x in rounds)
        new = statistics.median(x["new"][m] for x in rounds)
        ratios = [x["new"][m] / x["old"][m] for x in rounds if x["old"][m]]
        summary[m] = {"old": old, "new": new, "ratio": statistics.median(ratios), "ratios": ratios}
        print(f"{m:<18}{old:>12.4g}{new:>12.4g}{summary[m]['ratio']:>10.3f}   "
              + " ".join(f"{q:.3f}" for q in ratios))
    if args.json:
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": platform.processor(),
                "trees": {k: str(v) for k, v in trees.items()}, "args": {k: str(v) for k, v in vars(args).items()}}
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
