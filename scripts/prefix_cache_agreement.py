#!/usr/bin/env python
"""How far an answer with a prefix-cache hit is from the same answer without one, per dtype.

Engine.chat on the embedded SmolLM2-135M over a generated document: a conversation of `--turns`
turns (each later turn a hit on the previous turn and its answer) and `--questions` other questions
on the same text (branches), each answer also produced without the cache (the prompt prefilled
whole over every rank, its last token asked on it: what a miss runs), teacher-forced on the cached
answer's tokens so that every step compares the same position. Per dtype and KV dtype: the largest
logit difference, and the share of steps whose argmax agrees.

    python scripts/prefix_cache_agreement.py                       # float32, bfloat16, bfloat16 + fp8 KV
    python scripts/prefix_cache_agreement.py --json out/agreement.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch


def document_text(sentences: int) -> str:
    subjects = ["The river", "A lighthouse keeper", "The archive", "An old ferry", "The council", "A night train"]
    verbs = ["records", "carries", "watches", "remembers", "counts", "guards"]
    objects = ["every ship that passes", "the salt from the coast", "letters from the capital",
               "the names of the sailors", "the winter storms", "the keys of the tower"]
    out = []
    for i in range(sentences):
        out.append(f"{subjects[i % 6]} {verbs[(i * 5) % 6]} {objects[(i * 7) % 6]} (entry {i}).")
    return " ".join(out)


def uncached(engine, ids: torch.Tensor, max_new_tokens: int):
    """The answer without the cache: the prompt prefilled whole over every rank, its last token asked on it."""
    document = engine.prefill(ids[:-1], as_document=True, decode_room=max_new_tokens + 8).document
    batch = engine.batch()
    member = batch.join(document, ids[-1:], max_new_tokens=max_new_tokens, keep_logits=True)
    while not member.left:
        batch.step()
    return member.result


def measure(dtype: str, kv_dtype: str, turns: int, questions: int, max_new_tokens: int) -> dict:
    """Questions on one text (a miss, then branches), then a conversation (each turn a hit on the last)."""
    from ringctx import Engine

    row = {"dtype": dtype, "kv_dtype": kv_dtype, "max_logit_diff": 0.0, "argmax_agree": 0, "steps": 0,
           "cached_tokens": []}
    with Engine(dtype=dtype, kv_dtype=kv_dtype, prefix_cache_min_tokens=128, allow_long_context=True) as engine:
        text = document_text(60)

        def compare(messages):
            result = engine.chat(messages, max_new_tokens=max_new_tokens, keep_logits=True)
            reference = uncached(engine, engine._prompt_ids(messages), max_new_tokens)
            # step by step while both answers are the same tokens (after a different token they diverge)
            for i, (got, want) in enumerate(zip(result.step_logits, reference.step_logits)):
                row["max_logit_diff"] = max(row["max_logit_diff"], float((got.float() - want.float()).abs().max()))
                row["argmax_agree"] += int(got.argmax()) == int(want.argmax())
                row["steps"] += 1
                if result.token_ids[i] != reference.token_ids[i]:
                    break
            row["cached_tokens"].append(result.cached_tokens)
            return result

        for q in range(questions):
            compare([{"role": "user", "content": f"{text}\n\nWhat does entry {7 + 5 * q} say?"}])
        conversation = [{"role": "user", "content": f"{text}\n\nWhat does entry 3 say?"}]
        for turn in range(turns):
            result = compare(conversation)
            conversation = conversation + [{"role": "assistant", "content": result.text},
                                           {"role": "user", "content": f"And entry {11 + turn}?"}]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from ringctx.kernels.cpu_features import cpu_model as cpu_name

    rows = [measure(d, k, args.turns, args.questions, args.max_new_tokens)
            for d, k in (("float32", "model"), ("bfloat16", "model"), ("bfloat16", "fp8"))]
    print(f"prefix cache hit vs miss, SmolLM2-135M, {cpu_name()}, {datetime.date.today()}")
    print(f"{'dtype':<10} {'kv':<6} {'max |logit diff|':>17} {'argmax agrees':>14}  cached tokens per answer")
    for r in rows:
        print(f"{r['dtype']:<10} {r['kv_dtype']:<6} {r['max_logit_diff']:>17.2e} "
              f"{r['argmax_agree']:>6}/{r['steps']:<7}  {' '.join(map(str, r['cached_tokens']))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "date": str(datetime.date.today()), "python": platform.python_version(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
