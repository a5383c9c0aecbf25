"""Engine: the public face of ringctx. Context-parallel prefill, then single-host decode.

Three ways to run, one API:
    Engine(model)               one process, no process group
    Engine(model, nproc=N)      this process is rank 0 (and the decode rank); it spawns N-1 local
                                worker ranks (gloo on CPU, NCCL with one GPU per rank) and drives
                                them for as many calls as you like; close() (or `with`) ends them
    under torchrun              every launched process builds an Engine, which joins the group
                                from the environment; every rank makes the same calls (SPMD)

Example (runs on a laptop CPU with the embedded SmolLM2-135M-Instruct):
    >>> import ringctx
    >>> with ringctx.Engine(nproc=2) as engine:                     # doctest: +SKIP
    ...     doc = engine.ingest(open("report.txt").read())
    ...     print(engine.ask(doc, "Who signed the report?"))
    ...     doc.save("report.kv")                                  # ask again later without prefill
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..model import KVCache, load_model
from ..model.kvfile import load_kv_cache, save_kv_cache, weights_digest
from ..parallel.comm import agree_across_ranks
from ..parallel.launch import default_backend, free_port
from .prefill import STRATEGY_CHOICES, PrefillConfig, PrefillResult, cp_prefill

_STOP, _PREFILL = 0, 1
_HEADER = 8  # int64 fields of a command: kind, tokens, chunk, strategy, decode_room, trace, cached, -


def default_chunk_tokens(model, world: int) -> int:
    """Chunk size: large enough to keep attention efficient, small enough that activations stay
    small next to the weights and KV shard (the per-rank activation peak is ~ chunk/N tokens of
    the MLP's 3*ffn_dim plus the logits of one token)."""
    per_token = (3 * model.config.ffn_dim + 4 * model.config.dim) * torch.finfo(model.dtype).bits // 8
    budget = 1 << 30  # 1 GiB of chunk activations per rank
    return int(max(1024, min(65536, budget // max(per_token, 1) * world)))


@dataclass
class Document:
    """A prefilled document ready for questions: its KV cache and what a question must append."""

    cache: KVCache
    """Decode KV cache holding the document's tokens (positions 0..length-1)."""
    token_ids: torch.Tensor
    """The document's token ids."""
    question_prefix: str = ""
    """Text placed before each question (empty for raw documents)."""
    question_suffix: str = ""
    """Text placed after each question (the chat template's end of turn and assistant start)."""
    stats: object | None = None
    """PrefillStats of the ingest (None when loaded from a file)."""
    metadata: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def save(self, path: str, model) -> None:
        """Write the KV cache, token ids and chat frame to a safetensors file (atomically)."""
        self.cache.truncate(self.length)  # answers to earlier questions are not part of the document
        save_kv_cache(path, self.cache, model, self.token_ids,
                      extra={"question_prefix": self.question_prefix, "question_suffix": self.question_suffix,
                             **self.metadata})


class Engine:
    """Chunked context-parallel prefill with a KV hand-off to one decode rank.

    Args:
        model: preset name, GGUF path or Hugging Face directory (see ringctx.load_model).
        nproc: local ranks to spawn (this process is rank 0); ignored under torchrun.
        dtype: weights and activations (None: the model's default; "auto": bfloat16 on GPUs and
            bf16-capable CPUs, else float32).
        device: None: one GPU per rank when CUDA is available, else CPU.
        chunk_tokens: tokens per prefill chunk (None: `default_chunk_tokens`).
        strategy: "auto" (paper Algorithm 5 with `hardware`), "pass-kv" or "pass-q".
        hardware: HardwareProfile or built-in profile name or JSON path for "auto" (None: "cpu").
        rule: the decision rule of "auto": "alg1", "alg5" or "empirical".
        decode_rank: the rank that receives the KV cache and decodes.
        timeout_s: a collective that does not complete within this many seconds (a dead or stuck
            rank) ends the job with an error.
        attn_backend: attention backend of the local blocks.
    """

    def __init__(self, model: str = "smollm2-135m", *, nproc: int = 1, dtype=None, device=None,
                 chunk_tokens: int | None = None, strategy: str = "auto", hardware=None, rule: str = "alg5",
                 decode_rank: int = 0, timeout_s: float = 300.0, attn_backend: str = "auto"):
        if strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if dtype == "auto":
            from ..environment import preferred_dtype

            dtype = preferred_dtype(None if device is None else str(device))
        self.model_name, self.dtype, self.strategy, self.rule = str(model), dtype, strategy, rule
        self.decode_rank, self.timeout_s, self.attn_backend = decode_rank, timeout_s, attn_backend
        self.hardware = _load_hardware(hardware)
        self._workers: list = []
        self._owns_group = False
        self.mode = "single"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.mode = "torchrun"
            self._join_torchrun()
        elif nproc > 1:
            self.mode = "spawn"
            self._spawn_workers(nproc, device)
        self.rank = dist.get_rank() if self.mode != "single" else 0
        self.world_size = dist.get_world_size() if self.mode != "single" else 1
        if not 0 <= decode_rank < self.world_size:
            self.close()
            raise ValueError(f"decode_rank {decode_rank} is not a rank of this {self.world_size}-rank job")
        self.device = _rank_device(device, self.rank)
        self.model = load_model(model, dtype=dtype, device=self.device)
        if self.world_size > 1:
            self._startup_check()
        self.chunk_tokens = chunk_tokens or default_chunk_tokens(self.model, self.world_size)

    # ------------------------------------------------------------------ launching
    def _join_torchrun(self) -> None:
        if not dist.is_initialized():
            backend = default_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout_s))
            self._owns_group = True

    def _spawn_workers(self, nproc: int, device) -> None:
        if dist.is_initialized():
            raise RuntimeError("a process group already exists in this process (another Engine with nproc > 1?); "
                               "close it first")
        backend = default_backend() if device is None or str(device).startswith("cuda") else "gloo"
        threads = max(1, (os.cpu_count() or 1) // nproc)
        port = free_port()
        ctx = mp.get_context("spawn")
        for rank in range(1, nproc):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, nproc, port, backend, threads, self.model_name, self.dtype, device,
                                  self.rule, self.decode_rank, self.timeout_s, self.attn_backend,
                                  self.hardware))
            p.start()
            self._workers.append(p)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)  # rank 0 shares the cores with its workers; restored by close()
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=nproc,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        self._owns_group = True

    def _startup_check(self) -> None:
        """Refuse to run when ranks loaded different models, dtypes or ringctx versions."""
        from .. import __version__

        agree_across_ranks("engine start-up", None,
                           f"model={self.model.config.fingerprint()} weights={weights_digest(self.model)} "
                           f"dtype={self.model.dtype} ringctx={__version__}")

    def close(self) -> None:
        """End spawned workers and the process group this engine created (idempotent)."""
        if self.mode == "spawn" and self._workers and dist.is_initialized():
            try:
                _send_command(torch.zeros(_HEADER, dtype=torch.long))  # kind 0 = stop
            except Exception:  # workers already gone: nothing to stop
                pass
        for p in self._workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._workers = []
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        if getattr(self, "_threads_before", None):
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ prefill
    def prefill(self, token_ids, *, cache: KVCache | None = None, cache_token_ids=None,
                chunk_tokens: int | None = None, strategy: str | None = None, decode_room: int = 256,
                trace: bool = False, on_chunk=None) -> PrefillResult:
        """Prefill token ids (optionally on top of `cache`) over all ranks; hand the KV cache to the decode rank.

        Args:
            token_ids: [T] ids (tensor or list).
            cache: prefill on top of this KVCache (a follow-up turn); decode rank only.
            chunk_tokens, strategy: override the engine's defaults for this call.
            decode_room: KV rows to reserve beyond the prompt for generation.
            trace: record a Chrome trace (result.trace_events).
            on_chunk: progress callback on_chunk(done, total, chunk_stats).

        Returns:
            PrefillResult with .logits (float32 [vocab], last prompt token), .cache (decode rank),
            .stats.

        Example:
            >>> engine = Engine("tiny")
            >>> result = engine.prefill(list(range(100)), chunk_tokens=32)
            >>> result.logits.shape, result.cache.length, [c.tokens for c in result.stats.chunks]
            (torch.Size([256]), 100, [32, 32, 32, 4])
        """
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        config = PrefillConfig(chunk_tokens=chunk_tokens or self.chunk_tokens, strategy=strategy or self.strategy,
                               hardware=self.hardware, rule=self.rule, decode_rank=self.decode_rank,
                               decode_room=decode_room, attn_backend=self.attn_backend, trace=trace)
        if self.mode == "spawn":
            if config.strategy not in STRATEGY_CHOICES:
                raise ValueError(f"unknown strategy {config.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
            header = torch.tensor([_PREFILL, token_ids.numel(), config.chunk_tokens,
                                   STRATEGY_CHOICES.index(config.strategy), decode_room, int(trace), 0, 0])
            _send_command(header)
            dist.broadcast(token_ids, src=0)
        group = "local" if self.mode == "single" else None  # never join a process group made by someone else
        return cp_prefill(self.model, token_ids, config, group=group, cache=cache, cache_token_ids=cache_token_ids,
                          on_chunk=on_chunk)

    # ------------------------------------------------------------------ documents and questions
    def ingest(self, text: str, *, chat: bool = True, **prefill_kwargs) -> Document:
        """Prefill a document so that questions can be asked about it.

        With `chat` (and a tokenizer with a chat template) the document opens a user turn; each
        question completes that turn and the template's assistant header follows.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the document is empty: give some text to ingest")
        tokenizer = self._tokenizer()
        prefix, suffix = ("", "") if not chat else _chat_frame(tokenizer)
        ids = tokenizer(prefix + text + ("\n\n" if chat else ""), add_special_tokens=False)["input_ids"]
        result = self.prefill(ids, **prefill_kwargs)
        if result.cache is None:  # not the decode rank
            return None
        return Document(cache=result.cache, token_ids=result.token_ids, question_suffix=suffix, stats=result.stats,
                        metadata={"chat": chat})

    def generate(self, document: Document, prompt: str, *, max_new_tokens: int = 256, **sampling):
        """Stream the answer to `prompt` appended to the document (decode rank only).

        The document's cache is first cut back to the document, so questions do not see each
        other. Returns the model's Generation iterator of text pieces (its `.result` holds token
        timings once exhausted). sampling: temperature, top_k, top_p, seed, stop.
        """
        if self.rank != self.decode_rank:
            raise RuntimeError("generate runs on the decode rank only")
        cache = document.cache
        cache.truncate(document.length)
        text = document.question_prefix + prompt + document.question_suffix
        ids = self._tokenizer()(text, add_special_tokens=False)["input_ids"]
        need = document.length + len(ids) + max_new_tokens
        if cache.max_tokens < need:
            document.cache = cache = KVCache.from_tensors(cache.k, cache.v, length=document.length, max_tokens=need)
        return self.model.stream(torch.tensor(ids), cache=cache, max_new_tokens=max_new_tokens, **sampling)

    def ask(self, document: Document, question: str, **kwargs) -> str:
        """The whole answer to `question` about `document` (see `generate`)."""
        return "".join(self.generate(document, question, **kwargs))

    def save_document(self, document: Document, path: str) -> None:
        """Save `document` (see Document.save) for this engine's model."""
        document.save(path, self.model)

    def load_document(self, path: str) -> Document:
        """A Document saved with `save_document`, checked against this engine's model."""
        cache, token_ids, extra = load_kv_cache(path, self.model)
        return Document(cache=cache, token_ids=token_ids, question_prefix=extra.pop("question_prefix", ""),
                        question_suffix=extra.pop("question_suffix", ""), metadata=extra)

    def _tokenizer(self):
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer (random-weight preset); "
                             "pass token ids to prefill() instead of text")
        return tokenizer


