"""Ingest a long document with context-parallel prefill, then answer questions about it.

    python examples/long_document_qa.py                      # a generated document with a hidden fact
    python examples/long_document_qa.py report.txt "Who signed it?" --nproc 2

The document is prefilled once over `--nproc` ranks (chunk by chunk; each chunk chooses ring
pass-KV or pass-Q), its KV cache is handed to this process, and every question is a short partial
prefill on top of that cache followed by greedy decoding. The cache is saved so later runs can skip
the prefill (`--kv doc.kv`).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import ringctx


def generated_document(sentences: int = 300) -> str:
    """Filler text of several thousand tokens with one fact hidden in it."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while rivers flow past quiet hills and old towns".split()
    text = [" ".join(rng.choice(words) for _ in range(12)).capitalize() + "." for _ in range(sentences)]
    text.insert(sentences * 3 // 5, "The secret code for the vault is 7492, and only Marta knows it.")
    return " ".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("document", nargs="?", help="UTF-8 text file (default: a generated document)")
    parser.add_argument("questions", nargs="*", default=["What is the secret code for the vault?",
                                                         "Who knows the code?"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--kv", default="long_document.kv", help="KV cache file to reuse or write")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()

    with ringctx.Engine("smollm2-135m", nproc=args.nproc, dtype="auto", chunk_tokens=args.chunk_tokens) as engine:
        if os.path.exists(args.kv):
            document = engine.load_document(args.kv)
            print(f"loaded {document.length:,} cached tokens from {args.kv}")
        else:
            text = open(args.document, encoding="utf-8").read() if args.document else generated_document()
            t0 = time.perf_counter()
            document = engine.ingest(text)
            stats = document.stats
            print(f"ingested {document.length:,} tokens on {stats.world_size} ranks in {time.perf_counter() - t0:.1f} s "
                  f"({stats.tokens_per_s:,.0f} tokens/s); chunks: "
                  + ", ".join(f"{c.tokens}@{c.cached}:{c.strategy}" for c in stats.chunks))
            engine.save_document(document, args.kv)
        for question in args.questions:
            print(f"\nQ: {question}\nA: ", end="", flush=True)
            for piece in engine.generate(document, question, max_new_tokens=args.max_new_tokens):
                print(piece, end="", flush=True)
            print()


if __name__ == "__main__":
    main()
