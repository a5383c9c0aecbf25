"""The processes of an engine: spawning local worker ranks, joining a torchrun launch, and the
loop a spawned worker runs (each message from rank 0 is one of the commands in commands.py).

    rank 0 (the caller)                              rank r (spawned)
    SpawnedRanks.start()  ── TCPStore on a free port ──▶  worker_main(): join, load the model
    SpawnedRanks.send(command, fields)  ── pipe ──▶   COMMANDS[name].run(state, *fields)
    SpawnedRanks.stop()   ── "stop" ──▶               leave the group, exit

Commands go over a pipe rather than the process group so that an idle engine never times out
and a worker ends when rank 0's process is gone; tensors travel over the process group. The
messages are tuples of ints, strings and bytes between the engine's own processes (pickled by
multiprocessing, never read from anywhere else).
"""

from __future__ import annotations

import ast
import base64
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..runtime.commands import COMMANDS, Command
from ..runtime.failures import ProcessWatch, RankFailure, first_line, maybe_die

STOP = "stop"
"""The message that ends a worker's loop (not a command: it runs nothing)."""


def rank_device(device, rank: int) -> torch.device:
    """The device of local rank `rank`: as asked, else one GPU per rank, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def set_collective_timeout(timeout_s: float) -> None:
    """From now on a collective of the world group that waits `timeout_s` for a rank fails (start-up
    ran under the longer start-up timeout: loading a model under load takes longer than a step)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))


class SpawnedRanks:
    """Rank 0's side of a spawned job: the worker processes, their pipes and the watch over them."""

    def __init__(self, nproc: int, backend: str, threads: int, startup_timeout_s: float):
        self.nproc, self.backend, self.threads, self.startup_timeout_s = nproc, backend, threads, startup_timeout_s
        self.processes: list = []  # rank i + 1 at index i
        self.conns: list = []      # rank 0's end of each worker's command pipe
        self.watch: ProcessWatch | None = None

    def start(self, build_worker_args) -> None:
        """Spawn ranks 1 .. nproc-1 and join the group with them as rank 0.

        build_worker_args(rank) -> the extra arguments of `worker_main` for that rank."""
        check_main_guard(self.nproc)
        timeout = datetime.timedelta(seconds=self.startup_timeout_s)
        # Rank 0 hosts the group's store on a port the OS picks (no race for a "free" port).
        store = dist.TCPStore("127.0.0.1", 0, self.nproc, is_master=True, wait_for_workers=False, timeout=timeout)
        ctx = mp.get_context("spawn")
        for rank in range(1, self.nproc):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=worker_main, daemon=True, name=f"ringctx-rank{rank}",
                            args=(rank, self.nproc, store.port, self.backend, self.threads, child_end,
                                  *build_worker_args(rank)))
            p.start()
            child_end.close()
            self.processes.append(p)
            self.conns.append(parent_end)
        self.watch = ProcessWatch(self.processes, self.conns)
        if self.backend == "nccl":
            torch.cuda.set_device(0)
        # Wait for every worker to reach the store, watching them: one that dies ends the wait at once.
        keys = [f"ringctx/joined/{r}" for r in range(1, self.nproc)]
        deadline = time.monotonic() + self.startup_timeout_s
        while not store.check(keys):
            if self.watch.first_death is not None:
                raise RuntimeError("a worker died before joining the group")
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys, start=1) if not store.check([k])]
                raise RankFailure(f"start-up: rank(s) {', '.join(map(str, missing))} of {self.nproc} did not join "
                                  f"within the {self.startup_timeout_s:g} s start-up timeout", missing)
            time.sleep(0.02)
        dist.init_process_group(self.backend, store=store, rank=0, world_size=self.nproc, timeout=timeout)

    def send(self, command: Command, fields: tuple, to_rank) -> None:
        """Send `command` with its fields to every worker rank r for which to_rank(r) is true."""
        for r, conn in enumerate(self.conns, start=1):
            if to_rank(r):
                conn.send((command.name, *fields))

    def stop(self, *, graceful: bool) -> None:
        """End the workers: ask them to leave (graceful) or kill them; close the pipes."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if graceful:
            for conn in self.conns:
                try:
                    conn.send((STOP,))
                except (OSError, ValueError):
                    pass
        for p in self.processes:
            p.join(timeout=10 if graceful else 0.2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []


def worker_main(rank, world, port, backend, threads, conn, settings, device, build_state) -> None:
    """A spawned rank: join the group, build this rank's state, then run rank 0's commands until stop.

    `build_state(rank, world, settings, device)` loads the model and checks it against the others
    (a module-level function of startup.py, so that this module needs no Engine). Ctrl-C is rank 0's
    to handle: it ends the workers. A failure is reported back over the pipe before the worker
    exits; a ValueError (bad input, raised on every rank alike) only skips the command.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        maybe_die(rank, "join")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=settings.startup_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        store.set(f"ringctx/joined/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        state = build_state(rank, world, settings, rank_device(device, rank))
        set_collective_timeout(settings.timeout_s)
        run_commands(state, conn.recv)
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {first_line(exc, 300)}"))
        except Exception:
            pass
        os._exit(1)  # the group is broken: leave without waiting on it
    if dist.is_initialized():
        dist.destroy_process_group()


def run_commands(state, receive) -> None:
    """Run rank 0's commands on this rank until it says stop or is gone (receive() raises EOFError or
    OSError). A ValueError (bad input, raised on every rank alike) only skips the command."""
    while True:
        try:
            message = receive()
        except (EOFError, OSError):  # rank 0 is gone
            return
        if message[0] == STOP:
            return
        try:
            COMMANDS[message[0]].run(state, *message[1:])
        except ValueError:
            continue  # rank 0 reports it


class BroadcastRanks:
    """Rank 0's side of a torchrun job it leads (`ringctx serve` under torchrun): the other ranks run
    `run_commands` over `receive_broadcast`, as spawned workers do over their pipes.

    Commands travel over a gloo group of their own whose timeout is COMMAND_WAIT: an idle server
    leaves its followers waiting for the next command far longer than any step may take (the world
    group keeps the engine's step timeout). A follower whose rank 0 is gone sees the connection
    close. Messages are JSON (ints, strings; bytes as base64): nothing is unpickled."""

    processes: list = []  # no local processes to watch: torchrun's agent watches the ranks
    watch = None

    def __init__(self, group, world: int):
        self.group, self.nproc = group, world

    def send(self, command: Command, fields: tuple, to_rank) -> None:
        """Send `command` to every follower (those to_rank leaves out skip it: a broadcast reaches all)."""
        concerned = [r for r in range(1, self.nproc) if to_rank(r)]
        _broadcast_message(self.group, [command.name, concerned, *fields])

    def stop(self, *, graceful: bool) -> None:
        if graceful:
            try:
                _broadcast_message(self.group, [STOP, list(range(1, self.nproc))])
            except Exception:
                pass


COMMAND_WAIT = datetime.timedelta(days=30)
"""How long a follower of a served torchrun job waits for rank 0's next command."""


def command_group():
    """The gloo group rank 0's commands travel over (collective: every rank calls it together)."""
    return dist.new_group(backend="gloo", timeout=COMMAND_WAIT)


def receive_broadcast(group, rank: int):
    """A follower's receive(): the next command of rank 0 that concerns this rank, as a tuple."""
    def receive():
        while True:
            message = _receive_message(group)
            name, concerned, *fields = message
            if rank in concerned:
                return (name, *fields)
    return receive


def _broadcast_message(group, message: list) -> None:
    payload = json.dumps([_encode(x) for x in message]).encode()
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)