def _chat_frame(tokenizer) -> tuple[str, str]:
    """(text before the document, text after a question) from the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00RINGCTX_QUESTION\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
    before, after = rendered.split(marker)
    return before, after


def _load_hardware(hardware):
    """The profile "auto" decides with, loaded once (default: the built-in "cpu" or "h200"-like GPU)."""
    from ..parallel.hardware import HardwareProfile, load_profile

    if isinstance(hardware, HardwareProfile):
        return hardware
    return load_profile(hardware or ("h200" if torch.cuda.is_available() else "cpu"))


def _rank_device(device, rank: int) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _send_command(header: torch.Tensor) -> None:
    dist.broadcast(header, src=0)


def _worker_main(rank, world, port, backend, threads, model_name, dtype, device, rule, decode_rank, timeout_s,
                 attn_backend, hardware) -> None:
    """A spawned rank: join the group, load the model, then serve rank 0's commands until stop."""
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        model = load_model(model_name, dtype=dtype, device=_rank_device(device, rank))
        from .. import __version__

        agree_across_ranks("engine start-up", None,
                           f"model={model.config.fingerprint()} weights={weights_digest(model)} "
                           f"dtype={model.dtype} ringctx={__version__}")
        while True:
            header = torch.zeros(_HEADER, dtype=torch.long)
            dist.broadcast(header, src=0)
            kind, n_tokens, chunk, strategy, decode_room, trace = header[:6].tolist()
            if kind == _STOP:
                break
            token_ids = torch.empty(n_tokens, dtype=torch.long)
            dist.broadcast(token_ids, src=0)
            config = PrefillConfig(chunk_tokens=chunk, strategy=STRATEGY_CHOICES[strategy], hardware=hardware,
                                   rule=rule, decode_rank=decode_rank, decode_room=decode_room,
                                   attn_backend=attn_backend, trace=bool(trace))
            try:
                cp_prefill(model, token_ids, config)
            except ValueError:
                continue  # bad input: every rank raised the same error; rank 0 reports it
    finally:
        dist.destroy_process_group()
