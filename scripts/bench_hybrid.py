"""Linear-attention hybrids on this CPU: a Gated DeltaNet layer's prefill per token against the
prompt's length, context parallelism over 2 ranks against 1 for the same work, and a hybrid's
decode step against its memory floor.

    python scripts/bench_hybrid.py [--part linear,cp,decode] [--dtype bfloat16] [--threads 2]
                                   [--lengths 8192,16384,32768,65536,131072] [--json out.json]

linear   one layer of Qwen3.6-35B-A3B's linear widths (dim 2048, 16 key / 32 value heads x 128,
         convolution 4), random weights, run as the engine's chunked prefill runs it: chunks of
         --chunk tokens, each from the state the one before left (GatedDeltaNet.forward). Time per
         token at each length; target: the slowest within 1.2x of the fastest (the layer is O(N)).
cp       the same layer over one chunk of --cp-tokens tokens: on 1 rank (1 thread, the world-1
         path of runtime/linear_layers.py) and on 2 gloo ranks of 1 thread each (the balanced
         pieces, the two exchanges); "same work" = 2 x the 2-rank wall / the 1-rank wall. Target:
         within 1.1x. Prints the bytes each exchange sent per rank.
decode   a decode step of a random hybrid (dim 1024, 12 layers: 9 Gated DeltaNet 8/16 heads x 128 +
         3 full attention 8 heads x 128, 2 KV heads; vocab 32768) after a --context-token prompt,
         on one rank (forward_with_cache: the recurrent form on the cache's states), median of
         --decode-steps; its floor reads every weight, the attention layers' KV and each linear
         layer's state twice (read, written back) at the read bandwidth measured here. Target:
         within 1.3x. Beside it, alternating, its twin with every layer attention (the baseline:
         what the layer path reaches for a plain model of these widths on this machine).

Alternates nothing across parts; within a part the timed calls are repeated and the median kept.
Prints an 80-column table; --json writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringctx.kernels.cpu_features import cpu_model
from ringctx.model import KVCache, forward_with_cache
from ringctx.model.config import LayerAttention, LinearShape, ModelConfig
from ringctx.model.gated_deltanet import GatedDeltaNet, LinearState
from ringctx.model.transformer import linear
from ringctx.model.weights import empty_model
from ringctx.parallel.comm import CommStats
from ringctx.parallel.layout import ShardLayout
from ringctx.planning.calibrate import median_seconds
from ringctx.planning.machine_speed import read_bandwidth

LAYER = LinearShape(key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_width=4)
DIM = 2048


def random_layer(dtype: torch.dtype, shape: LinearShape = LAYER, dim: int = DIM, seed: int = 0) -> GatedDeltaNet:
    """A Gated DeltaNet of random weights (gates of trained layers' ranges: A ~ 1..16, dt_bias ~ 0)."""
    layer = GatedDeltaNet(dim, shape, 1e-6, linear)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.77, generator=g))
            elif name == "dt_bias":
                p.zero_()
            elif name == "norm_weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "conv_weight" else p.shape[-1] ** -0.5))
    return layer.to(dtype)


