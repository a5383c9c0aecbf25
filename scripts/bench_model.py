#!/usr/bin/env python
"""Single-process prefill and decode speed: ringctx's decoder next to transformers, same weights.

For each dtype and prompt length: prefill the prompt (logits of the last token only, on both
sides), then decode `--decode` greedy tokens one at a time. ringctx runs its public path
(`model.generate`: static KV cache); transformers runs LlamaForCausalLM (sdpa attention,
DynamicCache) in the loop its `generate` runs, built from ringctx's weights so that both compute
the same model. The two alternate for `--rounds` rounds, so that a shared machine whose speed
drifts slows both alike; the table shows medians over rounds and the median of the per-round
ratios ("paired"), which cancels most of the drift. Prints a table and optionally writes JSON.

Beside each decode row: the floor, the time to read what a decode step must read once (every
weight but the embedding table, whose one row is negligible, and the KV cache at the row's mean
context) at this machine's read bandwidth (ringctx.planning.machine_speed.read_bandwidth, measured before
and after the rows; the larger counts), and ringctx's step as a multiple of it.
`--cpu-isa avx2` runs ringctx's AVX2 kernels on an AVX-512 machine (see ringctx.kernels.build);
`--torch-isa avx2` keeps PyTorch, oneDNN and MKL to AVX2 as well (so transformers runs the code it
runs on an AVX2-only CPU: no AVX-512, no AMX, no bf16 units). With both, every instruction either
side executes is one an AVX2-only machine has; the memory system is still this machine's.

    python scripts/bench_model.py                       # SmolLM2-135M, 2K and 8K, bf16 and fp32
    python scripts/bench_model.py --quick               # 256-token prompt, 8 decode steps
    python scripts/bench_model.py --prefill 2048 --dtypes bf16 --json out/bench_model.json
    python scripts/bench_model.py --cpu-isa avx2        # the AVX2 kernels on this machine
    python scripts/bench_model.py --cpu-isa avx2 --torch-isa avx2   # both sides as on an AVX2 CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


# The switches that cap each of PyTorch's CPU code paths, read once when each library starts.
TORCH_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2",          # ATen's own vectorised kernels
             "ONEDNN_MAX_CPU_ISA": "AVX2",           # oneDNN matmul/linear (no AVX-512, no AMX)
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},     # MKL BLAS
}


def cap_torch_isa(name: str) -> None:
    """Restart this script with PyTorch's instruction set capped at `name`: the switches are read
    when the libraries start, so they must be in the environment before this process imports torch."""
    wanted = TORCH_ISA_ENV[name]
    if all(os.environ.get(key) == value for key, value in wanted.items()):
        return
    os.environ.update(wanted)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset, GGUF file or Hugging Face directory")
    p.add_argument("--prefill", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
    p.add_argument("--decode", type=int, default=64, help="tokens decoded after each prompt")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], help="bf16, fp32, fp16")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="a 256-token prompt and 8 decode steps (a smoke run)")
    p.add_argument("--no-transformers", action="store_true", help="time ringctx only")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of ringctx and transformers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-isa", default=None, help="CPU kernel variant: avx512, avx2 or portable (default: auto)")
    p.add_argument("--torch-isa", choices=sorted(TORCH_ISA_ENV), default=None,
                   help="keep PyTorch, oneDNN and MKL to this instruction set (default: what the CPU has)")
    args = p.parse_args()
    if args.quick:
        args.prefill, args.decode, args.rounds = [256], 8, 1
    return args


def transformers_twin(model):
    """transformers' model of the same config, holding ringctx's weights (q/k/v and gate/up split)."""
    import transformers

    config = model.config
    hf_config = transformers.AutoConfig.for_model(**hf_config_dict(config))
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
    D, hq, hkv = config.head_dim, config.n_heads, config.n_kv_heads
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.output.weight}
    for i, layer in enumerate(model.layers):
        h = f"model.layers.{i}"
        sd[f"{h}.input_layernorm.weight"] = layer.attention_norm.weight
        sd[f"{h}.post_attention_layernorm.weight"] = layer.ffn_norm.weight
        for kind in ("weight", "bias"):
            fused = getattr(layer.attention.wqkv, kind)
            if fused is not None:
                q, k, v = fused.split([hq * D, hkv * D, hkv * D])
                sd[f"{h}.self_attn.q_proj.{kind}"], sd[f"{h}.self_attn.k_proj.{kind}"] = q, k
                sd[f"{h}.self_attn.v_proj.{kind}"] = v
        sd[f"{h}.self_attn.o_proj.weight"] = layer.attention.wo.weight
        if layer.attention.wo.bias is not None:
            sd[f"{h}.self_attn.o_proj.bias"] = layer.attention.wo.bias
        gate, up = layer.feed_forward.w13.weight.split(config.ffn_dim)
        sd[f"{h}.mlp.gate_proj.weight"], sd[f"{h}.mlp.up_proj.weight"] = gate, up
        sd[f"{h}.mlp.down_proj.weight"] = layer.feed_forward.w2.weight
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False, assign=True)
    if config.tie_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)  # its buffers were on meta
    return hf.eval()


def time_ringctx(model, ids: torch.Tensor, n_decode: int) -> dict:
    result = model.generate(ids, max_new_tokens=n_decode + 1, stop_token_ids=[])
    steps = result.token_times_s
    return {"prefill_s": result.time_to_first_token_s,
            "prefill_tokens_per_s": len(ids) / result.time_to_first_token_s,
            "decode_ms_per_token": 1000 * statistics.mean(steps) if steps else None,
            "decode_ms_p50": 1000 * statistics.median(steps) if steps else None,
            "first_token": result.token_ids[0]}


def time_transformers(hf, ids: torch.Tensor, n_decode: int) -> dict:
    import inspect

    # transformers 5 renamed past_key_values to cache (the old name still works, with a warning)
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf(ids[None], use_cache=True, logits_to_keep=1)
        token = out.logits[0, -1].float().argmax()
        first = int(token)
        prefill = time.perf_counter() - t0
        cache, steps = out[cache_arg], []
        for _ in range(n_decode):
            t = time.perf_counter()
            out = hf(token.view(1, 1), use_cache=True, **{cache_arg: cache})
            cache = out[cache_arg]
            token = out.logits[0, -1].float().argmax()
            int(token)
            steps.append(time.perf_counter() - t)
    return {"prefill_s": prefill, "prefill_tokens_per_s": len(ids) / prefill,
            "decode_ms_per_token": 1000 * statistics.mean(steps) if steps else None,
            "decode_ms_p50": 1000 * statistics.median(steps) if steps else None,
            "first_token": first}


def main() -> None:
    args = parse_args()
    if args.torch_isa:
        cap_torch_isa(args.torch_isa)
    torch.set_num_threads(args.threads)
    from ringctx.kernels import build
    from ringctx.kernels.report import cpu_kernels_status
    from ringctx.planning.machine_speed import decode_bytes_per_token, read_bandwidth
    from ringctx.model import load_model, resolve_dtype
    from ringctx.model.config_hf import hf_config_dict

    build.use_variant(args.cpu_isa)
    bandwidths = [read_bandwidth(threads=args.threads)]
    print(f"read bandwidth {bandwidths[0] / 1e9:.1f} GB/s ({args.threads} threads); CPU kernels: "
          f"{cpu_kernels_status()}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for dtype_name in args.dtypes:
        dtype = resolve_dtype(dtype_name)
        model = load_model(args.model, dtype=dtype, device="cpu")
        hf = None if args.no_transformers else transformers_twin(model)
        warm = torch.randint(0, model.config.vocab_size, (256,), generator=gen)  # >= UPCAST_MIN_ROWS
        time_ringctx(model, warm, 2)
        if hf is not None:
            time_transformers(hf, warm, 2)
        for n in args.prefill:
            ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
            rounds = []
            for _ in range(args.rounds):
                rounds.append({"ringctx": time_ringctx(model, ids, args.decode)})
                if hf is not None:
                    rounds[-1]["transformers"] = time_transformers(hf, ids, args.decode)
            row = {"dtype": str(dtype).replace("torch.", ""), "prompt_tokens": n, "decode_tokens": args.decode,
                   "decode_bytes_per_token": decode_bytes_per_token(model, n + args.decode / 2),
                   "rounds": rounds, **summarize(rounds)}
            rows.append(row)
            print_row(row)
        del model, hf
    bandwidths.append(read_bandwidth(threads=args.threads))
    bandwidth = max(bandwidths)
    for row in rows:  # the floor at the better of the two readings: a step can be no faster
        row["floor_ms"] = 1e3 * row["decode_bytes_per_token"] / bandwidth
        if row["ringctx"]["decode_ms_per_token"] is not None:
            row["ringctx_over_floor"] = row["ringctx"]["decode_ms_p50"] / row["floor_ms"]
    from ringctx.kernels.cpu_features import cpu_model

    report = {
        "model": args.model, "threads": args.threads, "torch": torch.__version__,
        "transformers": _version("transformers"), "cpu": cpu_model(), "machine": platform.machine(),
        "read_bandwidth_bytes_per_s": bandwidths, "cpu_kernel_variant": getattr(build.active_variant(), "name", None),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_isa_env": {key: os.environ[key] for env in TORCH_ISA_ENV.values() for key in env if key in os.environ},
        "rounds": args.rounds,
        "cpu_flags": _cpu_features(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": rows,
    }
    print_table(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds per side, and the medians of the per-round ratios ringctx / transformers."""
    out = {}
    for side in ("ringctx", "transformers"):
        if side in rounds[0]:
            out[side] = {key: statistics.median(r[side][key] for r in rounds)
                         for key in ("prefill_s", "prefill_tokens_per_s", "decode_ms_per_token", "decode_ms_p50")
                         if rounds[0][side][key] is not None}
            out[side]["first_token"] = rounds[0][side]["first_token"]
            out[side].setdefault("decode_ms_per_token", None)
    if "transformers" in out:
        out["paired"] = {
            "prefill_speedup": statistics.median(r["transformers"]["prefill_s"] / r["ringctx"]["prefill_s"] for r in rounds),
            "decode_time_ratio": statistics.median(r["ringctx"]["decode_ms_p50"] / r["transformers"]["decode_ms_p50"]
                                                   for r in rounds) if out["ringctx"]["decode_ms_per_token"] else None,
        }
    return out


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def _cpu_features() -> dict:
    from ringctx.kernels.cpu_features import cpu_has_fast_bf16
    from ringctx.kernels.report import cpu_kernels_status
    from ringctx.kernels.selection import amx_available

    return {"native_bf16": cpu_has_fast_bf16(), "amx_attention": amx_available(),
            "cpu_kernels": cpu_kernels_status()}


