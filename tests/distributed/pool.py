"""A pool of W spawned gloo ranks that runs many test cases in one process group.

Starting processes and a process group costs seconds, so each world size gets one pool for the
whole test session (see conftest.py). A case is a module-level function `fn(rank, world, *args)`
run on every rank; `RankPool.run` returns the W results in rank order, or raises with the failing
rank's traceback. A rank that does not answer within `timeout` seconds ends the pool with an
error instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
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
    """W gloo ranks on this machine, kept alive across test cases."""

    def __init__(self, world_size: int, timeout: float = 300.0):
        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        """Run fn(rank, world, *args) on every rank; the results in rank order."""
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"a rank of the {self.world_size}-rank pool did not answer within {self.timeout}s") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            rank, tb = min(errors)
            raise RuntimeError(f"rank {rank} of {self.world_size} failed:\n{tb}")
        return out

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