# -- linear: per token against length ---------------------------------------------------------------
def bench_linear(lengths: list[int], chunk: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    layer = random_layer(dtype)
    g = torch.Generator().manual_seed(1)
    rows = []
    with torch.inference_mode():
        for n in lengths:
            x = torch.randn(n, DIM, generator=g).to(dtype)

            def run():
                state = None
                for start in range(0, n, chunk):
                    _, state = layer.forward(x[start:start + chunk], state)
            run() if n <= chunk else None  # a warm-up at the first length's shapes
            seconds = median_seconds(run, repeats, warmup=0)
            rows.append({"tokens": n, "seconds": seconds, "us_per_token": 1e6 * seconds / n})
    return rows


# -- cp: 2 ranks against 1 ---------------------------------------------------------------------------
def _cp_rank(rank: int, world: int, tokens: int, dtype_name: str, repeats: int, port: int, out) -> None:
    from ringctx.runtime.linear_layers import linear_layer_over_ranks

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = getattr(torch, dtype_name)
    layer = random_layer(dtype)
    x = torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    layout = ShardLayout.balanced([tokens], world)
    mine = layout.shard(x, rank)
    lengths = layout.piece_lengths(rank)
    state = LinearState.zeros(LAYER, dtype)
    stats = CommStats()
    with torch.inference_mode():
        linear_layer_over_ranks(layer, mine, lengths, state, dist.group.WORLD if world > 1 else None)  # warm-up
        times = []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            linear_layer_over_ranks(layer, mine, lengths, state, dist.group.WORLD if world > 1 else None, stats)
            times.append(time.perf_counter() - t0)
    if world > 1:
        wall = torch.tensor([max(times)] * 1)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put({"world": world, "seconds": statistics.median(times),
                 "conv_bytes": stats.bytes_sent("linear-conv") // repeats,
                 "state_bytes": stats.bytes_sent("linear-state") // repeats})
    if world > 1:
        dist.destroy_process_group()


def bench_cp(tokens: int, dtype: torch.dtype, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    out = {}
    for world in (1, 2):
        queue = ctx.Queue()
        port = 29600 + os.getpid() % 200 + world
        procs = [ctx.Process(target=_cp_rank, args=(r, world, tokens, str(dtype).removeprefix("torch."), repeats, port,
                                                    queue)) for r in range(world)]
        for p in procs:
            p.start()
        out[world] = queue.get(timeout=1800)
        for p in procs:
            p.join()
    return {"tokens": tokens, "one_rank_s": out[1]["seconds"], "two_ranks_s": out[2]["seconds"],
            "same_work_ratio": 2 * out[2]["seconds"] / out[1]["seconds"],
            "conv_exchange_bytes_per_rank": out[2]["conv_bytes"], "state_exchange_bytes_per_rank": out[2]["state_bytes"]}


# -- decode: a step against its floor ---------------------------------------------------------------
HYBRID = ModelConfig(
    name="bench-hybrid-1024", vocab_size=32768, dim=1024, n_layers=12, n_heads=8, n_kv_heads=2, ffn_dim=3072,
    head_dim=128, norm_eps=1e-6, qk_norm=True, norm_plus_one=True, attn_output_gate=True, max_seq_len=262144,
    layer_attention=tuple(LayerAttention(rotary_dim=32) for _ in range(12)),
    layer_linear=tuple(None if (i + 1) % 4 == 0 else LinearShape(8, 16, 128, 128, 4) for i in range(12)))


DENSE_TWIN = dataclasses.replace(HYBRID, name="bench-dense-1024", layer_linear=())
"""The same model with every layer attention: what a plain model of these widths reaches here."""


def bench_decode(context: int, steps: int, dtype: torch.dtype, config: ModelConfig = HYBRID) -> dict:
    model = empty_model(config, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_weight")):
                p.fill_(0.0 if "linear_attn" not in name else 1.0)
            elif name.endswith("A_log"):
                p.uniform_(0.0, 2.77, generator=g)
            elif name.endswith("dt_bias"):
                p.zero_()
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(dtype))
    cache = KVCache.for_model(config, context + steps + 1, dtype=dtype)
    prompt = torch.randint(0, config.vocab_size, (context,), generator=g)
    times = []
    with torch.inference_mode():
        for start in range(0, context, 4096):
            forward_with_cache(model, prompt[start:start + 4096], cache, logits="none", sequence_end=context)
        token = torch.tensor([1])
        for _ in range(steps):
            t0 = time.perf_counter()
            forward_with_cache(model, token, cache)
            times.append(time.perf_counter() - t0)
    element = torch.empty(0, dtype=dtype).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = config.kv_bytes_per_token(element) * context
    states = 2 * config.linear_state_bytes(element)
    bandwidth = read_bandwidth()
    floor = (weights + kv + states) / bandwidth
    step = statistics.median(times)
    return {"model": config.name, "context": context, "step_ms": 1e3 * step, "floor_ms": 1e3 * floor, "ratio": step / floor,
            "weights_bytes": weights, "kv_bytes": kv, "state_bytes_read_and_written": states,
            "read_bandwidth_gb_s": bandwidth / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="linear,cp,decode")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--cp-tokens", type=int, default=32768)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    parts = args.part.split(",")
    report = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "threads": args.threads}
    print(f"{report['cpu']}, {report['date']}, {args.dtype}, {args.threads} threads")
    if "linear" in parts:
        rows = bench_linear([int(n) for n in args.lengths.split(",")], args.chunk, dtype, args.repeats)
        report["linear"] = rows
        fastest = min(r["us_per_token"] for r in rows)
        print(f"\nGated DeltaNet layer (dim {DIM}, {LAYER.describe()}), chunks of {args.chunk}")
        print(f"{'tokens':>10} {'seconds':>10} {'us/token':>10} {'x fastest':>10}")
        for r in rows:
            print(f"{r['tokens']:>10,} {r['seconds']:>10.2f} {r['us_per_token']:>10.1f} "
                  f"{r['us_per_token'] / fastest:>10.2f}")
        report["linear_spread"] = max(r["us_per_token"] for r in rows) / fastest
        print(f"slowest / fastest per token: {report['linear_spread']:.2f} (target <= 1.2)")
    if "cp" in parts:
        cp = bench_cp(args.cp_tokens, dtype, args.repeats)
        report["cp"] = cp
        print(f"\nOne chunk of {cp['tokens']:,} tokens through the layer, 1 thread a rank")
        print(f"{'1 rank s':>10} {'2 ranks s':>10} {'2 x W2 / W1':>12} {'conv B/rank':>12} {'state B/rank':>13}")
        print(f"{cp['one_rank_s']:>10.2f} {cp['two_ranks_s']:>10.2f} {cp['same_work_ratio']:>12.2f} "
              f"{cp['conv_exchange_bytes_per_rank']:>12,} {cp['state_exchange_bytes_per_rank']:>13,}")
    if "decode" in parts:  # the hybrid and its all-attention twin, alternating
        rows = [bench_decode(args.context, args.decode_steps, dtype, config)
                for _ in range(2) for config in (HYBRID, DENSE_TWIN)]
        report["decode"] = rows
        print(f"\nDecode step after {args.context:,} tokens: {HYBRID.name} ({HYBRID.attention_summary()}) and "
              f"its twin of 12 attention layers")
        print(f"{'model':<18} {'step ms':>8} {'floor ms':>9} {'ratio':>6} {'weights MB':>11} {'KV MB':>7} "
              f"{'states MB':>10}")
        for d in rows:
            print(f"{d['model']:<18} {d['step_ms']:>8.2f} {d['floor_ms']:>9.2f} {d['ratio']:>6.2f} "
                  f"{d['weights_bytes'] / 1e6:>11.1f} {d['kv_bytes'] / 1e6:>7.1f} "
                  f"{d['state_bytes_read_and_written'] / 1e6:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
