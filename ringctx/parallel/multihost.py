"""Launch ringctx on several hosts with torchrun, and end a failed launch with one clear line.

Run the same command on every host (scripts/launch_multihost.sh is this module):

    python -m ringctx.parallel.multihost --hosts 10.0.0.1,10.0.0.2 --nproc-per-host 2 --iface eth0 \\
        -- prefill --tokens 1000000 --json out.json

It builds the torchrun command (rendezvous, node rank, local address, timeouts), sets the
network interface for gloo and NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) and the CPU threads
per rank, and runs torchrun in this process. A rendezvous that does not complete in time, an
endpoint nobody listens on, or a rank that fails ends with one line that says what happened and
what to check, and a non-zero exit status. `--dry-run` prints the command instead.

Host 0 runs ranks 0..K-1, and rank 0 is the decode rank (the KV hand-off crosses hosts to it):
with --hosts, host 0 is the first host of the list (static rendezvous at it); with
--rdzv-endpoint (c10d rendezvous), torchrun numbers the hosts by their address (--local-addr,
taken from --iface), the smallest first.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import socket
import sys

EXIT_RENDEZVOUS = 3
"""Exit status when the hosts never formed the job (rendezvous timeout or unreachable endpoint)."""

EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_multihost.sh",
        description="Run a ringctx command (prefill, ingest, calibrate, ...) on several hosts with torchrun. "
                    "Run the same command on every host.",
        epilog="Example: launch_multihost.sh --hosts 10.0.0.1,10.0.0.2 --nproc-per-host 2 --iface eth0 -- "
               "prefill --tokens 1000000 --json out.json")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", help="every host of the job, comma-separated, host 0 first (static rendezvous "
                                       "at host 0); this host finds its place by its addresses or --node-rank")
    where.add_argument("--rdzv-endpoint", help="HOST:PORT of a c10d rendezvous instead (needs --nnodes)")
    p.add_argument("--nnodes", type=int, help="number of hosts (default: the length of --hosts)")
    p.add_argument("--nproc-per-host", type=int, default=1, help="ranks on each host (default 1; one per GPU)")
    p.add_argument("--iface", help="network interface for gloo/NCCL traffic (sets GLOO_SOCKET_IFNAME and "
                                   "NCCL_SOCKET_IFNAME; its IPv4 address becomes this host's --local-addr)")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port with --hosts (default 29400)")
    p.add_argument("--node-rank", type=int, help="this host's index in --hosts (default: from its addresses)")
    p.add_argument("--local-addr", help="this host's address as the others reach it (default: from --iface)")
    p.add_argument("--rdzv-timeout", type=float, default=300.0,
                   help="seconds to wait for every host to join (default 300)")
    p.add_argument("--run-id", default="ringctx", help="rendezvous id; distinct jobs on one endpoint need distinct "
                                                       "ids (default ringctx)")
    p.add_argument("--threads", type=int, help="CPU threads per rank (default: cores / ranks per host)")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print the environment and torchrun command; run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the ringctx command and its options, after --")
    return p


class LaunchError(ValueError):
    """A launch that cannot work as asked (bad host list, unknown interface, ...)."""


def local_addresses() -> dict[str, list[str]]:
    """IPv4 addresses of this host (this network namespace) by interface."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [a.address for a in addrs if a.family == socket.AF_INET]
    return out


