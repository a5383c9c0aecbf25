"""A mixture of experts shaped like a scaled-down Qwen3-30B-A3B against its dense twin, in one run:
SmolLM2-135M's shapes (dim 576, 30 layers, 9 heads, 3 KV heads, vocab 49152, tied embeddings) with
every layer's MLP (ffn 1536) replaced by 32 experts of width 384 (a quarter), top 4 (so a token
reaches the dense MLP's weights), random weights.

    python scripts/bench_moe.py [--tokens 8192] [--chunk 8192] [--repeats 2] [--decode-steps 8]
                                [--dtype bfloat16] [--threads 2] [--json out.json]

In one process, alternating the two models each repeat (a shared machine drifts), on one rank:
  - prefill of --tokens random tokens (forward_with_cache, --chunk tokens a call: the layer path,
    the experts grouped per chunk, moe.py): the share of the GEMM peak it reaches, its FLOPs (the
    planner's: every layer's linear layers with the experts a token reaches, and the causal
    attention) / seconds / this machine's GEMM peak (`gemm_peak`: the best of ringctx's and
    PyTorch's products over a dense layer's four matrices at 2048 rows, measured here). Target: the MoE model's
    share at least 0.7x the dense model's (paired by repeat, median).
  - a batched step of --batch sequences over that document (FusedBatchStep): ms, against the
    lone step and a floor that adds the experts the other rows reach (uniform routing: a layer
    reads E (1 - (1 - k/E)^B) experts, 21 of 32 for 8 rows);
  - decode steps after it (DecodeStep: the fused C step where it applies, else the layer path; the
    MoE model both ways): ms per step (median of --decode-steps) against the memory floor, the
    bytes a step reads once (`machine_speed.decode_bytes_per_token`: attention, router, the 4
    experts a token reaches, the tied embedding as head, the K/V of the context) at the read
    bandwidth measured here. Target: MoE within 1.3x of its floor.

Prints an 80-column table and the paired ratios; --json writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from ringctx.kernels.cpu_features import cpu_model
from ringctx.model import KVCache, forward_with_cache
from ringctx.model.config import Experts
from ringctx.model.decode_step import AttentionSource, DecodeStep, FusedBatchStep
from ringctx.model.presets import get_preset
from ringctx.model.weights import empty_model
from ringctx.model.transformer import linear
from ringctx.planning.machine_speed import decode_bytes_per_token, read_bandwidth
from ringctx.planning.work import chunk_flops

DENSE = dataclasses.replace(get_preset("smollm2-135m"), max_seq_len=32768)
MOE = dataclasses.replace(DENSE, name="smollm2-135m-moe-32x384-top4",
                          layer_experts=(Experts(32, 4, DENSE.ffn_dim // 4),) * DENSE.n_layers)


def random_model(config, dtype):
    """Random weights (norms 1, the rest N(0, 0.02)), filled in the model dtype in place."""
    model = empty_model(config, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(dtype))
    return model.eval()


def gemm_peak(dense, rows):
    """This machine's GEMM peak, FLOP/s: the best of ringctx's `linear` and PyTorch's over one
    dense layer's four weight matrices at `rows` rows (the median of 5 after 2 warm-ups; as
    scripts/bench_serve.py measures it)."""
    block = dense.layers[0]
    weights = [block.attention.wqkv.weight, block.attention.wo.weight, block.feed_forward.w13.weight,
               block.feed_forward.w2.weight]
    xs = [torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights]
    flops = 2 * rows * sum(w.numel() for w in weights)
    best = 0.0
    with torch.inference_mode():
        for fn in (linear, torch.nn.functional.linear):
            times = []
            for i in range(7):
                t0 = time.perf_counter()
                [fn(x, w) for x, w in zip(xs, weights)]
                times.append(time.perf_counter() - t0)
            best = max(best, flops / statistics.median(times[2:]))
    return best


def prefill(model, ids, chunk):
    """The prompt into a fresh cache, `chunk` tokens a call: (cache, seconds)."""
    cache = KVCache.for_model(model.config, len(ids) + 64, dtype=model.dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, len(ids), chunk):
            forward_with_cache(model, ids[start:start + chunk], cache, logits="none", sequence_end=len(ids))
        return cache, time.perf_counter() - t0


def decode_ms(model, cache, steps, fused):
    """Median ms of `steps` greedy-ish steps (token ids fixed) after two warm-up steps; the cache's
    length is put back after, so the next measurement starts from the same context."""
    length = cache.length
    step = DecodeStep(model, cache, fused=fused)
    times = []
    with torch.inference_mode():
        for i in range(steps + 2):
            t0 = time.perf_counter()
            step(7 + i)
            times.append(time.perf_counter() - t0)
    cache.length = length
    return 1e3 * statistics.median(times[2:]), step.is_fused


def batch_ms(model, cache, rows, steps):
    """Median ms of `steps` fused batch steps of `rows` sequences over the cache as their shared
    document (each with its own one-row cache after it), after two warm-ups."""
    step = FusedBatchStep.build(model)
    own = [KVCache.for_model(model.config, 4, dtype=model.dtype) for _ in range(rows)]
    documents = [AttentionSource(cache, list(range(rows)), cache.length)]
    sources = [AttentionSource(c, [i], 1, write_row=0) for i, c in enumerate(own)]
    times = []
    with torch.inference_mode():
        for i in range(steps + 2):
            t0 = time.perf_counter()
            step([(7 + i + 3 * r) % model.config.vocab_size for r in range(rows)], [cache.length] * rows, documents,
                 sources)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def experts_read(experts: Experts, rows: int) -> float:
    """Experts a layer reads for `rows` rows routed uniformly at random: E (1 - (1 - k/E)^rows)."""
    return experts.n_experts * (1 - (1 - experts.experts_per_token / experts.n_experts) ** rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="rows of the batched decode step (0: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    models = {"dense": random_model(DENSE, dtype), "moe": random_model(MOE, dtype)}
    ids = torch.randint(3, DENSE.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1))
    bandwidth = read_bandwidth(threads=args.threads)
    peak = gemm_peak(models["dense"], 2048)
    flops = {name: sum(chunk_flops(min(args.chunk, args.tokens - s), s, m.config)
                       for s in range(0, args.tokens, args.chunk)) for name, m in models.items()}
    floor_ms = {name: 1e3 * decode_bytes_per_token(m, args.tokens) / bandwidth for name, m in models.items()}
    # a batch step: the lone step's bytes, plus the experts its other rows add (uniform routing)
    experts = MOE.layer_experts[0]
    expert_bytes = MOE.n_layers * 3 * MOE.dim * experts.expert_ffn_dim * torch.finfo(dtype).bits // 8
    extra = (experts_read(experts, args.batch) - experts.experts_per_token) * expert_bytes if args.batch else 0
    batch_floor_ms = {"dense": floor_ms["dense"], "moe": floor_ms["moe"] + 1e3 * extra / bandwidth}
    for m in models.values():  # warm-up: kernels built, pages touched
        prefill(m, ids[:256], 256)
    runs = []
    for repeat in range(args.repeats):
        run = {}
        for name, model in models.items():
            cache, seconds = prefill(model, ids, args.chunk)
            run[name] = {"prefill_s": seconds, "gemm_share": flops[name] / seconds / peak}
            run[name]["decode_ms"], run[name]["fused"] = decode_ms(model, cache, args.decode_steps, True)
            if name == "moe":
                run[name]["layer_path_decode_ms"], _ = decode_ms(model, cache, args.decode_steps, False)
            if args.batch:
                run[name]["batch_decode_ms"] = batch_ms(model, cache, args.batch, args.decode_steps)
            del cache
        runs.append(run)
        print(f"repeat {repeat}: " + ", ".join(f"{n} prefill {r['prefill_s']:.1f} s decode {r['decode_ms']:.1f} ms"
                                               for n, r in run.items()), flush=True)

    def median(name, key):
        return statistics.median(r[name][key] for r in runs)

    share_ratio = statistics.median(r["moe"]["gemm_share"] / r["dense"]["gemm_share"] for r in runs)
    print(f"\n{args.tokens} tokens, {args.dtype}, {args.threads} threads; read {bandwidth / 1e9:.1f} GB/s, "
          f"GEMM peak {peak / 1e9:.0f} GFLOP/s")
    print(f"{'model':<7}{'prefill s':>10}{'TFLOP':>7}{'GEMM share':>11}{'decode ms':>10}{'floor ms':>9}"
          f"{'x floor':>8}{'fused':>6}{'layer ms':>10}")
    for name in models:
        layer = f"{median(name, 'layer_path_decode_ms'):.1f}" if name == "moe" else "-"
        print(f"{name:<7}{median(name, 'prefill_s'):>10.2f}{flops[name] / 1e12:>7.2f}"
              f"{median(name, 'gemm_share'):>11.2f}{median(name, 'decode_ms'):>10.1f}{floor_ms[name]:>9.1f}"
              f"{median(name, 'decode_ms') / floor_ms[name]:>8.2f}{'yes' if runs[0][name]['fused'] else 'no':>6}"
              f"{layer:>10}")
    print(f"MoE / dense GEMM share (paired median): {share_ratio:.2f} (target >= 0.70); MoE decode "
          f"{median('moe', 'decode_ms') / floor_ms['moe']:.2f}x its floor (target <= 1.30); fused vs layer "
          f"path {median('moe', 'layer_path_decode_ms') / median('moe', 'decode_ms'):.2f}x faster")
    if args.batch:
        print(f"batch of {args.batch} over the document: " + "; ".join(
            f"{name} {median(name, 'batch_decode_ms'):.1f} ms ({median(name, 'batch_decode_ms') / median(name, 'decode_ms'):.2f}x"
            f" its lone step; floor {batch_floor_ms[name]:.1f} ms)" for name in models)
            + f"; MoE layers read {experts_read(experts, args.batch):.1f} experts (uniform routing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "read_bandwidth_gb_s": bandwidth / 1e9, "gemm_peak_flops_per_s": peak,
                       "flops": flops, "decode_floor_ms": floor_ms, "batch_floor_ms": batch_floor_ms, "share_ratio": share_ratio, "runs": runs,
                       "cpu": cpu_model()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
