"""What an ingest's checkpoint costs: the same ingest with and without it, paired and alternating.

    python scripts/bench_checkpoint.py [--model smollm2-135m] [--tokens 8192,65536] [--pairs 3]
                                       [--nproc 2] [--dtype bfloat16] [--chunk-tokens N] [--json out.json]

Each pair runs the ingest of --tokens random token ids (Engine.start_ingest, a document's
prefill: chunks, hand-off) twice on one Engine of --nproc spawned ranks, once writing its
checkpoint into a temporary directory beside this script's working directory (every rank appends
its rows of each chunk; removed after) and once without; the first of the two alternates from
pair to pair. Reported per length: the median wall time of each, the median of the pairs'
ratios (target: at most 1.05), the checkpoint's bytes and MB/s. Prints an 80-column table;
--json writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from ringctx.engine import Engine
from ringctx.kernels.cpu_features import cpu_model


def ingest_seconds(engine, ids: list[int], checkpoint: str | None) -> float:
    start = time.perf_counter()
    job = engine.start_ingest(ids, checkpoint=checkpoint, keep_checkpoint=checkpoint is not None)
    while not job.done:
        job.step()
    document = job.finish().document
    seconds = time.perf_counter() - start
    engine.drop_document(document)
    return seconds


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench(engine, tokens: int, pairs: int, vocab: int) -> dict:
    ids = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    with_s, without_s, ratios, written = [], [], [], 0
    for pair in range(pairs):
        where = tempfile.mkdtemp(prefix="ringctx-bench-checkpoint-", dir=".")
        checkpoint = os.path.join(where, "doc.ingest")
        try:
            timed = {}
            for kind in (("with", "without") if pair % 2 == 0 else ("without", "with")):
                timed[kind] = ingest_seconds(engine, ids, checkpoint if kind == "with" else None)
            written = directory_bytes(checkpoint)
        finally:
            shutil.rmtree(where, ignore_errors=True)
        with_s.append(timed["with"])
        without_s.append(timed["without"])
        ratios.append(timed["with"] / timed["without"])
        print(f"  {tokens:,} tokens, pair {pair + 1}: with {timed['with']:.2f} s, without {timed['without']:.2f} s "
              f"({ratios[-1]:.3f}x)", flush=True)
    return {"tokens": tokens, "with_s": with_s, "without_s": without_s, "ratios": ratios,
            "with_median_s": statistics.median(with_s), "without_median_s": statistics.median(without_s),
            "ratio_median": statistics.median(ratios), "checkpoint_bytes": written,
            "checkpoint_mb_per_s": written / 1e6 / statistics.median(with_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", default="8192,65536")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "model": args.model, "nproc": args.nproc,
              "dtype": args.dtype, "rows": []}
    with Engine(args.model, nproc=args.nproc, dtype=args.dtype, chunk_tokens=args.chunk_tokens,
                prefix_cache=False, allow_long_context=True) as engine:  # the cost, not the answers
        report["chunk_tokens"] = engine.chunk_tokens
        print(f"{report['cpu']}, {report['date']}, {args.model} {args.dtype}, {args.nproc} ranks, chunks of "
              f"{engine.chunk_tokens:,}", flush=True)
        for tokens in (int(t) for t in args.tokens.split(",")):
            report["rows"].append(bench(engine, tokens, args.pairs, engine.model.config.vocab_size))
    print(f"\n{'tokens':>8} {'with s':>9} {'without s':>10} {'ratio':>7} {'checkpoint MB':>14} {'MB/s':>7}")
    for r in report["rows"]:
        print(f"{r['tokens']:>8,} {r['with_median_s']:>9.2f} {r['without_median_s']:>10.2f} {r['ratio_median']:>7.3f} "
              f"{r['checkpoint_bytes'] / 1e6:>14.1f} {r['checkpoint_mb_per_s']:>7.1f}")
    print("ratio: the median of the pairs' with / without (target <= 1.05)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
