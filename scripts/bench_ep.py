"""Expert parallelism on one host: EP 2 against EP 1 on 2 CPU ranks, in one run.

A random Qwen3-MoE scaled down as issue 51 asks (SmolLM2's width 576, 9 / 3 heads of 64, 32
experts of width 384 = a quarter of the dense 1536, top-4; --layers of them), saved by transformers
and loaded by two engines of 2 ranks each: ep 1 (every rank holds every expert) and ep 2 (each
rank half of them; tokens reach them by the two-shot all-to-all, model/expert_parallel.py). For
each: time per prefill chunk (median over --repeats prefills after a warm-up one), bytes each rank
sent per prefill (of which the EP all-to-alls), the weights a rank holds and the peak memory of
rank 1 (a spawned rank: rank 0 is this process, which also built the model), decode ms per token of a
greedy answer on the document split over both ranks, and the two engines' last logits against
each other. Prints a markdown table for docs/BENCHMARKS.md.

    python scripts/bench_ep.py [--tokens 2048] [--chunk 512] [--layers 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch


def save_model(directory: str, layers: int) -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)


def run(directory: str, ep: int, args) -> dict:
    from ringctx.engine import Engine

    ids = torch.randint(3, 49000, (args.tokens,), generator=torch.Generator().manual_seed(1))
    chunk_s, results = [], []
    with Engine(directory, nproc=2, ep=ep, decode_ranks=2, dtype="float32", strategy="pass-kv",
                hardware="cpu") as engine:
        for i in range(args.repeats + 1):
            result = engine.prefill(ids, chunk_tokens=args.chunk)
            if i:  # the first one warms up
                chunk_s += [c.seconds for c in result.stats.chunks]
                results.append(result)
        doc = engine.ingest(ids.tolist(), chat=False, chunk_tokens=args.chunk)
        answer = engine.generate(doc, [7, 11, 13], max_new_tokens=16, stop_token_ids=[])
        "".join(answer)
        decode_ms = answer.result.decode_ms_per_token
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # rank 0's
    stats = results[-1].stats
    return {"ep": ep, "chunk_s": statistics.median(chunk_s), "sent": stats.bytes_sent_per_rank,
            "ep_sent": stats.ep_bytes_per_rank, "peak": stats.peak_rss_bytes_per_rank[1], "decode_ms": decode_ms,
            "weights": weights,
            "logits": results[-1].logits, "tokens": answer.result.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        save_model(directory, args.layers)
        rows = [run(directory, ep, args) for ep in (1, 2)]
    one, two = rows
    err = ((two["logits"].double() - one["logits"].double()).abs().max() / one["logits"].double().abs().max()).item()
    mib = 2 ** 20
    print(f"\n{args.tokens} tokens in chunks of {args.chunk}, {args.layers} MoE layers (32 experts, top-4, "
          f"dim 576, expert width 384), float32, 2 ranks, pass-KV; EP 2 logits vs EP 1: rel err {err:.1e}, "
          f"greedy answers {'equal' if one['tokens'] == two['tokens'] else 'DIFFER'}\n")
    print("| ep | s per chunk | MiB sent per rank per prefill | of which EP | weights per rank (MiB) | "
          "peak RSS of rank 1 (MiB) | decode ms/token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep']} | {r['chunk_s']:.3f} | {', '.join(f'{b / mib:.1f}' for b in r['sent'])} | "
              f"{', '.join(f'{b / mib:.1f}' for b in r['ep_sent'])} | {r['weights'] / mib:.0f} | "
              f"{r['peak'] / mib:.0f} | {r['decode_ms']:.1f} |")


if __name__ == "__main__":
    main()
