"""Engine: the public face of ringctx. Context-parallel prefill, then decode on the decode host.

Three ways to run, one API:
    Engine(model)               one process, no process group
    Engine(model, nproc=N)      this process is rank 0 (and leads the decode); it spawns N-1 local
                                worker ranks (gloo on CPU, NCCL with one GPU per rank) and drives
                                them for as many calls as you like; close() (or `with`) ends them
    Engine(model, nproc=N, tp=T) the same ranks as a (N/T CP) x (T TP) mesh: each group of T
                                consecutive ranks holds one copy of the weights split Megatron-style
                                (ringctx.model.tensor_parallel), and the ring runs across the groups
    under torchrun              every launched process builds an Engine, which joins the group
                                from the environment; every rank makes the same calls (SPMD)

Example (runs on a laptop CPU with the embedded SmolLM2-135M-Instruct):
    >>> import ringctx
    >>> with ringctx.Engine(nproc=2) as engine:                     # doctest: +SKIP
    ...     doc = engine.ingest(open("report.txt").read())
    ...     print(engine.ask(doc, "Who signed the report?"))
    ...     engine.save_document(doc, "report.kv")                 # ask again later without prefill
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..attention.quant import check_kv_dtype
from ..model import KVCache, Sampler, load_model
from ..model.tensor_parallel import TensorParallel, gather_kv_heads
from ..model.generate import Generation
from ..model.kvfile import share_weights_digest, weights_digest
from ..parallel.comm import agree_across_ranks, all_gather_bytes, all_gather_ints
from ..parallel.launch import default_backend
from ..parallel.mesh import Mesh, build_mesh, check_mesh, decode_groups
from .decode import ShardedDecoder
from .documents import load_document_slices, save_document_slices
from .failures import (
    CLOSED, Health, ProcessWatch, RankFailure, available_memory, first_line, fmt_bytes, maybe_die, memory_problem,
    with_test_hook,
)
from .handoff import gather_in_order
from .prefill import STRATEGY_CHOICES, PrefillConfig, PrefillResult, cp_prefill

_STOP = "stop"  # the other commands rank 0 sends its spawned workers are Engine._on_<name> methods


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


def auto_nproc(device=None, tp: int = 1) -> int:
    """Local ranks for nproc="auto": one per GPU; on a CPU with 2 or more cores, 2 ranks, each with
    half of the cores' threads (a CPU host gains little from more ranks than threads would give it,
    and every rank holds a copy of the weights); 1 on a single core. A mesh needs a multiple of
    `tp`: GPUs round down to one (never more ranks than GPUs, at least tp), CPU ranks round up."""
    on_gpu = (device is None and torch.cuda.is_available()) or (device is not None and "cuda" in str(device))
    if on_gpu:
        return max(tp, torch.cuda.device_count() // tp * tp)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return -(-(2 if cores >= 2 else 1) // tp) * tp


@dataclass
class Document:
    """A prefilled document ready for questions: its KV cache and what a question must append.

    With several decode ranks every one of them holds a Document of its own for the same text,
    whose `cache` is that rank's slice of the tokens; the engine keeps them in step.
    """

    cache: KVCache
    """This rank's KV cache of the document: all tokens in order (one decode rank) or a slice."""
    token_ids: torch.Tensor
    """The document's token ids."""
    question_prefix: str = ""
    """Text placed before each question (empty for raw documents)."""
    question_suffix: str = ""
    """Text placed after each question (the chat template's end of turn and assistant start)."""
    stats: object | None = None
    """PrefillStats of the ingest (None when loaded from a file)."""
    metadata: dict = field(default_factory=dict)
    id: int = -1
    """The engine's handle for the document on every decode rank."""
    rows: int = -1
    """Rows of `cache` that belong to the document (the rest are an answer's); -1: cache.length."""

    def __post_init__(self):
        if self.rows < 0:
            self.rows = self.cache.length

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    def rewind(self) -> KVCache:
        """The cache cut back to the document (questions do not see each other)."""
        self.cache.truncate(self.rows)
        return self.cache

    @property
    def frame(self) -> dict:
        """What a saved document keeps besides the cache: the chat frame and the metadata."""
        return {"question_prefix": self.question_prefix, "question_suffix": self.question_suffix, **self.metadata}


