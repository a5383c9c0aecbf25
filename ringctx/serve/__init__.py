"""`ringctx serve`: an OpenAI-compatible HTTP server over an Engine that keeps documents prefilled.

    backend.py   what the HTTP layer needs of the engine side (errors, requests, events, documents)
    service.py   EngineBackend: the engine side (documents in a store, KV in the decode ranks' memory)
    store.py     the document store on disk (JSON records, KV directories; no pickle)
    protocol.py  the OpenAI wire format (request models, response bodies, error objects)
    app.py       the FastAPI app (auth, limits, routes, streaming)
    metrics.py   /metrics (prometheus_client)
    server.py    uvicorn: the socket, signals, a lost rank -> exit status 1

From Python: `ringctx.serve.serve(store_dir="docs", port=8000)` (blocks; returns the exit status).
"""

from __future__ import annotations


def serve(*, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, limits=None,
          drain_s: float = 30.0, log=print, **backend_options) -> int:
    """Serve until Ctrl-C / SIGTERM (or a lost rank); returns the exit status (0, or 1 after a lost rank).

    backend_options: those of EngineBackend: the engine's `config` (an EngineConfig, default
    SERVING) or its fields by name (model, nproc, tp, decode_ranks, kv_dtype, dtype, weights,
    timeout_s, chunk_tokens, ...), and the server's own (store_dir, kv_budget_bytes, max_queue,
    max_document_tokens, max_batch, max_step_tokens, ingest_share, join_share,
    prefix_cache_disk_bytes). Under torchrun call
    it on every rank: rank 0 serves, the others follow it until it stops."""
    from .server import listen_socket, run_server
    from .service import EngineBackend, is_server_rank

    sock = listen_socket(host, port) if is_server_rank() else None
    try:
        backend = EngineBackend(log=log, **backend_options)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if not backend.is_server_rank:
        return backend.follow()
    return run_server(backend, sock, api_key=api_key, limits=limits, drain_s=drain_s, log=log)