def _receive_message(group) -> list:
    size = torch.zeros(1, dtype=torch.int64)
    try:
        dist.broadcast(size, src=0, group=group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=group)
    except RuntimeError as exc:  # gloo: the connection to rank 0 closed
        raise EOFError(f"rank 0 is gone: {first_line(exc)}") from None
    return [_decode(x) for x in json.loads(payload.numpy().tobytes())]


def _encode(x):
    if isinstance(x, (bytes, bytearray)):
        return {"b64": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, (list, tuple)):
        return {"list": [_encode(v) for v in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"a command field of type {type(x).__name__} cannot be sent (ints, strings, bytes only)")


def _decode(x):
    if isinstance(x, dict):
        return base64.b64decode(x["b64"]) if "b64" in x else [_decode(v) for v in x["list"]]
    return x


def check_main_guard(nproc: int) -> None:
    """Refuse to spawn from a script's unguarded top level, which every spawned rank would run again.

    Python's "spawn" start method (the only one safe with threads and GPUs) starts each rank by
    importing the main script; an Engine made at its top level then tries to spawn ranks of its
    own inside the new rank, which fails, and the job would end with only "rank 1 exited during
    start-up". The line that made the Engine is found in the script's outermost frame.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if spec is not None and (spec.name == "__main__" or spec.name.endswith(".__main__")):
        return  # `python -m package`: spawn does not run a package's __main__ again
    if not path or not os.path.isfile(path):
        return  # an interactive session or `python -c`: nothing is run again
    frame, line = sys._getframe(1), None
    while frame is not None:  # the outermost frame running the script's top level
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None or _under_main_guard(path, line):
        return
    raise RuntimeError(
        f"{path}, line {line}: an Engine with nproc={nproc} is made at the script's top level, which every spawned "
        f"rank runs again when it starts; put the code that makes the Engine under `if __name__ == \"__main__\":` "
        f"(see the README's Python example)")


def _under_main_guard(path: str, line: int) -> bool:
    """Whether `line` of the script lies inside an `if __name__ == "__main__":` block."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return True  # cannot tell: do not stand in the way
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            first, last = node.body[0].lineno, max(getattr(n, "end_lineno", n.lineno) for n in node.body)
            if first <= line <= last:
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(values) == 1
