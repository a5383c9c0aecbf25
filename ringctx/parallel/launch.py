"""Process groups: local rank pools (spawn) and joining a torchrun launch.

`RankPool(W)` spawns W local processes, each joining one gloo (CPU) or NCCL (one GPU per rank)
process group, and runs many jobs in that group: a job is a module-level function
`fn(rank, world, *args)` executed on every rank, whose W results come back in rank order. Tests
and benchmarks use it so that process start-up (seconds) is paid once per world size.

A rank that does not answer within `timeout` seconds, or that dies, ends the pool with an error
naming it instead of hanging the caller.
"""

from __future__ import annotations

import datetime
import queue
import signal
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(exitcode: int | None) -> str:
    """'was killed by SIGKILL', 'exited with code 1', ... for a process exit code."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def available_backends() -> list[str]:
    """The torch.distributed backends this build of torch has ("gloo", "nccl")."""
    return [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]


def is_first_rank() -> bool:
    """Whether this process is rank 0 of its job, or runs alone (the one that prints)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def default_backend() -> str:
    """NCCL when every local rank can have its own GPU, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _pool_worker(rank, world, port, backend, threads, timeout_s, tasks, results) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(rank, world, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """W local ranks in one process group, kept alive across jobs.

    Example:
        >>> pool = RankPool(2)                       # doctest: +SKIP
        >>> pool.run(my_module.job, 123)             # job(rank, world, 123) on both ranks
        >>> pool.close()
    """

    def __init__(self, world_size: int, *, backend: str | None = None, threads_per_rank: int = 1,
                 timeout: float = 300.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout = world_size, timeout
        self.backend = backend or default_backend()
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_pool_worker, daemon=True,
                        args=(r, world_size, port, self.backend, threads_per_rank, timeout, self.tasks[r], self.results))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        """Run fn(rank, world, *args) on every rank; returns the results in rank order."""
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            deadline = self.timeout
            while True:
                try:
                    rank, ok, value = self.results.get(timeout=min(deadline, 5.0))
                    break
                except queue.Empty:
                    deadline -= 5.0
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead or deadline <= 0:
                        self.close()
                        why = f"rank {dead[0]} {describe_exit(self.procs[dead[0]].exitcode)}" if dead else \
                            f"no answer within {self.timeout:.0f}s"
                        raise RuntimeError(f"local rank pool of {self.world_size}: {why}") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            rank, tb = min(errors)
            raise RuntimeError(f"rank {rank} of {self.world_size} failed:\n{tb}")
        return out

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
