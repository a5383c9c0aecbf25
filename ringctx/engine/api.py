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
import os
import re
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..model import KVCache, load_model
from ..model.kvfile import load_kv_cache, save_kv_cache, weights_digest
from ..parallel.comm import agree_across_ranks
from ..parallel.launch import default_backend
from .failures import (
    CLOSED, Health, ProcessWatch, RankFailure, first_line, maybe_die, memory_problem, with_test_hook,
)
from .prefill import STRATEGY_CHOICES, PrefillConfig, PrefillResult, cp_prefill

_STOP, _PREFILL = "stop", "prefill"  # commands rank 0 sends its spawned workers (over a pipe each)


def default_chunk_tokens(model, world: int) -> int:
    """Chunk size: large enough to keep attention efficient, small enough that activations stay
    small next to the weights and KV shard (the per-rank activation peak is ~ chunk/N tokens of
    the MLP's 3*ffn_dim plus the logits of one token).

    On CPUs 4096 tokens already saturate the attention kernel (measured: a 16K prefill of SmolLM2 in
    chunks of 4K took 74 s, in one chunk 85 s) and give the progress bar something to count; GPUs
    get up to 64K tokens within a 1 GiB activation budget per rank.
    """
    per_token = (3 * model.config.ffn_dim + 4 * model.config.dim) * torch.finfo(model.dtype).bits // 8
    budget = 1 << 30  # 1 GiB of chunk activations per rank
    by_memory = int(max(1024, min(65536, budget // max(per_token, 1) * world)))
    return by_memory if model.device.type == "cuda" else min(by_memory, 4096)


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

    Failures (see ringctx.engine.failures and docs/MULTIHOST.md): ranks that loaded a different
    model, dtype or ringctx version are refused at start-up (ValueError naming both sides); a
    prefill that would not fit the available memory is refused before it starts (ValueError with
    the numbers and a fix); a rank that dies, hangs past `timeout_s` or never joins raises
    `RankFailure` naming it, and closes the engine. Bad input raises ValueError on every rank and
    the engine stays usable.
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
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if dtype == "auto":
            from ..environment import preferred_dtype

            dtype = preferred_dtype(None if device is None else str(device))
        self.model_name, self.dtype, self.strategy, self.rule = str(model), dtype, strategy, rule
        self.decode_rank, self.timeout_s, self.attn_backend = decode_rank, float(timeout_s), attn_backend
        self.hardware = _load_hardware(hardware)
        self._workers: list = []      # spawn mode: worker processes, rank i + 1 at index i
        self._conns: list = []        # spawn mode: rank 0's end of each worker's command pipe
        self._watch: ProcessWatch | None = None
        self._health: Health | None = None
        self._owns_group = False
        self._threads_before = None
        self._closed: str | None = None  # why the engine can no longer run (distributed modes)
        self.mode, self.rank, self.world_size = "single", 0, 1
        torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if not torchrun and nproc > 1:
            if decode_rank != 0:  # results come back to this process only
                raise ValueError(f"with nproc={nproc} this process is rank 0 and the decode rank, so decode_rank "
                                 f"must be 0, got {decode_rank}; choose another decode rank under torchrun")
            _check_loadable(self.model_name, dtype)  # fail here, before any process starts
        try:
            if torchrun:
                self.mode = "torchrun"
                self._join_torchrun()
            elif nproc > 1:
                self.mode = "spawn"
                self._spawn_workers(nproc, device)
            if self.mode != "single":
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.mode == "torchrun":
                self._health = Health(self.rank, self.world_size, self.timeout_s)
            if not 0 <= decode_rank < self.world_size:
                raise ValueError(f"decode_rank {decode_rank} is not a rank of this {self.world_size}-rank job")
            self.device = _rank_device(device, self._local_rank())
            self.model = load_model(model, dtype=dtype, device=self.device)
            if self.world_size > 1:
                self._startup_check()
            if self._health is not None:
                self._health.learn_peers()  # every rank published its place before the check
        except BaseException as exc:
            failure = self._fail(exc, "start-up")
            if failure is exc:
                raise
            raise failure from exc
        self.chunk_tokens = chunk_tokens or default_chunk_tokens(self.model, self.world_size)

    # ------------------------------------------------------------------ launching
    def _local_rank(self) -> int:
        if self.mode == "torchrun":
            return int(os.environ.get("LOCAL_RANK", self.rank))
        return self.rank

    def _join_torchrun(self) -> None:
        if dist.is_initialized():  # the caller made the group: use it, leave it to them
            return
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise RankFailure(
                f"rank {os.environ.get('RANK', '?')} could not join the {os.environ.get('WORLD_SIZE')}-rank group at "
                f"{where} within {self.timeout_s:g} s: {first_line(exc)}; start every rank with the same MASTER_ADDR, "
                "MASTER_PORT and WORLD_SIZE (torchrun does) and check that the port is reachable") from None
        self._owns_group = True

    def _spawn_workers(self, nproc: int, device) -> None:
        if dist.is_initialized():
            raise RuntimeError("a process group already exists in this process (another Engine with nproc > 1?); "
                               "close it first")
        backend = default_backend() if device is None or str(device).startswith("cuda") else "gloo"
        threads = max(1, (os.cpu_count() or 1) // nproc)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # Rank 0 hosts the group's store on a port the OS picks (no race for a "free" port).
        store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False, timeout=timeout)
        ctx = mp.get_context("spawn")
        for rank in range(1, nproc):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True, name=f"ringctx-rank{rank}",
                            args=(rank, nproc, store.port, backend, threads, child_end, self.model_name, self.dtype,
                                  device, self.rule, self.decode_rank, self.timeout_s, self.attn_backend,
                                  self.hardware))
            p.start()
            child_end.close()
            self._workers.append(p)
            self._conns.append(parent_end)
        self._watch = ProcessWatch(self._workers, self._conns)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)  # rank 0 shares the cores with its workers; restored by close()
        if backend == "nccl":
            torch.cuda.set_device(0)
        # Wait for every worker to reach the store, watching them: one that dies ends the wait at once.
        keys = [f"ringctx/joined/{r}" for r in range(1, nproc)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if self._watch.first_death is not None:
                raise RuntimeError("a worker died before joining the group")
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys, start=1) if not store.check([k])]
                raise RankFailure(f"start-up: rank(s) {', '.join(map(str, missing))} of {nproc} did not join "
                                  f"within the {self.timeout_s:g} s timeout", missing)
            time.sleep(0.02)
        dist.init_process_group(backend, store=store, rank=0, world_size=nproc, timeout=timeout)
        self._owns_group = True

    def _startup_check(self) -> None:
        """Refuse to run when ranks loaded different models, dtypes or ringctx versions."""
        try:
            agree_across_ranks("engine start-up", None, _fingerprint(self.model))
        except ValueError as exc:
            raise ValueError(_explain_mismatch(str(exc))) from None

    # ------------------------------------------------------------------ failures and closing
    def _fail(self, exc: BaseException, during: str) -> BaseException:
        """After `exc` interrupted `during`: name the lost rank if there is one, release every rank
        and the group, and return what to raise (a RankFailure, or `exc` itself)."""
        failure = None
        if isinstance(exc, Exception) and not isinstance(exc, (ValueError, RankFailure)):
            try:
                if self._watch is not None:
                    failure = self._watch.diagnose(exc, during, len(self._workers) + 1, self.timeout_s)
                elif self._health is not None:
                    failure = self._health.diagnose(exc, during)
            except Exception:  # diagnosis is best effort; the original error still goes out
                failure = None
        graceful = isinstance(exc, ValueError) and self.mode == "torchrun"  # every rank raised the same
        self._shutdown(graceful=graceful, why=str(failure or exc) or type(exc).__name__)
        return failure or exc

    def _shutdown(self, *, graceful: bool, why: str) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._health is not None:
            self._health.stop()
            self._health = None
        if graceful:
            for conn in self._conns:
                try:
                    conn.send((_STOP,))
                except (OSError, ValueError):
                    pass
        for p in self._workers:
            p.join(timeout=10 if graceful else 0.2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._workers, self._conns = [], []
        if self._owns_group and dist.is_initialized():
            try:
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if not graceful and abort is not None and dist.get_backend() == "nccl":
                    abort()
                else:
                    dist.destroy_process_group()
            except Exception:
                pass
        self._owns_group = False
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self.mode != "single" and self._closed is None:
            self._closed = why.removesuffix(CLOSED)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise RankFailure(f"this engine is closed: {self._closed}; create a new Engine")

    def close(self) -> None:
        """End spawned workers and the process group this engine created (idempotent)."""
        if self._closed is None:
            self._shutdown(graceful=True, why="close() was called")

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

        Raises:
            ValueError: bad input or not enough memory (on every rank; the engine stays usable).
            RankFailure: a rank died or did not answer within `timeout_s` (the engine is closed).

        Example:
            >>> engine = Engine("tiny")
            >>> result = engine.prefill(list(range(100)), chunk_tokens=32)
            >>> result.logits.shape, result.cache.length, [c.tokens for c in result.stats.chunks]
            (torch.Size([256]), 100, [32, 32, 32, 4])
        """
        self._check_open()
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        config = PrefillConfig(chunk_tokens=chunk_tokens or self.chunk_tokens, strategy=strategy or self.strategy,
                               hardware=self.hardware, rule=self.rule, decode_rank=self.decode_rank,
                               decode_room=decode_room, attn_backend=self.attn_backend, trace=trace)
        if config.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {config.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
        cached = cache.length if cache is not None and self.rank == self.decode_rank else 0
        if self.mode == "single":  # never join a process group made by someone else
            _check_memory(self.model, token_ids, cached, config, 1, 0, local_ranks=1, local_decode=True)
            return cp_prefill(self.model, token_ids, config, group="local", cache=cache,
                              cache_token_ids=cache_token_ids, on_chunk=on_chunk)
        try:
            if self.mode == "spawn":
                command = (_PREFILL, token_ids.cpu().numpy().tobytes(), config.chunk_tokens, config.strategy,
                           decode_room, bool(trace), cached)
                for conn in self._conns:
                    conn.send(command)
                local_ranks, local_decode = self.world_size, True
            else:
                local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                local_decode = self.decode_rank // local_ranks == self.rank // local_ranks
            _check_memory(self.model, token_ids, cached, config, self.world_size, self.rank,
                          local_ranks=local_ranks, local_decode=local_decode)
            return cp_prefill(self.model, token_ids, config, group=None, cache=cache, cache_token_ids=cache_token_ids,
                              on_chunk=with_test_hook(on_chunk, self.rank))
        except ValueError:
            raise  # every rank raised the same error before communicating: the engine stays usable
        except BaseException as exc:  # a lost rank, a timeout, Ctrl-C: release every rank
            failure = self._fail(exc, "prefill")
            if failure is exc:
                raise
            raise failure from exc

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


def _check_loadable(model_name: str, dtype) -> None:
    """Raise the loader's ValueError / FileNotFoundError now for an unknown model or dtype (cheap)."""
    from ..config import PRESETS
    from ..model.loader import DEFAULT_MODEL, _classify_path, resolve_dtype

    resolve_dtype(dtype)
    if model_name != DEFAULT_MODEL and model_name not in PRESETS:
        _classify_path(model_name)


def _fingerprint(model) -> str:
    """What every rank must agree on: model (name, shapes, weights), dtype and ringctx version."""
    from .. import __version__

    return (f"model={model.config.name} config={model.config.fingerprint()} weights={weights_digest(model)} "
            f"dtype={str(model.dtype).removeprefix('torch.')} ringctx={__version__}")


def _explain_mismatch(message: str) -> str:
    """agree_across_ranks' "ranks disagree" message, rewritten to show only what differs."""
    m = re.search(r"rank 0 has \[(.*)\] but rank (\d+) has \[(.*)\]", message)
    if not m:
        return message
    first, other = (dict(f.split("=", 1) for f in side.split() if "=" in f) for side in (m.group(1), m.group(3)))
    rank = m.group(2)
    diff = [k for k in first if first.get(k) != other.get(k)]
    if not diff:
        return message
    what = "; ".join(f"{k}={other.get(k)} on rank {rank} but {k}={first[k]} on rank 0" for k in diff)
    return (f"engine start-up: rank {rank} does not match rank 0: {what}. Every rank must load the same model "
            f"(--model), dtype (--dtype) and ringctx version; this job is refused rather than computing garbage")


def _check_memory(model, token_ids, cached, config, world, rank, *, local_ranks, local_decode) -> None:
    """Refuse a prefill the memory cannot hold, on every rank alike (see failures.memory_problem)."""
    problem = memory_problem(model, int(token_ids.numel()), cached, config.chunk_tokens, world, rank,
                             config.decode_rank, config.decode_room, local_ranks=local_ranks,
                             local_decode=local_decode)
    if world > 1:
        agree_across_ranks("prefill", problem, "memory check")
    elif problem:
        raise ValueError(f"prefill: {problem}")


def _worker_main(rank, world, port, backend, threads, conn, model_name, dtype, device, rule, decode_rank, timeout_s,
                 attn_backend, hardware) -> None:
    """A spawned rank: join the group, load the model, then serve rank 0's commands until stop.

    Commands come over a pipe from rank 0 (so an idle engine never times out, and the worker ends
    when rank 0's process is gone); tensors travel over the process group. Ctrl-C is rank 0's to
    handle: it ends the workers. An error is reported back over the pipe before the worker exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        maybe_die(rank, "join")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        store.set(f"ringctx/joined/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        model = load_model(model_name, dtype=dtype, device=_rank_device(device, rank))
        agree_across_ranks("engine start-up", None, _fingerprint(model))
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                break
            if command[0] == _STOP:
                break
            _, ids, chunk, strategy, decode_room, trace, cached = command
            token_ids = torch.frombuffer(bytearray(ids), dtype=torch.long) if ids else torch.empty(0, dtype=torch.long)
            config = PrefillConfig(chunk_tokens=chunk, strategy=strategy, hardware=hardware, rule=rule,
                                   decode_rank=decode_rank, decode_room=decode_room, attn_backend=attn_backend,
                                   trace=trace)
            try:
                _check_memory(model, token_ids, cached, config, world, rank, local_ranks=world, local_decode=True)
                cp_prefill(model, token_ids, config, on_chunk=with_test_hook(None, rank))
            except ValueError:
                continue  # bad input: every rank raised the same error; rank 0 reports it
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {first_line(exc, 300)}"))
        except Exception:
            pass
        os._exit(1)  # the group is broken: leave without waiting on it
    if dist.is_initialized():
        dist.destroy_process_group()
