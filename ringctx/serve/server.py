"""Running `ringctx serve`: the backend's ranks up, the app on uvicorn, a clean or a loud end.

    listen_socket(host, port)   bound first (port 0: the OS picks), so a taken port fails before any rank starts
    run_server(backend, sock, ...)
        prints "ringctx serve: listening on http://H:P"
        serves until Ctrl-C / SIGTERM (uvicorn's graceful shutdown: answers in flight finish, up to
        drain_s), or until a rank is lost (then in-flight requests end with 503 naming it)
        closes the backend (every rank stops) and returns the exit status: 0, or 1 after a lost rank

A lost rank ends the server on purpose: the engine cannot serve on without it, and a supervisor
(systemd, Kubernetes) restarts a process that exits non-zero; the store keeps every saved document.
"""

from __future__ import annotations

import signal
import socket
import threading

import uvicorn

from .app import create_app
from .protocol import Limits

HEALTH_POLL_S = 0.5
"""How often the server looks for a lost rank (a dead process, or a rank that stopped answering)."""
LOST_RANK_GRACE_S = 2.0
"""After a rank is lost, how long requests in flight have to receive their 503 before the server stops."""


def run_server(backend, sock: socket.socket, *, api_key: str | None = None, limits: Limits | None = None,
               drain_s: float = 30.0, log=print) -> int:
    """Serve `backend` on the listening `sock` until stopped; returns the exit status (backend closed)."""
    app = create_app(backend, api_key=api_key, limits=limits, log=log)
    bound_host, bound_port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=int(drain_s) or 1,
                            lifespan="off")
    server = uvicorn.Server(config)
    lost = threading.Event()
    watcher = threading.Thread(target=_watch, args=(backend, server, lost, log), daemon=True, name="ringctx-health")
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    log(f"ringctx serve: listening on http://{url_host}:{bound_port} (model {backend.model_id})")
    watcher.start()
    # uvicorn catches SIGINT/SIGTERM for its graceful shutdown, then re-raises the signal with the
    # handler it found: with Python's defaults that would kill the process before the ranks stop.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if in_main_thread else {}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        log("ringctx serve: stopping every rank")
        try:
            backend.close(drain_s=0.0 if lost.is_set() else min(drain_s, 5.0))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 1 if lost.is_set() else 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); a clear error when it is taken or not an address here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port (0: any free "
                      f"one) or a --host of this machine") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _watch(backend, server: uvicorn.Server, lost: threading.Event, log) -> None:
    """Stop the server once a rank is lost (after the requests in flight had their 503)."""
    while not server.should_exit:
        stats = backend.stats()
        if not stats.healthy:
            log(f"ringctx serve: {stats.problem}; stopping (exit status 1)")
            lost.set()
            if not _sleep_unless_exiting(server, LOST_RANK_GRACE_S):
                server.should_exit = True
            return
        _sleep_unless_exiting(server, HEALTH_POLL_S)


def _sleep_unless_exiting(server: uvicorn.Server, seconds: float) -> bool:
    """Sleep up to `seconds`; True when the server began exiting meanwhile."""
    event = threading.Event()
    steps = max(1, int(seconds / 0.05))
    for _ in range(steps):
        if server.should_exit:
            return True
        event.wait(seconds / steps)
    return server.should_exit
