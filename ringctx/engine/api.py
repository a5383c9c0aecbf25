"""Engine: the public face of ringctx. Context-parallel prefill, then decode on the decode host.

Three ways to run, one API:
    Engine(model)               one process, no process group
    Engine(model, nproc=N)      this process is rank 0 (and leads the decode); it spawns N-1 local
                                worker ranks (gloo on CPU, NCCL with one GPU per rank) and drives
                                them for as many calls as you like; close() (or `with`) ends them
    Engine(model, nproc=N, tp=T) the same ranks as a (N/T CP) x (T TP) mesh: each group of T
                                consecutive ranks holds one copy of the weights split Megatron-style
                                (ringctx.model.tensor_parallel), and the ring runs across the groups
    Engine(model, nproc=N, ep=E) a mixture of experts' experts spread over E consecutive CP ranks
                                (ringctx.model.expert_parallel); with tp too, per TP index
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
import json
import os
import weakref

import torch
import torch.distributed as dist

from ..attention.quant import check_kv_dtype
from ..model import KVCache, Sampler, check_token_ids
from ..model.context import ContextGuard
from ..model.generate import Generation, GenerationResult
from ..model.int8_weights import check_int8_model
from ..model.expert_parallel import ep_problem
from ..model.tensor_parallel import tp_problem
from ..parallel.launch import default_backend
from ..parallel.mesh import mesh_problem
from ..planning.engine_config import EngineConfig
from ..planning.hardware import measured_profile_path, save_profile
from ..runtime import commands
from ..runtime.commands import Command, answer_room, ids_to_bytes
from ..runtime.efficiency import kv_bytes_per_token
from ..runtime.memory_check import auto_kv_budget
from ..runtime.document import Document, chat_frame
from ..runtime.failures import CLOSED, Health, RankFailure, first_line
from .prefix_cache import CachedPrompt, PrefixCache, engine_seed
from .handles import Answer, Batch, ExtendJob, LeaderDecoder, ManyAnswers, PrefillJob, SaveJob
from ..runtime.prefill import PrefillResult
from ..runtime.rank_state import EngineSettings
from .startup import (auto_nproc, build_rank_state, check_loadable, load_hardware, peek_config,
                      resolve_decode_ranks)
from .workers import (BroadcastRanks, SpawnedRanks, command_group, rank_device, receive_broadcast, run_commands,
                      set_collective_timeout)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
"""How long start-up may take at least (spawning ranks, importing torch, loading the model and the
ranks' agreement check): on a loaded machine this takes far longer than any collective should."""


class Engine:
    """Chunked context-parallel prefill with a KV hand-off to the decode ranks of one host.

    Args:
        model: preset name, GGUF path or Hugging Face directory (see ringctx.load_model); the same as
            `config.model`, which it replaces when given.
        config: an EngineConfig (ringctx.planning.engine_config: every setting, its default and what
            it means); None: the defaults.
        **settings: any EngineConfig field by name (nproc, tp, dtype, device, chunk_tokens, strategy,
            hardware, rule, decode_rank, decode_ranks, kv_dtype, weights, timeout_s,
            startup_timeout_s, attn_backend, rope_scaling, allow_long_context, ...), replacing the
            config's. `Engine(model, nproc=2)` and `Engine(config=EngineConfig(model=model,
            nproc=2))` build the same engine. Under tp > 1,
            `decode_rank` and `decode_ranks` count CP ranks (each a group of tp ranks).

    Failures (see ringctx.runtime.failures and docs/MULTIHOST.md): ranks that loaded a different
    model, dtype or ringctx version are refused at start-up (ValueError naming both sides); a
    prefill that would not fit the available memory is refused before it starts (ValueError with
    the numbers and a fix); a sequence past the model's trained context is refused before any rank
    runs it (ContextTooLong, a ValueError: see `check_context`); a rank that dies, hangs past
    `timeout_s` or never joins raises `RankFailure` naming it, and closes the engine. Bad input
    raises ValueError on every rank and the engine stays usable.

    Every public method below is one or more of the commands in ringctx/runtime/commands.py, which
    every rank concerned runs; the engine only validates, sends and collects.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **settings):
        config = (config or EngineConfig()).replace(**settings, **({} if model is None else {"model": str(model)}))
        config.check()
        nproc, dtype, device, tp = config.nproc, config.dtype, config.device, config.tp
        decode_rank, timeout_s = config.decode_rank, config.timeout_s
        if nproc == "auto":
            nproc = auto_nproc(device, tp)
        if dtype == "auto":
            from ..planning.machine_speed import preferred_dtype

            dtype = preferred_dtype(None if device is None else str(device))
        # What runs, "auto" resolved: what `self.config` reports and a saved document records.
        self.config = config = config.replace(nproc=nproc, dtype=dtype)
        self.model_name, self.dtype = config.model, dtype
        self._forgotten: list[int] = []  # documents the caller let go of: the workers drop theirs (see keep_document)
        self._ending: list[LeaderDecoder] = []  # answers that ended here: the followers leave them next
        self._next_id = 0
        # weakref to the newest answer's Generation (driving a LeaderDecoder), which a newer question ends
        self._open_answer = None
        self._batch: Batch | None = None  # the sequences decoded together (batch(), ask_many)
        self._prefix_cache: PrefixCache | None = None  # chat's kept prompts (made at first use)
        # The ranks this one sends its commands to: spawned workers, or (after lead()) torchrun's other ranks.
        self._followers: SpawnedRanks | BroadcastRanks | None = None
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
            check_loadable(self.model_name, dtype)  # fail here, before any process starts
            if config.rope_scaling:  # a stretch the model refuses, too
                peek_config(self.model_name, dtype, config.rope_scaling)
        world = int(os.environ.get("WORLD_SIZE", "1")) if torchrun else nproc
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
        if tp != 1:  # every rank refuses a mesh that cannot work before it joins or loads anything
            model_config = peek_config(self.model_name, dtype, config.rope_scaling)
            problem = (mesh_problem(world, tp, per_host) or tp_problem(model_config, tp)
                       or (check_int8_model(model_config, tp) if config.weights == "int8" else None))
            if problem:
                raise ValueError(problem)
        decode_ranks = resolve_decode_ranks(config.decode_ranks, decode_rank, world // tp, per_host // tp)
        if config.ep != 1:  # likewise for experts that cannot be spread over ep ranks
            problem = ep_problem(peek_config(self.model_name, dtype, config.rope_scaling), config.ep, world // tp,
                                 decode_rank, decode_ranks)
            if problem:
                raise ValueError(problem)
        hardware, measure = load_hardware(config.hardware, device)
        self.settings = settings = EngineSettings(
            model_name=self.model_name, dtype=dtype, strategy=config.strategy, rule=config.rule,
            hardware=hardware, chunk_tokens=config.chunk_tokens, decode_rank=decode_rank,
            decode_ranks=decode_ranks,
            kv_dtype=config.kv_dtype, weights=config.weights, timeout_s=float(timeout_s),
            startup_timeout_s=float(config.startup_timeout_s or max(timeout_s, DEFAULT_STARTUP_TIMEOUT_S)),
            attn_backend=config.attn_backend, ranks_per_host=per_host, tp_size=tp, cp_size=world // tp,
            config=config.to_dict(), rope_scaling=config.rope_scaling, ep_size=config.ep,
            linear_exchange=config.linear_exchange)
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
                self._health = Health(self.rank, self.world_size, settings.timeout_s)
            if not 0 <= decode_rank < settings.cp_size:
                raise ValueError(f"decode_rank {decode_rank} is not a CP rank of this {settings.cp_size}-CP-rank job")
            self.device = rank_device(device, self._local_rank())
            self.state = build_rank_state(self.rank, self.world_size, settings, self.device, self.mode)
            # the trained context every sequence is held to (model/context.py), checked before any command
            self.context = ContextGuard(self.state.model.full_config, config.allow_long_context)
            # This rank's part of every live document, by id, held by the caller (weakly here) and
            # dropped on the spawned workers once the caller lets go of it (see keep_document).
            self.state.documents = weakref.WeakValueDictionary()
            if self.world_size > 1:
                set_collective_timeout(settings.timeout_s)
            if self._health is not None:
                self._health.learn_peers()  # every rank published its place before the check
            if measure:
                self._measure_hardware()
        except BaseException as exc:
            failure = self._fail(exc, "start-up")
            if failure is exc:
                raise
            raise failure from exc

    def _measure_hardware(self) -> None:
        """hardware="measured" (or "auto" without a calibrated profile, on a CPU): every rank
        measures this machine together (runtime/measure.py) and the per-chunk rule decides with
        it; rank 0 keeps the profile where `ringctx plan` finds it (measured_profile_path)."""
        profile = self.run_command("start-up", commands.MEASURE_HARDWARE)
        self.settings = self.state.settings
        if self.rank == 0:
            try:
                path = measured_profile_path(self.settings.cp_size)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_profile(profile, path)
            except OSError:  # a read-only home: the run decides with it all the same
                pass

    # ------------------------------------------------------------------ what callers read
    model = property(lambda self: self.state.model, doc="This rank's Transformer (its TP shard under tp > 1).")
    mesh = property(lambda self: self.state.mesh, doc="This rank's place in the (cp, tp) mesh.")
    chunk_tokens = property(lambda self: self.state.chunk_tokens, doc="Tokens per prefill chunk.")
    strategy = property(lambda self: self.settings.strategy)
    rule = property(lambda self: self.settings.rule)
    hardware = property(lambda self: self.settings.hardware)
    kv_dtype = property(lambda self: self.settings.kv_dtype)
    weights = property(lambda self: self.settings.weights, doc='"model" or "int8" (see __init__).')
    timeout_s = property(lambda self: self.settings.timeout_s)
    attn_backend = property(lambda self: self.settings.attn_backend)
    decode_rank = property(lambda self: self.settings.decode_rank)
    decode_ranks = property(lambda self: self.settings.decode_ranks)
    tp_size = property(lambda self: self.settings.tp_size)
    ep_size = property(lambda self: self.settings.ep_size, doc="Expert-parallel ranks (1: every rank holds every expert).")
    cp_size = property(lambda self: self.settings.cp_size)
    ranks_per_host = property(lambda self: self.settings.ranks_per_host)

    @property
    def _documents(self):
        return self.state.documents

    @property
    def worker_processes(self) -> list:
        """The spawned ranks' processes (rank i + 1 at index i; empty unless nproc > 1 without torchrun)."""
        return list(self._followers.processes) if self._followers is not None else []

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
        startup = self.settings.startup_timeout_s
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=startup))
        except Exception as exc:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise RankFailure(
                f"rank {os.environ.get('RANK', '?')} could not join the {os.environ.get('WORLD_SIZE')}-rank group at "
                f"{where} within {startup:g} s: {first_line(exc)}; start every rank with the same MASTER_ADDR, "
                "MASTER_PORT and WORLD_SIZE (torchrun does) and check that the port is reachable") from None
        self._owns_group = True

    def _spawn_workers(self, nproc: int, device) -> None:
        if dist.is_initialized():
            raise RuntimeError("a process group already exists in this process (another Engine with nproc > 1?); "
                               "close it first")
        backend = default_backend() if device is None or str(device).startswith("cuda") else "gloo"
        threads = max(1, (os.cpu_count() or 1) // nproc)
        self._followers = SpawnedRanks(nproc, backend, threads, self.settings.startup_timeout_s)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)  # rank 0 shares the cores with its workers; restored by close()
        self._followers.start(lambda rank: (self.settings, device, build_rank_state))
        self._owns_group = True

    def lead(self) -> None:
        """Torchrun: from now on rank 0 alone drives the engine, as in spawn mode, while every other
        rank runs `follow()` (a server: requests arrive at rank 0 only). Call on rank 0 while the
        others call follow(); both first make the group the commands travel over."""
        if self.mode != "torchrun" or self.rank != 0:
            raise ValueError("lead() is for rank 0 of a torchrun job (spawned engines are led already)")
        self.check_open()
        self._followers = BroadcastRanks(command_group(), self.world_size)

    def follow(self) -> None:
        """Torchrun, every rank but 0: run rank 0's commands (see `lead`) until it closes the engine.
        Returns once rank 0 has stopped; a lost rank is raised as a RankFailure."""
        if self.mode != "torchrun" or self.rank == 0:
            raise ValueError("follow() is for the ranks of a torchrun job other than rank 0, which calls lead()")
        self.check_open()
        self.state.documents = dict(self.state.documents)  # held here now, as a worker holds them, until DROP
        try:
            run_commands(self.state, receive_broadcast(command_group(), self.rank))
        except BaseException as exc:
            self.raise_failure(exc, "serving")
        self.close()

    # ------------------------------------------------------------------ failures and closing
    def _fail(self, exc: BaseException, during: str) -> BaseException:
        """After `exc` interrupted `during`: name the lost rank if there is one, release every rank
        and the group, and return what to raise (a RankFailure, or `exc` itself)."""
        failure = None
        if isinstance(exc, Exception) and not isinstance(exc, (ValueError, RankFailure)):
            timeout = self.settings.startup_timeout_s if during == "start-up" else self.settings.timeout_s
            try:
                if self._followers is not None and self._followers.watch is not None:
                    failure = self._followers.watch.diagnose(exc, during, self._followers.nproc, timeout)
                elif self._health is not None:
                    failure = self._health.diagnose(exc, during)
            except Exception:  # diagnosis is best effort; the original error still goes out
                failure = None
        graceful = isinstance(exc, ValueError) and self.mode == "torchrun"  # every rank raised the same
        self._shutdown(graceful=graceful, why=str(failure or exc) or type(exc).__name__)
        return failure or exc

    def _shutdown(self, *, graceful: bool, why: str) -> None:
        if self._health is not None:
            self._health.stop()
            self._health = None
        if self._followers is not None:
            self._followers.stop(graceful=graceful)
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

    def close(self) -> None:
        """End spawned workers and the process group this engine created (idempotent)."""
        if self._closed is None:
            self._shutdown(graceful=True, why="close() was called")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the port its handles use
    # What PrefillJob, SaveJob, LeaderDecoder, Answer, Batch and ManyAnswers (engine/handles.py) call
    # back: the `EnginePort` declared there. Public so that the handles need none of the engine's
    # private members; a caller of the engine needs none of them.
    @property
    def is_open(self) -> bool:
        """Whether the engine can still run commands (a lost rank, or close(), ends that)."""
        return self._closed is None

    def check_open(self) -> None:
        """Raise the RankFailure saying why, once the engine can no longer run commands."""
        if self._closed is not None:
            raise RankFailure(f"this engine is closed: {self._closed}; create a new Engine")

    def run_command(self, during: str, command: Command, *fields, **local):
        """Run `command` on this rank as its part of a job every rank concerned takes part in.

        Spawn mode: rank 0 first sends the command's name and fields to the workers concerned
        (every worker, or only the decode ranks for a decode_only command). A ValueError (bad
        input, the same on every rank) leaves the engine usable; any other failure (a lost or
        stuck rank, Ctrl-C) releases every rank and is raised as a RankFailure naming the rank."""
        self.check_open()
        try:
            self.send_command(command, fields)
            return command.run(self.state, *fields, **local)
        except BaseException as exc:
            self.raise_failure(exc, during)

    def send_command(self, command: Command, fields: tuple) -> None:
        """Spawn mode: send `command` to the workers concerned, after what is pending (answers that
        ended, documents let go of). Never called from a finalizer: sends keep every worker's order."""
        if self._followers is None:
            return
        ending, self._ending = self._ending, []
        for decoder in ending:  # each also ends here, with the followers: a collective, so in order
            self._followers.send(commands.ANSWER_END, (decoder.id,), self.state.holds_decode)
            decoder.end_here()
        forgotten, self._forgotten = self._forgotten, []
        for document_id in forgotten:
            self._followers.send(commands.DROP, (document_id,), self.state.holds_decode)
        self._followers.send(command, fields, lambda r: not command.decode_only or self.state.holds_decode(r))

    def raise_failure(self, exc: BaseException, during: str):
        """Raise what `exc`, which interrupted `during`, means: a ValueError as it is (every rank
        raised it before communicating); anything else releases every rank and is raised as the
        RankFailure naming the lost rank, or as itself when no rank was lost."""
        if isinstance(exc, ValueError):
            raise exc
        failure = self._fail(exc, during)
        if failure is exc:
            raise exc
        raise failure from exc

    def answer_over(self, decoder: LeaderDecoder) -> None:
        """An answer is over on this rank (LeaderDecoder.close): with followers, they leave it with
        the next command sent (it may be over in a finalizer, where a send could reorder the
        workers' commands); alone, it ends here now."""
        if self._followers is not None:
            self._ending.append(decoder)
        else:
            decoder.end_here()

    def new_id(self) -> int:
        """The next document, prefill or answer number: every rank makes the same calls, so they count alike."""
        self._next_id += 1
        return self._next_id

    def check_context(self, new_tokens: int, *, cached_tokens: int = 0, max_new_tokens: int = 0) -> None:
        """Refuse (ContextTooLong, a ValueError) a sequence of cached_tokens + new_tokens +
        max_new_tokens past the model's trained context, before any rank runs it; with
        allow_long_context warn once instead (ringctx.model.context: the one rule). Every entry
        point below calls it; `ringctx serve` too, before it queues a request."""
        self.context.check(int(new_tokens), cached_tokens=int(cached_tokens), max_new_tokens=int(max_new_tokens))

    def keep_document(self, document: Document) -> Document:
        """A new document on this rank (held weakly in state.documents; the caller holds it): rank 0
        of a spawned job has the workers drop theirs once the caller lets go of it (at the next command)."""
        self.state.documents[document.id] = document
        if self._followers is not None:
            weakref.finalize(document, self._forgotten.append, document.id)
        return document

    # ------------------------------------------------------------------ prefill
    def prefill(self, token_ids, *, cache: KVCache | None = None, cache_token_ids=None,
                chunk_tokens: int | None = None, strategy: str | None = None, decode_room: int = 256,
                trace: bool = False, on_chunk=None, as_document: bool = False,
                drop_unseen: bool = False, checkpoint: str | None = None, restart: bool = False,
                keep_checkpoint: bool = False, extra: dict | None = None) -> PrefillResult:
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
            drop_unseen: with as_document, its windowed and chunked layers keep only the rows that
                tokens after it see (the last W, the current chunk: KVCache.drop_unseen), so a
                document of a 3:1 windowed:full model takes about a quarter of the memory; its
                prefixes (document_prefix, cut_document) are then refused. `ingest` does so.
            checkpoint: a directory (on a filesystem every rank sees) where every rank appends its
                rows of each chunk as the chunk completes; when it already holds chunks of this
                prefill (the same tokens, model, dtype and KV dtype), the prefill resumes after
                them (runtime/checkpoint.py): on the same ranks and settings bit-identical to a
                prefill that never stopped, on others exact to the usual tolerance. A checkpoint
                of other tokens or another model is a ValueError (`restart=True` starts over).
                Removed once the prefill finishes, unless `keep_checkpoint` (remove it with
                `remove_checkpoint` once the document is saved). Not with `cache`.
            extra: JSON-able fields the checkpoint keeps with the tokens (a document's chat frame).

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
        job = self.start_prefill(token_ids, cache=cache, cache_token_ids=cache_token_ids, chunk_tokens=chunk_tokens,
                                 strategy=strategy, decode_room=decode_room, trace=trace, on_chunk=on_chunk,
                                 as_document=as_document, drop_unseen=drop_unseen, checkpoint=checkpoint,
                                 restart=restart, keep_checkpoint=keep_checkpoint, extra=extra)
        while not job.done:
            job.step()
        return job.finish()

    def start_prefill(self, token_ids, *, cache: KVCache | None = None, cache_token_ids=None,
                      chunk_tokens: int | None = None, strategy: str | None = None, decode_room: int = 256,
                      trace: bool = False, on_chunk=None, as_document: bool = False,
                      drop_unseen: bool = False, checkpoint: str | None = None, restart: bool = False,
                      keep_checkpoint: bool = False, extra: dict | None = None) -> "PrefillJob":
        """`prefill`, a chunk at a time: returns a PrefillJob (call `step()` until `done`, then
        `finish()`); between two steps the engine may run other commands (another prefill's
        chunk, an answer's token). Arguments as `prefill`'s; raises the same errors, at start."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        state = self.state
        config = state.prefill_config(chunk_tokens, strategy, decode_room, trace)  # validates before sending
        if cache is not None and (self.decode_ranks > 1 or self.tp_size > 1):
            raise ValueError(f"prefill on top of a whole cache needs decode_ranks=1 and tp=1 (this engine has "
                             f"{self.decode_ranks} and {self.tp_size}); ask about a Document instead, which stays split")
        if cache is not None and cache.trimmed and self.world_size > 1:
            raise ValueError("prefill on top of a cache whose windowed or chunked layers dropped rows runs on one "
                             "rank; ask about it as a Document instead")
        # Every rank must decide alike: under torchrun only the decode rank holds `cache`, so there its
        # rows are left out (the agreement in PREFILL_START would otherwise wait for a rank that refused).
        self.check_context(token_ids.numel(),
                           cached_tokens=cache.length if cache is not None and self.mode != "torchrun" else 0)
        cached = cache.length if cache is not None and self.rank == state.leader else 0
        prefill_id, keep = self.new_id(), (self.new_id() if as_document else None)
        fields = (prefill_id, ids_to_bytes(token_ids), config.chunk_tokens, config.strategy, decode_room, bool(trace),
                  cached, keep, bool(drop_unseen and as_document and self.model.has_spans),
                  os.path.abspath(os.fspath(checkpoint)) if checkpoint else "", bool(restart), bool(keep_checkpoint),
                  json.dumps(extra or {}))
        run = self.run_command("prefill", commands.PREFILL_START, *fields, cache=cache, cache_token_ids=cache_token_ids,
                        on_chunk=on_chunk)
        return PrefillJob(self, prefill_id, run)

    # ------------------------------------------------------------------ documents and questions
    def ingest(self, text, *, chat: bool = True, **prefill_kwargs) -> Document | None:
        """Prefill a document (text, or token ids) so that questions can be asked about it.

        Its windowed and chunked layers keep only the rows later tokens see (pass
        drop_unseen=False to keep every row, for prefixes of it: see `prefill`).

        With `chat` (and a tokenizer with a chat template) the document opens a user turn; each
        question completes that turn and the template's assistant header follows. Returns the
        Document on the decode ranks (each holds its part), None elsewhere.

        checkpoint=DIR makes the ingest survive a crash: every chunk's rows are appended there as
        it completes, and the same call run again resumes after the last chunk every rank wrote
        (see `prefill`; `job.resume` of `start_ingest` says how it started).
        """
        job = self.start_ingest(text, chat=chat, **prefill_kwargs)
        while not job.done:
            job.step()
        return job.finish().document

    def start_ingest(self, text, *, chat: bool = True, **prefill_kwargs) -> "PrefillJob":
        """`ingest`, a chunk at a time (see `start_prefill`): `finish().document` is the Document."""
        ids, suffix, chat = self.document_token_ids(text, chat=chat)
        prefill_kwargs.setdefault("drop_unseen", True)
        prefill_kwargs.setdefault("extra", {"question_suffix": suffix, "chat": chat})
        job = self.start_prefill(ids, as_document=True, **prefill_kwargs)
        job.frame = (suffix, {"chat": chat})
        return job

    def document_token_ids(self, text, *, chat: bool = True) -> tuple[list[int], str, bool]:
        """(token ids, question suffix, chat) of a document as `ingest` prefills it (text, or token ids as they are)."""
        if isinstance(text, str):
            rendered, suffix = self.document_text(text, chat=chat)
            ids = self._tokenizer()(rendered, add_special_tokens=False)["input_ids"]
            return ids, suffix, chat
        ids = list(map(int, text))
        if not ids:
            raise ValueError("the document is empty: give at least one token id")
        return ids, "", False

    def document_text(self, text: str, *, chat: bool = True) -> tuple[str, str]:
        """(the text `ingest` tokenizes for a document, the text that ends a question after it): in
        chat form the document opens the first user turn and a question follows a blank line."""
        if not text.strip():
            raise ValueError("the document is empty: give some text to ingest")
        prefix, suffix = ("", "") if not chat else chat_frame(self._tokenizer())
        return prefix + text + ("\n\n" if chat else ""), suffix

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
        if not self.state.is_decode_rank:
            if self.mode == "spawn":
                raise RuntimeError("extend runs on the decode ranks only")
            return None
        self.check_context(ids.numel(), cached_tokens=document.length)  # every decode rank holds the document
        self.end_open_answer(document)  # it would write into the rows the extension takes
        if self._batch is not None and any(m.document is document for m in self._batch.members):
            raise ValueError("the document has questions decoding in the batch: extend it once they are answered")
        return self.run_command("extend", commands.EXTEND, document.id, ids_to_bytes(ids), decode_room, document=document,
                         on_chunk=on_chunk)

    def start_extend(self, document: Document, token_ids, *, chunk_tokens: int, decode_room: int = 256) -> ExtendJob:
        """`extend`, a chunk of `chunk_tokens` tokens at a time (ExtendJob: call `step()` until
        `done`; between two steps the engine may run other commands): a long prompt after a cached
        prefix, beside the answers in flight. The document must be one no question reads."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0 or chunk_tokens < 1:
            raise ValueError("nothing to extend the document with, or chunk_tokens < 1")
        self.check_context(ids.numel(), cached_tokens=document.length)
        if self._batch is not None and any(m.document is document for m in self._batch.members):
            raise ValueError("the document has questions decoding in the batch: extend a copy of it")
        self.end_open_answer(document)
        return ExtendJob(self, document, ids, chunk_tokens, decode_room)

    def generate(self, document: Document, prompt, *, max_new_tokens: int = 256, **sampling):
        """Stream the answer to `prompt` (text, or token ids) appended to the document.

        The document's cache is first cut back to the document, so questions do not see each
        other. On the (first) decode rank it returns the model's Generation iterator of text
        pieces (its `.result` holds token timings once exhausted; `.advance()` runs one token at
        a time). With several decode ranks, call it on every rank (torchrun); the other decode
        ranks take part in every step and get an empty iterator once the answer is complete.
        sampling: temperature, top_k, top_p, seed, stop. A newer question ends an answer not read
        to its end (reading it further raises ValueError).
        """
        if (isinstance(prompt, str) and not prompt.strip()) or (not isinstance(prompt, str) and len(prompt) == 0):
            raise ValueError("the question is empty: ask something about the document")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        Sampler(**{k: v for k, v in sampling.items() if k in ("temperature", "top_k", "top_p")})  # validates here
        state = self.state
        if not state.is_decode_rank:
            if self.mode == "spawn" or self.decode_ranks == 1:
                raise RuntimeError("generate runs on the decode ranks only")
            return iter(())
        ids = self.question_ids(document, prompt)
        self.check_context(ids.numel(), cached_tokens=document.length, max_new_tokens=max_new_tokens)
        self.end_open_answer()
        if self.rank != state.leader:  # a follower (torchrun): every step, then nothing to show
            self.run_command("decode", commands.ANSWER_FOLLOW, document.id, ids,
                      commands.answer_room(max_new_tokens, self.decode_ranks), document=document)
            return iter(())
        # One decode rank or several: the question's prefill and the steps as a batch runs them
        # (cp_prefill over the decode ranks, then the fused step with the document's rows apart),
        # so this answer is the one `ask_many` and `ringctx serve` give, bit for bit.
        decoder = LeaderDecoder(self, document, max_new_tokens)
        generation = Generation(self.model, ids, max_new_tokens=max_new_tokens, decoder=decoder, **sampling)
        self._open_answer = weakref.ref(generation)
        return Answer(self, generation)

    def end_open_answer(self, document: Document | None = None) -> None:
        """The newest answer (of `document`, or of any) holds its document's rows and, split, its
        place on the other decode ranks: end it (reading it further raises ValueError). Part of the
        handles' port too: a batch's join ends it first."""
        generation = self._open_answer() if self._open_answer is not None else None
        if generation is None or (document is not None and generation.decoder.document is not document):
            return
        self._open_answer = None
        try:
            generation.close()
        except BaseException as exc:
            self.raise_failure(exc, "decode")

    def batch(self) -> Batch:
        """The engine's batch: sequences (questions about documents, or prompts of their own)
        decoded together, one step for all, each document's rows read once per step for every
        question on it (runtime/batch.py). Rank 0 only, of one process or of spawned ranks (under
        torchrun after `lead()`); `Scheduler` and `ask_many` drive it."""
        if self.mode == "worker" or (self.mode == "torchrun" and (self.rank != 0 or self._followers is None)):
            raise ValueError("a batch is driven by rank 0 alone: under torchrun call lead() on rank 0 and follow() "
                             "on the others first (as ringctx serve does)")
        self.check_open()
        if self._batch is None:
            self._batch = Batch(self)
        return self._batch

    def ask_many(self, document: Document | None, questions, *, max_batch: int | None = None,
                 **kwargs) -> "ManyAnswers":
        """Answer several questions about `document` together; iterate the result for
        (question index, text piece) as each piece becomes final, in step order (every running
        question advances one token per step). `.results[i]` is question i's GenerationResult once
        the iteration ends. kwargs as `generate`'s (max_new_tokens, temperature, top_k, top_p, seed,
        stop), the same for every question (each samples with its own generator: a seeded
        question gets the answer it gets alone). max_batch: at most this many decode at once (the
        others join as they end; None: all). Each answer equals the question asked alone."""
        questions = list(questions)
        if not questions:
            raise ValueError("ask_many needs at least one question")
        for i, q in enumerate(questions):
            if (isinstance(q, str) and not q.strip()) or (not isinstance(q, str) and len(q) == 0):
                raise ValueError(f"question {i} is empty: ask something about the document")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        return ManyAnswers(self, document, questions, max_batch or len(questions), kwargs)

    def question_ids(self, document: Document | None, prompt) -> torch.Tensor:
        """A question's token ids as `generate` appends them to `document` (text in the document's
        frame; None: a prompt of its own, text tokenized as it is). Token ids are taken as they are,
        checked here against the vocabulary: a bad id found by the ranks after the answer's first
        command had left some of them holding its state."""
        if not isinstance(prompt, str):
            ids = torch.as_tensor(list(map(int, prompt)), dtype=torch.long)
            check_token_ids(ids, self.model.config.vocab_size)
            return ids
        if document is not None:
            prompt = document.question_prefix + prompt + document.question_suffix
        return torch.tensor(self._tokenizer()(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def ask(self, document: Document, question: str, **kwargs) -> str:
        """The whole answer to `question` about `document` (see `generate`; "" on the other ranks)."""
        return "".join(self.generate(document, question, **kwargs))

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prompts `chat` keeps (engine/prefix_cache.py), in memory within prefix_cache_share of
        the KV budget (runtime/memory_check.auto_kv_budget); None with prefix_cache=False. Rank 0."""
        if not self.config.prefix_cache:
            return None
        if self._prefix_cache is None:
            budget = int(auto_kv_budget(self) * self.config.prefix_cache_share)
            self._prefix_cache = PrefixCache(self, bytes_per_token=kv_bytes_per_token(self), budget_bytes=budget,
                                             min_tokens=self.config.prefix_cache_min_tokens)
        return self._prefix_cache

    def chat(self, messages, *, max_new_tokens: int = 256, cache_salt: str | None = None,
             **sampling) -> GenerationResult:
        """Answer a prompt of its own, reusing the rows of any earlier prompt (or conversation turn
        and its answer) that began the same way (the prefix cache: `prefix_cache`).

        messages: a chat ([{"role", "content"}, ...], rendered by the chat template with the
        assistant's header), a prompt text (tokenized as it is) or token ids. The prompt's tokens
        after the longest cached prompt that begins it are prefilled on top of its rows, over the
        decode ranks; a prompt no entry begins is prefilled over every rank. When the answer is
        complete its rows (prompt and answer) are kept, so the next turn of the conversation
        prefills only its new message. cache_salt: prompts reuse each other only with equal salts.
        sampling: temperature, top_k, top_p, seed, stop (as `generate`'s).

        Returns the GenerationResult; its `cached_tokens` of the prompt's tokens came from the
        cache and `prompt_tokens` were prefilled. Rank 0 of one process or of spawned ranks.

        Example:
            >>> engine = Engine("tiny", dtype="float32", prefix_cache_min_tokens=64)
            >>> first = engine.chat(list(range(1, 200)), max_new_tokens=4)    # 199 tokens, kept with the answer
            >>> turn = list(range(1, 200)) + first.token_ids + [7, 8]          # the next turn
            >>> again = engine.chat(turn, max_new_tokens=4)
            >>> first.cached_tokens, again.cached_tokens, again.prompt_tokens  # the answer's last token had no row
            (0, 202, 3)
        """
        ids = self._prompt_ids(messages)
        if ids.numel() < 2:
            raise ValueError("the prompt has fewer than 2 tokens: give a longer prompt")
        self.check_context(ids.numel(), max_new_tokens=max_new_tokens)  # before any of it is prefilled
        cache = self.prefix_cache
        seed = engine_seed(self, cache_salt) if cache is not None else ""
        match = cache.lookup(ids, seed) if cache is not None and ids.numel() > cache.min_tokens else None
        prompt = CachedPrompt(cache, seed, match, ids, match.tokens if match is not None else 0,
                              room=answer_room(max_new_tokens, self.decode_ranks))
        if match is not None:
            document, rest = prompt.document(self), ids[match.tokens:]
        else:  # over every rank, then its last token asked on it
            prefilled = self.prefill(ids[:-1], as_document=True, decode_room=prompt.room)
            document, rest = prompt.prefilled(prefilled), ids[-1:]
        batch = self.batch()
        member = batch.join(document, rest, max_new_tokens=max_new_tokens, keep=prompt.keep, **sampling)
        while not member.left:
            batch.step()
        prompt.left(member)
        result = member.result
        result.cached_tokens, result.prompt_tokens = prompt.cached_tokens, int(ids.numel()) - prompt.cached_tokens
        return result

    def _prompt_ids(self, prompt) -> torch.Tensor:
        """A chat's, a text's or token ids' prompt as token ids [T]."""
        if isinstance(prompt, str):
            return torch.tensor(self._tokenizer()(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
        items = list(prompt)
        if items and isinstance(items[0], dict):
            text = self._tokenizer().apply_chat_template(items, tokenize=False, add_generation_prompt=True)
            return torch.tensor(self._tokenizer()(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        return torch.as_tensor(list(map(int, items)) if not torch.is_tensor(prompt) else prompt,
                               dtype=torch.long).reshape(-1)

    def save_document(self, document: Document, path: str) -> None:
        """Save `document` as a directory of per-rank slices (see ringctx.runtime.documents), atomically.

        Call on every decode rank (torchrun); a document saved by N decode ranks loads on any number."""
        if not self.state.is_decode_rank:
            return
        self.end_open_answer(document)  # the saved rows are the document's: an answer's are cut off
        self.run_command("save", commands.SAVE, document.id, os.fspath(path), document=document)

    def start_save(self, document: Document, path: str) -> "SaveJob | None":
        """`save_document` in the background: every decode rank starts writing its slice on a thread
        and the engine is free at once (answers go on); `SaveJob.finish()` completes the document
        (a short collective; call it when `written`, or it waits). None off the decode ranks."""
        if not self.state.is_decode_rank:
            return None
        self.end_open_answer(document)
        save_id = self.new_id()
        pending = self.run_command("save", commands.SAVE_START, document.id, os.fspath(path), save_id, document=document)
        return SaveJob(self, save_id, pending)

    def load_document(self, path: str, *, decode_room: int = 256) -> Document | None:
        """A Document saved with `save_document` (by any number of decode ranks), split over this
        engine's decode ranks and checked against its model; stored in this engine's kv_dtype when it
        is not "model" (a bf16 document loads as fp8, say), else as saved. None off the decode ranks."""
        if not self.state.is_decode_rank:
            return None
        document = self.run_command("load", commands.LOAD, os.fspath(path), self.new_id(), decode_room)
        return self.keep_document(document)

    def document_prefix(self, document: Document, tokens: int, *, view: bool = False,
                        decode_room: int = 256) -> Document | None:
        """A new Document of `document`'s first `tokens` tokens (a prompt that shares only its start
        with a cached one asks about this), each decode rank from its own rows where they are: a
        copy of them with `decode_room` rows free, or with `view` a view (nothing copied: questions
        may ask it while `document` lives; an answer alone or an extension copies it first). None
        off the decode ranks.

        Example:
            >>> engine = Engine("tiny", dtype="float32")
            >>> document = engine.ingest(list(range(100)))
            >>> engine.document_prefix(document, 40, view=True).length
            40
        """
        if not self.state.is_decode_rank:
            return None
        if not 0 < tokens <= document.length:
            raise ValueError(f"a prefix of {tokens} tokens of a {document.length}-token document: give 1 to "
                             f"{document.length}")
        document.check_prefix(tokens)
        self.end_open_answer(document)  # an answer's rows would be cut off the copy anyway
        prefix = self.run_command("prefix", commands.PREFIX, document.id, int(tokens), self.new_id(), decode_room,
                                  bool(view), document=document)
        return self.keep_document(prefix)

    def join_documents(self, first: Document, second: Document, tokens: int | None = None, *,
                       first_tokens: int | None = None, decode_room: int = 256) -> Document | None:
        """A new Document of `first`'s first `first_tokens` tokens (None: all) then `second`'s rows,
        which continue them (the own rows a batch member kept with keep="own": its question and
        answer), `tokens` tokens in all (None: every one of both). Each decode rank joins its own
        rows where they are, with `decode_room` rows free. None off the decode ranks."""
        if not self.state.is_decode_rank:
            return None
        first_tokens = first.length if first_tokens is None else int(first_tokens)
        total = first_tokens + second.length
        tokens = total if tokens is None else int(tokens)
        if not 0 < first_tokens <= first.length or not first_tokens < tokens <= total:
            raise ValueError(f"{tokens} tokens of {first_tokens} of a {first.length}-token document and a "
                             f"{second.length}-token one after them: give {first_tokens + 1} to {total}")
        first.check_prefix(first_tokens, "a join after the first")
        self.end_open_answer(first)
        joined = self.run_command("joined", commands.JOINED, first.id, second.id, first_tokens, tokens,
                                  self.new_id(), decode_room, first=first, second=second)
        return self.keep_document(joined)

    def cut_document(self, document: Document, tokens: int) -> None:
        """Cut `document` back to its first `tokens` tokens in place, on every decode rank (its rows
        past them are forgotten, nothing is copied); it must be one no question reads."""
        if not self.state.is_decode_rank:
            return
        if not 0 < tokens <= document.length:
            raise ValueError(f"a cut to {tokens} tokens of a {document.length}-token document: give 1 to "
                             f"{document.length}")
        document.check_prefix(tokens, "a cut")
        if self._batch is not None and any(m.document is document for m in self._batch.members):
            raise ValueError("the document has questions decoding in the batch: cut it once they are answered")
        self.end_open_answer(document)
        self.run_command("cut", commands.CUT, document.id, int(tokens), document=document)

    def drop_document(self, document: Document) -> None:
        """Free `document`'s KV cache on every decode rank."""
        if self.state.is_decode_rank:
            self.run_command("drop", commands.DROP, document.id)

    def document_rows(self, document: Document) -> list[int]:
        """KV rows (tokens) of `document` each decode rank holds now, its answers' rows included."""
        if not self.state.is_decode_rank:
            return []
        if self.decode_ranks == 1:
            return [document.cache.length]
        return self.run_command("rows", commands.ROWS, document.id)

    def move_document_pages(self) -> int:
        """One 2 MiB page of the document caches still in small pages moved into a huge page on every
        decode rank (what a scheduler does when it has nothing to run: see commands.move_pages);
        returns how many such caches there were over all decode ranks (0: nothing left to move)."""
        if not self.state.is_decode_rank:
            return 0
        return self.run_command("pages", commands.MOVE_PAGES)

    def whole_cache(self, document: Document) -> KVCache | None:
        """The document's KV cache in sequence order, gathered on the (first) decode rank (None on
        the others): for checks and small documents; the decode itself never gathers it."""
        if not self.state.is_decode_rank:
            return None
        if self.decode_ranks == 1 and self.tp_size == 1:
            return document.rewind()
        self.end_open_answer(document)  # the gathered rows are the document's: an answer's are cut off
        return self.run_command("gather", commands.GATHER, document.id)

    def _tokenizer(self):
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer (random-weight preset); "
                             "pass token ids to prefill() instead of text")
        return tokenizer