class Engine:
    """Chunked context-parallel prefill with a KV hand-off to the decode ranks of one host.

    Args:
        model: preset name, GGUF path or Hugging Face directory (see ringctx.load_model).
        nproc: local ranks to spawn (this process is rank 0), or "auto" (see `auto_nproc`); ignored
            under torchrun.
        tp: tensor-parallel ranks per model copy (consecutive ranks of one host; 1: none). The
            job's ranks form a (world / tp) x tp mesh: context parallelism runs across the
            copies, each TP rank in the ring of its own heads. `decode_rank` and `decode_ranks`
            then count CP ranks (each a group of tp ranks).
        dtype: weights and activations (None: the model's default; "auto": bfloat16 on GPUs and
            bf16-capable CPUs, else float32).
        device: None: one GPU per rank when CUDA is available, else CPU.
        chunk_tokens: tokens per prefill chunk (None: `default_chunk_tokens`).
        strategy: "auto" (paper Algorithm 5 with `hardware`), "pass-kv" or "pass-q".
        hardware: HardwareProfile or built-in profile name or JSON path for "auto" (None: "cpu").
        rule: the decision rule of "auto": "alg1", "alg5" or "empirical".
        decode_rank: the first decode rank: it receives the logits, samples and streams the text.
        decode_ranks: how many ranks (decode_rank, decode_rank + 1, ..., all on one host) keep the
            KV cache after a prefill, each a balanced slice of the tokens, and decode together
            (None: every rank of the decode host from decode_rank on; 1: the whole cache on one rank).
        kv_dtype: how the KV cache is stored: "model" (the model's dtype), "bfloat16", "float16",
            "float32", or 8 bits per value with a float32 scale per token and KV head: "fp8"
            (float8 e4m3) or "int8".
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
                 decode_rank: int = 0, decode_ranks: int | None = None, kv_dtype: str = "model",
                 timeout_s: float = 300.0, attn_backend: str = "auto", tp: int = 1):
        check_kv_dtype(kv_dtype)
        if strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
        if nproc == "auto":
            nproc = auto_nproc(device, tp)
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be a positive integer or 'auto', got {nproc!r}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if dtype == "auto":
            from ..environment import preferred_dtype

            dtype = preferred_dtype(None if device is None else str(device))
        self.model_name, self.dtype, self.strategy, self.rule = str(model), dtype, strategy, rule
        self.decode_rank, self.timeout_s, self.attn_backend = decode_rank, float(timeout_s), attn_backend
        self.kv_dtype, self._chunk_tokens_asked = kv_dtype, chunk_tokens
        self.hardware = _load_hardware(hardware)
        # This rank's part of every live document, by id: held by the caller (weakly here), and
        # dropped on the spawned workers once the caller lets go of it (see _keep).
        self._documents: weakref.WeakValueDictionary[int, Document] = weakref.WeakValueDictionary()
        self._forgotten: list[int] = []
        self._next_document = 0
        self._decode_group = self._control_group = None
        self.mesh: Mesh = build_mesh(1, 0, 1)
        self._open_answer: tuple[ShardedDecoder, torch.Tensor] | None = None  # leader: (decoder, question ids)
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
        world = int(os.environ.get("WORLD_SIZE", "1")) if torchrun else nproc
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
        if tp != 1:  # every rank refuses a mesh that cannot work before it joins or loads anything
            check_mesh(_peek_config(self.model_name, dtype), world, tp, per_host)
        self.tp_size, self.cp_size = tp, world // tp
        self.ranks_per_host = per_host
        self.decode_ranks = resolve_decode_ranks(decode_ranks, decode_rank, self.cp_size, per_host // tp)
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
            if not 0 <= decode_rank < self.cp_size:
                raise ValueError(f"decode_rank {decode_rank} is not a CP rank of this {self.cp_size}-CP-rank job")
            self.device = _rank_device(device, self._local_rank())
            self.mesh = build_mesh(self.world_size, self.rank, tp, self.device.type)
            self.model = load_model(model, dtype=dtype, device=self.device, tp=self.mesh.tp)
            if self.world_size > 1:
                if tp > 1:
                    share_weights_digest(self.model)
                self._startup_check()
                self._decode_group, self._control_group = decode_groups(self.mesh, self.decode_rank,
                                                                        self.decode_ranks)
            if self._health is not None:
                self._health.learn_peers()  # every rank published its place before the check
        except BaseException as exc:
            failure = self._fail(exc, "start-up")
            if failure is exc:
                raise
            raise failure from exc
        self.chunk_tokens = chunk_tokens or default_chunk_tokens(self.model, self.world_size)

    @classmethod
    def _worker(cls, rank: int, world: int, model_name: str, dtype, device, settings: dict) -> "Engine":
        """A spawned worker's engine: the group is joined; load the model and check it against the others."""
        engine = cls.__new__(cls)
        engine.__dict__.update(settings)
        engine.model_name, engine.dtype, engine.mode, engine.rank, engine.world_size = \
            model_name, dtype, "worker", rank, world
        engine._documents, engine._next_document, engine._closed = {}, 0, None  # strong: rank 0 says when to drop
        engine._forgotten, engine._open_answer = [], None
        engine.mesh = build_mesh(world, rank, engine.tp_size, torch.device(device).type)
        engine.model = load_model(model_name, dtype=dtype, device=device, tp=engine.mesh.tp)
        if engine.tp_size > 1:
            share_weights_digest(engine.model)
        agree_across_ranks("engine start-up", None, _fingerprint(engine.model))
        engine._decode_group, engine._control_group = decode_groups(engine.mesh, engine.decode_rank,
                                                                    engine.decode_ranks)
        engine.chunk_tokens = settings["chunk_tokens"] or default_chunk_tokens(engine.model, world)
        return engine

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
                                  device, self._settings()))
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

    # ------------------------------------------------------------------ running on every rank
    def _settings(self) -> dict:
        """What a spawned worker needs to act like this engine (sent once, at start-up)."""
        return dict(rule=self.rule, strategy=self.strategy, chunk_tokens=self._chunk_tokens_asked,
                    decode_rank=self.decode_rank, decode_ranks=self.decode_ranks,
                    kv_dtype=self.kv_dtype, timeout_s=self.timeout_s, attn_backend=self.attn_backend,
                    hardware=self.hardware, ranks_per_host=self.ranks_per_host, tp_size=self.tp_size,
                    cp_size=self.cp_size)

    def _is_decode_rank(self, rank: int | None = None) -> bool:
        """Whether global `rank` (default: this one) is on a decode CP rank (any of its TP ranks)."""
        cp_rank = (self.rank if rank is None else rank) // self.tp_size
        return self.decode_rank <= cp_rank < self.decode_rank + self.decode_ranks

    @property
    def _leader(self) -> int:
        """The global rank that samples and streams the answer: TP rank 0 of the first decode CP rank."""
        return self.decode_rank * self.tp_size

    @property
    def _decode_index(self) -> int:
        """This rank's place among the decode CP ranks (0 .. decode_ranks - 1)."""
        return self.mesh.cp_rank - self.decode_rank

    def _collective(self, during: str, command: tuple | None, run, *, decode_only: bool = False):
        """Run `run()` on this rank as its part of a job every rank (or every decode rank) takes
        part in. Spawn mode: rank 0 first sends `command` to the workers concerned. A ValueError
        (bad input, the same on every rank) leaves the engine usable; any other failure (a lost or
        stuck rank, Ctrl-C) releases every rank and is raised as a RankFailure naming the rank."""
        self._check_open()
        try:
            if self.mode == "spawn" and command is not None:
                drops = [("drop", document_id) for document_id in self._forgotten]  # documents hold decode ranks only
                self._forgotten.clear()
                for r, conn in enumerate(self._conns, start=1):
                    if self._is_decode_rank(r):
                        for drop in drops:
                            conn.send(drop)
                    if not decode_only or self._is_decode_rank(r):
                        conn.send(command)
            return run()
        except BaseException as exc:
            self._raise_failure(exc, during)

    def _guarded(self, pieces, during: str):
        """An iterator over `pieces` whose failures are handled like `_collective`'s."""
        try:
            yield from pieces
        except BaseException as exc:
            self._raise_failure(exc, during)

    def _raise_failure(self, exc: BaseException, during: str):
        """Raise what `exc`, which interrupted `during`, means: a ValueError as it is (every rank
        raised it before communicating); anything else releases every rank and is raised as the
        RankFailure naming the lost rank, or as itself when no rank was lost."""
        if isinstance(exc, ValueError):
            raise exc
        failure = self._fail(exc, during)
        if failure is exc:
            raise exc
        raise failure from exc

    # ------------------------------------------------------------------ prefill
    def prefill(self, token_ids, *, cache: KVCache | None = None, cache_token_ids=None,
                chunk_tokens: int | None = None, strategy: str | None = None, decode_room: int = 256,
                trace: bool = False, on_chunk=None, as_document: bool = False) -> PrefillResult:
        """Prefill token ids (optionally on top of `cache`) over all ranks; leave the KV cache on the decode ranks.

        Args:
            token_ids: [T] ids (tensor or list).
            cache: prefill on top of this whole KVCache (a follow-up turn); decode rank only.
            chunk_tokens, strategy: override the engine's defaults for this call.
            decode_room: KV rows to reserve beyond the prompt for generation (on each decode rank).
            trace: record a Chrome trace (result.trace_events).
            on_chunk: progress callback on_chunk(done, total, chunk_stats).
            as_document: also keep the result as a Document (result.document on the decode ranks),
                to save it or ask about it.

        Returns:
            PrefillResult with .logits (float32 [vocab], last prompt token), .cache (this decode
            rank's KV cache: the whole sequence with one decode rank, else its slice; under tensor
            parallelism only this rank's KV heads: `whole_cache(result.document)` gathers every
            head), .stats.

        Raises:
            ValueError: bad input or not enough memory (on every rank; the engine stays usable).
            RankFailure: a rank died or did not answer within `timeout_s` (the engine is closed).

        Example:
            >>> engine = Engine("tiny")
            >>> result = engine.prefill(list(range(100)), chunk_tokens=32)
            >>> result.logits.shape, result.cache.length, [c.tokens for c in result.stats.chunks]
            (torch.Size([256]), 100, [32, 32, 32, 4])
        """
        return self._prefill(token_ids, cache=cache, cache_token_ids=cache_token_ids, chunk_tokens=chunk_tokens,
                             strategy=strategy, decode_room=decode_room, trace=trace, on_chunk=on_chunk,
                             keep=self._new_document_id() if as_document else None)

    def _prefill_config(self, chunk_tokens, strategy, decode_room, trace) -> PrefillConfig:
        config = PrefillConfig(chunk_tokens=chunk_tokens or self.chunk_tokens, strategy=strategy or self.strategy,
                               hardware=self.hardware, rule=self.rule, decode_rank=self.decode_rank,
                               decode_ranks=self.decode_ranks, decode_room=decode_room, kv_dtype=self.kv_dtype,
                               ranks_per_host=self.ranks_per_host // self.tp_size,  # CP ranks per host
                               attn_backend=self.attn_backend, trace=trace)
        if config.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {config.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
        return config

    def _prefill(self, token_ids, *, cache=None, cache_token_ids=None, chunk_tokens=None, strategy=None,
                 decode_room=256, trace=False, on_chunk=None, keep: int | None = None) -> PrefillResult:
        """`prefill`; with `keep`, every decode rank also keeps its part as document number `keep`."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        config = self._prefill_config(chunk_tokens, strategy, decode_room, trace)
        if cache is not None and (self.decode_ranks > 1 or self.tp_size > 1):
            raise ValueError(f"prefill on top of a whole cache needs decode_ranks=1 and tp=1 (this engine has "
                             f"{self.decode_ranks} and {self.tp_size}); ask about a Document instead, which stays split")
        cached = cache.length if cache is not None and self.rank == self._leader else 0
        command = ("prefill", token_ids.cpu().numpy().tobytes(), config.chunk_tokens, config.strategy, decode_room,
                   bool(trace), cached, keep)

        def run():
            return self._run_prefill(token_ids, config, cached, keep, cache=cache, cache_token_ids=cache_token_ids,
                                     on_chunk=on_chunk)

        if self.mode == "single":  # never join a process group made by someone else
            return run()
        return self._collective("prefill", command, run)

    def _on_prefill(self, ids: bytes, chunk_tokens, strategy, decode_room, trace, cached, keep) -> None:
        """A spawned worker's part of rank 0's `_prefill` (the command's fields)."""
        token_ids = torch.frombuffer(bytearray(ids), dtype=torch.long) if ids else torch.empty(0, dtype=torch.long)
        self._run_prefill(token_ids, self._prefill_config(chunk_tokens, strategy, decode_room, trace), cached, keep)

    def _run_prefill(self, token_ids, config, cached, keep, *, cache=None, cache_token_ids=None, on_chunk=None):
        """This rank's part of a prefill (every rank runs it with the same arguments)."""
        local_ranks = self.world_size if self.mode != "torchrun" else self.ranks_per_host
        local_decode = self.mode != "torchrun" or \
            self._leader // self.ranks_per_host == self.rank // self.ranks_per_host
        _check_memory(self.model, token_ids, cached, config, self.cp_size, self.mesh.cp_rank, local_ranks=local_ranks,
                      local_decode=local_decode)
        result = cp_prefill(self.model, token_ids, config, group=self.mesh.cp_group, cache=cache,
                            cache_token_ids=cache_token_ids, on_chunk=with_test_hook(on_chunk, self.rank))
        if keep is not None and result.cache is not None:
            result.document = self._keep(Document(cache=result.cache, token_ids=result.token_ids, stats=result.stats,
                                                  id=keep))
        return result

    def _keep(self, document: Document) -> Document:
        """Register this rank's part of a new document; rank 0 of a spawned job has the workers drop
        theirs once the caller no longer holds it (at the next command)."""
        self._documents[document.id] = document
        if self.mode == "spawn":
            weakref.finalize(document, self._forgotten.append, document.id)
        return document

    # ------------------------------------------------------------------ documents and questions
    def ingest(self, text, *, chat: bool = True, **prefill_kwargs) -> Document | None:
        """Prefill a document (text, or token ids) so that questions can be asked about it.

        With `chat` (and a tokenizer with a chat template) the document opens a user turn; each
        question completes that turn and the template's assistant header follows. Returns the
        Document on the decode ranks (each holds its part), None elsewhere.
        """
        if isinstance(text, str):
            if not text.strip():
                raise ValueError("the document is empty: give some text to ingest")
            tokenizer = self._tokenizer()
            prefix, suffix = ("", "") if not chat else _chat_frame(tokenizer)
            ids = tokenizer(prefix + text + ("\n\n" if chat else ""), add_special_tokens=False)["input_ids"]
        else:  # token ids, taken as they are
            ids, suffix, chat = list(map(int, text)), "", False
            if not ids:
                raise ValueError("the document is empty: give at least one token id")
        document = self._prefill(ids, keep=self._new_document_id(), **prefill_kwargs).document
        if document is not None:
            document.question_suffix, document.metadata = suffix, {"chat": chat}
        return document

    def extend(self, document: Document, token_ids, *, decode_room: int = 256, on_chunk=None):
        """Prefill `token_ids` on top of `document` and keep them in it (a follow-up turn, or the
        next part of a long document): the document's cache is cut back to the document first
        (an answer's rows are dropped), then the new tokens attend to all of it. The decode ranks
        run it together, each on its own slice, with the strategy chosen per chunk (a short
        follow-up on a long cache is the case pass-Q is for). Returns the PrefillStats on the
        (first) decode rank, None on the others; call it on every decode rank (torchrun).

        Example:
            >>> engine = Engine("tiny", dtype="float32")
            >>> document = engine.ingest(list(range(100)))
            >>> stats = engine.extend(document, [5, 6, 7])
            >>> document.length, stats.cached, [c.strategy for c in stats.chunks]
            (103, 100, ['pass-kv'])
        """
        ids = torch.as_tensor(list(map(int, token_ids)) if not torch.is_tensor(token_ids) else token_ids,
                              dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("nothing to extend the document with: give at least one token id")
        if not self._is_decode_rank():
            if self.mode == "spawn":
                raise RuntimeError("extend runs on the decode ranks only")
            return None
        return self._collective("extend", ("extend", document.id, ids.numpy().tobytes(), decode_room),
                                lambda: self._on_extend(document.id, ids, decode_room, document, on_chunk),
                                decode_only=True)

    def _on_extend(self, document_id, ids, decode_room, document=None, on_chunk=None):
        """Every decode rank's part of `extend`: prefill over the decode group, on this rank's slice."""
        document = document or self._document(document_id)
        if isinstance(ids, bytes):
            ids = torch.frombuffer(bytearray(ids), dtype=torch.long)
        config = PrefillConfig(chunk_tokens=self.chunk_tokens, strategy=self.strategy, hardware=self.hardware,
                               rule=self.rule, decode_rank=0, decode_ranks=self.decode_ranks, decode_room=decode_room,
                               kv_dtype=document.cache.kv_dtype, attn_backend=self.attn_backend)
        result = cp_prefill(self.model, ids, config, group=self._decode_group, shard=document.rewind(),
                            on_chunk=on_chunk)
        document.cache, document.rows = result.cache, result.cache.length
        document.token_ids = torch.cat([document.token_ids, ids])
        return result.stats

    def _new_document_id(self) -> int:
        """The next document number: every rank makes the same calls, so they count alike."""
        self._next_document += 1
        return self._next_document

    def generate(self, document: Document, prompt, *, max_new_tokens: int = 256, **sampling):
        """Stream the answer to `prompt` (text, or token ids) appended to the document.

        The document's cache is first cut back to the document, so questions do not see each
        other. On the (first) decode rank it returns the model's Generation iterator of text
        pieces (its `.result` holds token timings once exhausted). With several decode ranks, call
        it on every rank (torchrun); the other decode ranks take part in every step and get an
        empty iterator once the answer is complete. sampling: temperature, top_k, top_p, seed, stop.
        """
        if (isinstance(prompt, str) and not prompt.strip()) or (not isinstance(prompt, str) and len(prompt) == 0):
            raise ValueError("the question is empty: ask something about the document")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        Sampler(**{k: v for k, v in sampling.items() if k in ("temperature", "top_k", "top_p")})  # validates here
        if not self._is_decode_rank():
            if self.mode == "spawn" or self.decode_ranks == 1:
                raise RuntimeError("generate runs on the decode ranks only")
            return iter(())
        if self.decode_ranks == 1 and self.tp_size == 1:
            return self._generate_here(document, prompt, max_new_tokens, sampling)
        ids = self._question_ids(document, prompt)
        command = ("generate", document.id, ids.numpy().tobytes(), max_new_tokens)
        if self._open_answer is not None:  # an answer left unread: release the other ranks from it
            decoder, pending = self._open_answer
            self._open_answer = None
            self._collective("decode", None, lambda: decoder.close(pending))
        if self.rank != self._leader:  # a follower (torchrun): every step, then nothing to show
            self._collective("decode", None, lambda: self._on_generate(document.id, ids, max_new_tokens))
            return iter(())
        decoder = self._collective("decode", command, lambda: self._sharded_decoder(document, ids),
                                   decode_only=True)
        self._open_answer = (decoder, ids)
        generation = Generation(self.model, ids, max_new_tokens=max_new_tokens, decoder=decoder, **sampling)
        return _Answer(generation, self._guarded(self._finish_answer(generation, document, decoder), "decode"))

    def _generate_here(self, document, prompt, max_new_tokens, sampling):
        """One decode rank: the whole cache is here; decode without any other rank."""
        cache = document.rewind()
        ids = self._question_ids(document, prompt)
        need = document.rows + len(ids) + max_new_tokens
        if cache.max_tokens < need:
            document.cache = cache = cache.grown(need)
        return self.model.stream(ids, cache=cache, max_new_tokens=max_new_tokens, **sampling)

    def _question_ids(self, document, prompt) -> torch.Tensor:
        if not isinstance(prompt, str):  # token ids, taken as they are
            return torch.as_tensor(list(map(int, prompt)), dtype=torch.long)
        text = document.question_prefix + prompt + document.question_suffix
        return torch.tensor(self._tokenizer()(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def _sharded_decoder(self, document: Document, ids: torch.Tensor) -> ShardedDecoder:
        """This decode rank's decoder of `document` (its slice cut back to the document)."""
        config = PrefillConfig(chunk_tokens=self.chunk_tokens, strategy=self.strategy, hardware=self.hardware,
                               rule=self.rule, decode_rank=0, decode_ranks=self.decode_ranks, decode_room=64,
                               kv_dtype=document.cache.kv_dtype, attn_backend=self.attn_backend)
        return ShardedDecoder(self.model, document.rewind(), document.length, self._decode_group, config,
                              timeout_s=self.timeout_s, control_group=self._control_group, leader=self._leader)

    def _finish_answer(self, generation, document, decoder):
        yield from generation
        document.cache = decoder.cache  # it may have grown
        if self._open_answer is not None and self._open_answer[0] is decoder:
            self._open_answer = None

    def _on_generate(self, document_id, ids, max_new_tokens) -> None:
        """A decode rank that is not the leader: prefill the question with the others, follow the steps."""
        if isinstance(ids, bytes):
            ids = torch.frombuffer(bytearray(ids), dtype=torch.long)
        document = self._document(document_id)
        decoder = self._sharded_decoder(document, ids)
        decoder.prefill(ids)
        decoder.follow()
        document.cache = decoder.cache

    def ask(self, document: Document, question: str, **kwargs) -> str:
        """The whole answer to `question` about `document` (see `generate`; "" on the other ranks)."""
        return "".join(self.generate(document, question, **kwargs))

    def save_document(self, document: Document, path: str) -> None:
        """Save `document` as a directory of per-rank slices (see ringctx.engine.documents), atomically.

        Call on every decode rank (torchrun); a document saved by N decode ranks loads on any number."""
        if not self._is_decode_rank():
            return
        self._collective("save", ("save", document.id, os.fspath(path)),
                         lambda: self._on_save(document.id, os.fspath(path), document), decode_only=True)

    def _on_save(self, document_id, path, document=None) -> None:
        document = document or self._document(document_id)
        # Every rank of the decode host writes its own rows of its own KV heads (a replicated KV
        # head by the first TP rank that holds it): nothing is gathered, the writes run in parallel.
        tp, full = self.model.tp, self.model.full_config
        heads = tp.kv_heads(full)
        writes = all(TensorParallel(tp.size, r).kv_heads(full) != heads for r in range(tp.rank))
        save_document_slices(path, document.rewind(), document.token_ids, self.model, document.frame,
                             group=self._control_group, rank=self._decode_index * self.tp_size + tp.rank,
                             world=self.decode_ranks * self.tp_size, tp_size=self.tp_size, heads=heads,
                             writes=writes)

    def load_document(self, path: str, *, decode_room: int = 256) -> Document | None:
        """A Document saved with `save_document` (by any number of decode ranks), split over this
        engine's decode ranks and checked against its model; stored in this engine's kv_dtype when it
        is not "model" (a bf16 document loads as fp8, say), else as saved. None off the decode ranks."""
        if not self._is_decode_rank():
            return None
        keep = self._new_document_id()
        return self._collective("load", ("load", os.fspath(path), keep, decode_room),
                                lambda: self._on_load(os.fspath(path), keep, decode_room), decode_only=True)

    def _on_load(self, path, keep, decode_room) -> Document:
        on_host = self.decode_ranks * self.tp_size  # every TP rank of the decode ranks loads its heads' share
        local = on_host if self.mode != "torchrun" else min(on_host, self.ranks_per_host)
        cache, token_ids, extra = load_document_slices(
            path, self.model, group=self._decode_group, rank=self._decode_index, world=self.decode_ranks,
            room=decode_room, kv_dtype=self.kv_dtype if self.kv_dtype != "model" else None,
            memory_check=lambda rows, per_row: _slice_memory_problem(self.model, rows, per_row, local))
        document = Document(cache=cache, token_ids=token_ids, question_prefix=extra.pop("question_prefix", ""),
                            question_suffix=extra.pop("question_suffix", ""), metadata=extra, id=keep)
        return self._keep(document)

    def drop_document(self, document: Document) -> None:
        """Free `document`'s KV cache on every decode rank."""
        if self._is_decode_rank():
            self._collective("drop", ("drop", document.id), lambda: self._on_drop(document.id), decode_only=True)

    def _on_drop(self, document_id) -> None:
        self._documents.pop(document_id, None)

    def document_rows(self, document: Document) -> list[int]:
        """KV rows (tokens) of `document` each decode rank holds now, its answers' rows included."""
        if not self._is_decode_rank():
            return []
        if self.decode_ranks == 1:
            return [document.cache.length]
        return self._collective("rows", ("rows", document.id), lambda: self._on_rows(document.id), decode_only=True)

    def _on_rows(self, document_id) -> list[int]:
        length = self._document(document_id).cache.length
        return [r[0] for r in all_gather_ints([length], self._decode_group, self.decode_ranks)]

    def whole_cache(self, document: Document) -> KVCache | None:
        """The document's KV cache in sequence order, gathered on the (first) decode rank (None on
        the others): for checks and small documents; the decode itself never gathers it."""
        if not self._is_decode_rank():
            return None
        if self.decode_ranks == 1 and self.tp_size == 1:
            return document.rewind()
        return self._collective("gather", ("gather", document.id), lambda: self._on_gather(document.id),
                                decode_only=True)

    def _on_gather(self, document_id) -> KVCache | None:
        document = self._document(document_id)
        cache, group, n = document.rewind(), self._decode_group, self.decode_ranks
        rank = self._decode_index
        if n > 1:  # the slices in sequence order on the first decode rank (this TP rank's heads)
            mine = cache.row_positions().cpu().contiguous().numpy().tobytes()
            positions = [torch.frombuffer(bytearray(b), dtype=torch.long) for b in all_gather_bytes(mine, group, n)]
            out = KVCache.for_model(self.model.config, document.length, dtype=self.model.dtype,
                                    device=self.model.device, kv_dtype=cache.kv_dtype) if rank == 0 else None
            gather_in_order(cache, out, positions, 0, rank, n, 0, group, free=False)
            if out is not None:
                out.length = document.length
            cache = out
        if self.tp_size > 1 and rank == 0:  # then every head, on the leader
            cache = gather_kv_heads(cache, self.model)
        return cache if rank == 0 else None

    def _document(self, document_id) -> Document:
        document = self._documents.get(document_id)
        if document is None:
            raise ValueError(f"document {document_id} is not held by this engine (dropped, or from another engine)")
        return document

    def _tokenizer(self):
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer (random-weight preset); "
                             "pass token ids to prefill() instead of text")
        return tokenizer


class _Answer:
    """The leader's answer iterator: text pieces, and `.result` from the Generation once done."""

    def __init__(self, generation: Generation, pieces):
        self.generation, self._pieces = generation, pieces

    def __iter__(self):
        return self._pieces

    def __next__(self):
        return next(self._pieces)

    @property
    def result(self):
        return self.generation.result


def resolve_decode_ranks(decode_ranks: int | None, decode_rank: int, world: int, ranks_per_host: int) -> int:
    """How many decode ranks: None -> the decode host's ranks from decode_rank on; checked to lie
    on one host and within the job. A ValueError names what to change."""
    if not 0 <= decode_rank < world:
        raise ValueError(f"decode_rank {decode_rank} is not a rank of this {world}-rank job")
    host_end = min(world, (decode_rank // ranks_per_host + 1) * ranks_per_host)
    if decode_ranks is None:
        return host_end - decode_rank
    if not isinstance(decode_ranks, int) or decode_ranks < 1:
        raise ValueError(f"decode_ranks must be a positive number of ranks, got {decode_ranks!r}")
    if decode_ranks > world - decode_rank:
        raise ValueError(f"decode_ranks={decode_ranks} asks for more ranks than this {world}-rank job has from decode "
                         f"rank {decode_rank}; use at most {world - decode_rank} (--decode-ranks)")
    if decode_rank + decode_ranks > host_end:
        raise ValueError(f"decode_ranks={decode_ranks} would reach past the decode host (ranks {host_end - ranks_per_host}"
                         f"-{host_end - 1}); the decode ranks share one host's memory: use at most "
                         f"{host_end - decode_rank}")
    return decode_ranks


def _peek_config(model_name: str, dtype):
    """The whole model's config, read from the file's header (no weights loaded)."""
    return load_model(model_name, dtype=dtype, device="meta").full_config


def _slice_memory_problem(model, rows: int, bytes_per_row: int, local_ranks: int) -> str | None:
    """A one-line problem when `rows` KV rows (on each of `local_ranks` ranks sharing this memory) do not fit."""
    if os.environ.get("RINGCTX_MEMORY_CHECK", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from ..parallel.planner import MEMORY_USABLE_FRACTION

    need = rows * bytes_per_row * local_ranks
    free, where = available_memory(model.device)
    if need <= free * MEMORY_USABLE_FRACTION:
        return None
    return (f"not enough memory to load the document: {local_ranks} decode rank(s) x {rows:,} KV rows need "
            f"{fmt_bytes(need)} but {where} has {fmt_bytes(free)} available; use more decode ranks on a host with "
            f"more memory (--decode-ranks), or an 8-bit KV cache (--kv-dtype fp8)")


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

    config = model.full_config  # TP ranks hold different shards of the same model
    return (f"model={config.name} config={config.fingerprint()} weights={weights_digest(model)} "
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
                             local_decode=local_decode, decode_ranks=config.decode_ranks, kv_dtype=config.kv_dtype)
    if world > 1:
        agree_across_ranks("prefill", problem, "memory check")
    elif problem:
        raise ValueError(f"prefill: {problem}")


def _worker_main(rank, world, port, backend, threads, conn, model_name, dtype, device, settings) -> None:
    """A spawned rank: join the group, load the model, then serve rank 0's commands until stop.

    Commands come over a pipe from rank 0 (so an idle engine never times out, and the worker ends
    when rank 0's process is gone) as (name, *args), run as the Engine's `_on_<name>` method here;
    tensors travel over the process group. Ctrl-C is rank 0's to handle: it ends the workers. An
    error is reported back over the pipe before the worker exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=settings["timeout_s"])
    try:
        maybe_die(rank, "join")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        store.set(f"ringctx/joined/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        engine = Engine._worker(rank, world, model_name, dtype, _rank_device(device, rank), settings)
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                break
            if command[0] == _STOP:
                break
            try:
                getattr(engine, f"_on_{command[0]}")(*command[1:])
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