def print_row(row: dict) -> None:
    r, t = row["ringctx"], row.get("transformers")
    msg = f"{row['dtype']:>8} {row['prompt_tokens']:>6} tok: prefill {r['prefill_tokens_per_s']:8.0f} tok/s"
    if r["decode_ms_per_token"] is not None:
        msg += f", decode {r['decode_ms_per_token']:6.1f} ms/tok"
    if t:
        msg += f" | transformers {t['prefill_tokens_per_s']:8.0f} tok/s"
        if t["decode_ms_per_token"] is not None:
            msg += f", {t['decode_ms_per_token']:6.1f} ms/tok"
        paired = row["paired"]
        msg += f" | paired: prefill {paired['prefill_speedup']:.2f}x"
        if paired["decode_time_ratio"] is not None:
            msg += f", decode {paired['decode_time_ratio']:.2f} of the time"
    print(msg, flush=True)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    bandwidth = max(report["read_bandwidth_bytes_per_s"]) / 1e9
    table = Table(title=f"{report['model']}: ringctx vs transformers, {report['date']}, {report['cpu']}, "
                        f"{report['threads']} threads, ringctx kernels {report['cpu_kernel_variant']}, "
                        f"torch kernels {report['cpu_capability']}"
                        f"{' (oneDNN, MKL capped too)' if report['torch_isa_env'] else ''}, "
                        f"read {bandwidth:.1f} GB/s (medians of {report['rounds']} alternating rounds)")
    for col in ("dtype", "prompt", "metric", "ringctx", "transformers", "paired ratio", "floor", "ringctx / floor"):
        table.add_column(col, justify="right")
    for row in report["results"]:
        r, t, paired = row["ringctx"], row.get("transformers"), row.get("paired", {})
        prompt = f"{row['prompt_tokens']:,}"
        speedup = f"{paired['prefill_speedup']:.2f}x faster" if t else "-"
        table.add_row(row["dtype"], prompt, "prefill tok/s", f"{r['prefill_tokens_per_s']:,.0f}",
                      f"{t['prefill_tokens_per_s']:,.0f}" if t else "-", speedup, "", "")
        if r["decode_ms_per_token"] is not None:
            ratio = f"{paired['decode_time_ratio']:.2f} of the time" if t else "-"
            table.add_row(row["dtype"], prompt, f"decode ms/token, median step ({row['decode_tokens']})",
                          f"{r['decode_ms_p50']:.1f}", f"{t['decode_ms_p50']:.1f}" if t else "-", ratio,
                          f"{row['floor_ms']:.1f} ms", f"{row['ringctx_over_floor']:.2f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