def resolve(host: str) -> set[str]:
    """IPv4 addresses of a host name or address ('' when it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except socket.gaierror:
        return set()


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: write HOST:PORT, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def wait_for_endpoint(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to host:port opens within `timeout` seconds (host 0 may start later)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def build(args) -> tuple[list[str], dict[str, str], str, tuple[str, int] | None]:
    """(torchrun arguments, environment additions, a description, the endpoint to wait for or None)
    for this host."""
    if not args.command:
        raise LaunchError("no ringctx command given: add e.g. `-- prefill --tokens 100000` after the launcher options")
    command = args.command[1:] if args.command[0] == "--" else args.command
    if args.nproc_per_host < 1:
        raise LaunchError(f"--nproc-per-host must be >= 1, got {args.nproc_per_host}")
    if args.rdzv_timeout <= 0:
        raise LaunchError(f"--rdzv-timeout must be > 0 seconds, got {args.rdzv_timeout}")
    mine = local_addresses()
    if args.iface and args.iface not in mine:
        raise LaunchError(f"--iface {args.iface}: no such network interface here (this host has "
                          f"{', '.join(sorted(mine))})")
    local_addr = args.local_addr
    if local_addr is None and args.iface:
        if not mine[args.iface]:
            raise LaunchError(f"--iface {args.iface} has no IPv4 address; give --local-addr")
        local_addr = mine[args.iface][0]
    my_ips = {a for addrs in mine.values() for a in addrs}
    timeout = int(max(1, round(args.rdzv_timeout)))
    torchrun = ["--nproc-per-node", str(args.nproc_per_host), "--max-restarts", "0", "--rdzv-id", args.run_id]
    if args.hosts:
        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        if len(hosts) < 1:
            raise LaunchError("--hosts is empty: list every host, host 0 first")
        nnodes = args.nnodes or len(hosts)
        if nnodes != len(hosts):
            raise LaunchError(f"--nnodes {nnodes} but --hosts lists {len(hosts)} hosts")
        node_rank = args.node_rank
        if node_rank is None:
            matches = [i for i, h in enumerate(hosts) if resolve(h) & my_ips]
            if len(matches) != 1:
                raise LaunchError(f"cannot tell which of --hosts {','.join(hosts)} this host is (its addresses: "
                                  f"{', '.join(sorted(my_ips))}); give --node-rank")
            node_rank = matches[0]
        if not 0 <= node_rank < nnodes:
            raise LaunchError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
        if local_addr is None and resolve(hosts[node_rank]) & my_ips:
            local_addr = sorted(resolve(hosts[node_rank]) & my_ips)[0]
        torchrun += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                     "--master-addr", hosts[0], "--master-port", str(args.port), "--rdzv-conf", f"timeout={timeout}"]
        endpoint = f"{hosts[0]}:{args.port}"
        what = f"host {node_rank} of {nnodes}"
        wait_for = (hosts[0], args.port) if node_rank != 0 else None
    else:
        if not args.nnodes:
            raise LaunchError("--rdzv-endpoint needs --nnodes (the number of hosts)")
        host, port = split_endpoint(args.rdzv_endpoint)
        conf = [f"join_timeout={timeout}", f"read_timeout={timeout}"]
        ips = resolve(host)
        wait_for = (host, port)
        if ips & my_ips and not any(ipaddress.ip_address(ip).is_loopback for ip in ips):
            conf.append("is_host=1")  # torchrun's own guess misses addresses of secondary interfaces
            wait_for = None
        elif any(ipaddress.ip_address(ip).is_loopback for ip in ips):
            wait_for = None  # one machine: whichever launcher comes first hosts the rendezvous
        torchrun += ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                     "--rdzv-conf", ",".join(conf)]
        endpoint = f"{host}:{port}"
        what = f"one of {args.nnodes} hosts"
    if local_addr:
        torchrun += ["--local-addr", local_addr]
    torchrun += ["-m", "ringctx", *command]
    env = {}
    if args.iface:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = args.iface
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or \
        max(1, (os.cpu_count() or 1) // args.nproc_per_host)
    env["OMP_NUM_THREADS"] = str(threads)
    return torchrun, env, f"{what}, {args.nproc_per_host} rank(s) each, rendezvous {endpoint}", wait_for


def _say(text: str) -> None:
    print(f"launch_multihost: {text}", file=sys.stderr, flush=True)


def _describe_child_failure(exc) -> str:
    from .launch import describe_exit

    try:
        rank, failure = exc.get_first_failure()
    except Exception:
        return "a rank failed (see its error above)"
    others = sorted(r for r in exc.failures if r != rank)
    text = (f"rank {rank} (local rank {failure.local_rank} on this host, pid {failure.pid}) "
            f"{describe_exit(failure.exitcode)}; ")
    if others:
        text += f"rank(s) {', '.join(map(str, others))} of this host stopped too; "
    return text + "its own error, if it printed one, is above"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        torchrun, env, what, wait_for = build(args)
    except LaunchError as exc:
        _say(f"error: {exc}")
        return 2
    endpoint = args.rdzv_endpoint or f"{args.hosts.split(',')[0].strip()}:{args.port}"
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.quote(args.python),
              "-m torch.distributed.run", " ".join(shlex.quote(a) for a in torchrun))
        return 0
    os.environ.update(env)
    _say(f"{what}; waiting up to {args.rdzv_timeout:g} s for every host to join")
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError, RendezvousConnectionError, RendezvousTimeoutError,
    )
    from torch.distributed.run import main as torchrun_main

    host = endpoint.rpartition(":")[0]
    port = endpoint.rpartition(":")[2]
    check = (f"start the same command on every host (same --hosts or --rdzv-endpoint, --nnodes and --run-id) and "
             f"check that TCP port {port} on {host} is reachable from every host")
    if wait_for is not None and not wait_for_endpoint(*wait_for, args.rdzv_timeout):
        _say(f"error: cannot reach the rendezvous at {endpoint} within {args.rdzv_timeout:g} s: host 0 has not "
             f"started (run the same command there) or the port is blocked; {check}")
        return EXIT_RENDEZVOUS
    try:
        torchrun_main(torchrun)
    except ChildFailedError as exc:
        _say(f"error: {_describe_child_failure(exc)}")
        return 1
    except RendezvousTimeoutError:
        _say(f"error: the rendezvous at {endpoint} did not complete within {args.rdzv_timeout:g} s: not every host "
             f"joined; {check}")
        return EXIT_RENDEZVOUS
    except (RendezvousConnectionError, RendezvousClosedError, DistError, TimeoutError, ConnectionError) as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        _say(f"error: the rendezvous at {endpoint} failed ({type(exc).__name__}: {line}); {check}")
        return EXIT_RENDEZVOUS
    except (KeyboardInterrupt, SignalException):
        _say("interrupted: this host's ranks were stopped")
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
