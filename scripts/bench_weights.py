#!/usr/bin/env python
"""A decode step reading int8 weights against the same step reading them in bf16, side by side.

    python scripts/bench_weights.py [--contexts 64 2048 8192] [--kv-dtypes model fp8]
                                    [--rows 1 2 4 8] [--answers 10] [--steps 16] [--rounds 4]
                                    [--json out.json]

SmolLM2-135M in bf16 with int8 weights (ringctx.model.int8_weights), one process, one cache per
context of random token ids. The two sides are the same model (the same values): "int8" is the
fused decode step reading the codes, "bf16" the same step with the codes hidden, reading the bf16
values those codes stand for; their logits are equal bit for bit (checked here on every first
step). They alternate within each round; per configuration the median step of each side, their
paired ratio (median over rounds), and each side's memory floor (the bytes a step reads at least,
machine_speed.decode_bytes_per_token, at the read bandwidth measured here). RINGCTX_CPU_ISA picks
the kernel variant (avx512, avx2, portable).

--rows: the products alone, as a batch step of R rows would run them: every block matrix of the
model times R activation rows, small_linear_int8 over the codes (allowed any R here, past
selection.INT8_MAX_ROWS) against small_linear over the values, alternating; the same results
bit for bit. This is the measurement INT8_MAX_ROWS comes from.

--answers N: what the rounding does to answers: the embedded SmolLM2 with bf16 weights and with
int8 weights (two engines, bf16 activations), the same 8,000-token document (bench_serve's) and
N of its questions, 32 greedy tokens each: how many answers are identical, and the first token
where each pair differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

MODEL = "smollm2-135m"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="*", default=[64, 2048, 8192])
    p.add_argument("--kv-dtypes", nargs="+", default=["model", "fp8"])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8], help="activation rows of the products alone")
    p.add_argument("--answers", type=int, default=0, help="questions answered by both weights (0: none)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per side and round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", metavar="PATH", default="bench_weights.json")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from ringctx.kernels import build, cpu, selection
    from ringctx.kernels.cpu_features import cpu_model
    from ringctx.model import KVCache, forward_with_cache, load_model
    from ringctx.model.decode_step import DecodeStep
    from ringctx.model.int8_weights import quantized_matrices
    from ringctx.planning.machine_speed import decode_bytes_per_token, read_bandwidth

    model = load_model(MODEL, dtype="bfloat16", device="cpu", weights="int8")
    kept = {id(m.weight): m.weight._ringctx_int8 for m in quantized_matrices(model)}

    def use_codes(on: bool) -> None:
        for m in quantized_matrices(model):
            m.weight._ringctx_int8 = kept[id(m.weight)] if on else None

    bandwidth = read_bandwidth()
    variant = build.active_variant()
    print(f"{cpu_model()}: {variant.name if variant else 'no'} kernels, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads; {args.steps} steps x {args.rounds} rounds", flush=True)
    rows = []
    for context in args.contexts:
        ids = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
        for kv_dtype in args.kv_dtypes:
            cache = KVCache.for_model(model.config, context + args.steps + 1, dtype=model.dtype, kv_dtype=kv_dtype)
            with torch.inference_mode():
                forward_with_cache(model, ids, cache, logits="none")
            times = {True: [], False: []}
            first = {}
            for _ in range(args.rounds):
                for codes in (True, False):
                    use_codes(codes)
                    cache.length = context
                    step = DecodeStep(model, cache)
                    first[codes] = step(1)
                    steps = []
                    for _ in range(args.steps - 1):
                        t0 = time.perf_counter()
                        step(1)
                        steps.append(time.perf_counter() - t0)
                    times[codes].append(statistics.median(steps))
            if not torch.equal(first[True], first[False]):
                raise SystemExit("the step over the codes differs from the step over their values")
            use_codes(True)
            int8_bytes = decode_bytes_per_token(model, context, cache.bytes_per_token)
            use_codes(False)
            bf16_bytes = decode_bytes_per_token(model, context, cache.bytes_per_token)
            use_codes(True)
            row = {"context": context, "kv_dtype": kv_dtype,
                   "int8_ms": 1000 * statistics.median(times[True]), "bf16_ms": 1000 * statistics.median(times[False]),
                   "ratio": statistics.median(a / b for a, b in zip(times[True], times[False])),
                   "int8_floor_ms": 1000 * int8_bytes / bandwidth, "bf16_floor_ms": 1000 * bf16_bytes / bandwidth,
                   "rounds_ms": {"int8": [1000 * t for t in times[True]], "bf16": [1000 * t for t in times[False]]}}
            rows.append(row)
            print(f"context {context:>6} kv {kv_dtype:>5}: int8 {row['int8_ms']:6.2f} ms "
                  f"(floor {row['int8_floor_ms']:5.1f})  bf16 {row['bf16_ms']:6.2f} ms "
                  f"(floor {row['bf16_floor_ms']:5.1f})  int8/bf16 {row['ratio']:.2f}", flush=True)
    products = []
    selection.INT8_MAX_ROWS = max(args.rows, default=1)  # the codes for any rows, to compare
    matrices = [(kept[id(m.weight)], m.weight) for m in quantized_matrices(model)]
    for rows in args.rows:
        xs = {n: torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)).bfloat16()
              for n in {w.shape[1] for _, w in matrices}}
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for codes in (True, False):
                t0 = time.perf_counter()
                for q, w in matrices:
                    x = xs[w.shape[1]]
                    y = cpu.small_linear_int8(x, q.codes, q.exponents) if codes else cpu.small_linear(x, w)
                    assert y is not None, "the kernels declined"
                times[codes].append(time.perf_counter() - t0)
        q, w = matrices[0]
        x = xs[w.shape[1]]
        if not torch.equal(cpu.small_linear_int8(x, q.codes, q.exponents), cpu.small_linear(x, w)):
            raise SystemExit("the product over the codes differs from the product over their values")
        row = {"rows": rows, "int8_ms": 1000 * statistics.median(times[True]),
               "bf16_ms": 1000 * statistics.median(times[False]),
               "ratio": statistics.median(a / b for a, b in zip(times[True], times[False]))}
        products.append(row)
        print(f"products of {rows} row(s), {len(matrices)} matrices: int8 {row['int8_ms']:6.2f} ms  "
              f"bf16 {row['bf16_ms']:6.2f} ms  int8/bf16 {row['ratio']:.2f}", flush=True)
    agreement = compare_answers(args.answers) if args.answers else None
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_model(),
              "variant": variant.name if variant else None, "read_bandwidth_bytes_per_s": bandwidth,
              "threads": torch.get_num_threads(), "model": MODEL, "args": vars(args), "rows": rows,
              "products": products, "answers": agreement}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
    return 0


def compare_answers(count: int) -> dict:
    """Greedy answers of SmolLM2 with bf16 and with int8 weights to `count` questions (see --answers)."""
    import bench_serve  # its neighbour in scripts/ (on the path when run as a script)
    from ringctx.engine import Engine
    from ringctx.model.loader import embedded_gguf_path
    from ringctx.model.tokenizer import load_tokenizer

    text, _ = bench_serve.make_document(8000, 1, load_tokenizer(embedded_gguf_path()))
    questions = bench_serve.QUESTIONS[:count]
    answers = {}
    for weights in ("model", "int8"):
        with Engine(MODEL, nproc=1, dtype="bfloat16", weights=weights) as engine:
            document = engine.ingest(text)
            answers[weights] = []
            for q in questions:
                generation = engine.generate(document, q, max_new_tokens=32, temperature=0)
                "".join(generation)
                answers[weights].append(generation.result.token_ids)
    first_difference = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        for a, b in zip(answers["model"], answers["int8"])]
    same = sum(a == b for a, b in zip(answers["model"], answers["int8"]))
    print(f"answers: {same} of {len(questions)} identical with int8 weights; first differing token "
          f"{first_difference} (32 tokens each)", flush=True)
    return {"identical": same, "questions": len(questions), "first_difference": first_difference}


if __name__ == "__main__":
    sys.exit(main())
