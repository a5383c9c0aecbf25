"""Two emulated hosts on one machine: Linux network namespaces joined by a veth pair.

Each "host" is a network namespace with its own interface and address (10.231.0.1/24 and
10.231.0.2/24, private test addresses that exist only inside the namespaces created here) and its
own loopback. Processes started in a namespace see only its interfaces, so gloo, NCCL and the
rendezvous really go over the veth pair. The names are unique per run and everything is removed
on exit (processes still running in the namespaces are killed first).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.231.0"


class NamespacesUnavailable(RuntimeError):
    """This machine does not let us create network namespaces (the message says why)."""


@dataclass
class Host:
    index: int
    netns: str
    iface: str
    addr: str

    def popen(self, argv: list[str], *, cwd, env=None, **kwargs) -> subprocess.Popen:
        """Start argv inside this host's namespace (its own process group, for clean-up)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], cwd=cwd, env=env,
                                start_new_session=True, **kwargs)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise NamespacesUnavailable(
            f"network namespaces are not permitted on this machine: `{what}` failed with "
            f"{result.stderr.strip() or result.returncode}. The multi-host tests emulate two hosts with "
            "`ip netns` and a veth pair; run them as root (CAP_SYS_ADMIN and CAP_NET_ADMIN), e.g. in CI's container")


@contextmanager
def two_hosts():
    """Yield [host0, host1]; tear the namespaces down afterwards, whatever happens."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("the `ip` command (iproute2) is missing: apt-get install -y iproute2 "
                                    "(.ci/run installs it); the multi-host tests need it to emulate two hosts")
    tag = uuid.uuid4().hex[:6]
    names = [f"rcx{tag}h{i}" for i in range(2)]
    ifaces = [f"rcx{tag}v{i}" for i in range(2)]
    created: list[str] = []
    try:
        for name in names:
            _check(_ip("netns", "add", name), f"ip netns add {name}")
            created.append(name)
        _check(_ip("link", "add", ifaces[0], "type", "veth", "peer", "name", ifaces[1]),
               f"ip link add {ifaces[0]} type veth peer name {ifaces[1]}")
        hosts = []
        for i, (name, iface) in enumerate(zip(names, ifaces)):
            addr = f"{SUBNET}.{i + 1}"
            for args in (("link", "set", iface, "netns", name),
                         ("-n", name, "addr", "add", f"{addr}/24", "dev", iface),
                         ("-n", name, "link", "set", iface, "up"),
                         ("-n", name, "link", "set", "lo", "up")):
                _check(_ip(*args), "ip " + " ".join(args))
            hosts.append(Host(i, name, iface, addr))
        yield hosts
    finally:
        for name in created:
            pids = _ip("netns", "pids", name).stdout.split()
            for pid in pids:  # only processes inside the namespaces this context created
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            if pids:
                time.sleep(0.2)
            _ip("netns", "del", name)
        _ip("link", "del", ifaces[0])  # only there when setting up failed half-way; deleting a netns removes it
