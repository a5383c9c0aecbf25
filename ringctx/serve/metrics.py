"""`/metrics` of `ringctx serve`, in Prometheus' text format through prometheus_client.

Per app, one registry (tests run several apps in one process): histograms of time to first token
and inter-token time, requests by endpoint and status, and what the backend's stats say when
scraped (queue depth, documents by status, KV bytes per decode rank, the batch and its step budget,
prefill tokens and speed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
"""Seconds: a decode step is 5-100 ms; a first token behind a queue or a long prompt can take minutes."""

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models",
             "/health": "health", "/metrics": "metrics"}


class ServeMetrics:
    """The metrics of one app over one backend."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, backend):
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "ringctx_time_to_first_token_seconds", "Seconds from a request's arrival to its first answer token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram(
            "ringctx_inter_token_seconds", "Seconds between two answer tokens of one request",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("ringctx_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.registry.register(_BackendCollector(backend))

    @staticmethod
    def endpoint(path: str) -> str:
        """A bounded label for a path (document ids are not labels)."""
        if path.startswith("/v1/documents"):
            return "documents"
        return ENDPOINTS.get(path, "other")

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BackendCollector:
    """The backend's numbers, read when /metrics is scraped."""

    def __init__(self, backend):
        self.backend = backend

    def collect(self):
        stats = self.backend.stats()
        yield GaugeMetricFamily("ringctx_healthy", "1 when every rank is up", value=int(stats.healthy))
        yield GaugeMetricFamily("ringctx_ranks", "Ranks of the engine", value=stats.ranks)
        yield GaugeMetricFamily("ringctx_queue_depth", "Answers waiting for their turn", value=stats.queue_depth)
        yield GaugeMetricFamily("ringctx_running", "Answers being produced", value=stats.running)
        documents = GaugeMetricFamily("ringctx_documents", "Documents by status", labels=["status"])
        for status in ("ingesting", "ready", "on_disk", "failed"):
            documents.add_metric([status], stats.documents_by_status.get(status, 0))
        yield documents
        kv = GaugeMetricFamily("ringctx_kv_bytes", "Bytes of document KV cache held in memory, per decode rank",
                               labels=["decode_rank"])
        for rank, held in enumerate(stats.kv_bytes_per_rank):
            kv.add_metric([str(rank)], held)
        yield kv
        yield GaugeMetricFamily("ringctx_kv_budget_bytes", "Bytes of KV cache the decode ranks may keep",
                                value=stats.kv_budget_bytes)
        yield GaugeMetricFamily("ringctx_batch_size", "Questions decoding together (one step runs them all)",
                                value=stats.batch_size)
        yield GaugeMetricFamily("ringctx_max_batch", "Questions that may decode together (--max-batch)",
                                value=stats.max_batch)
        yield GaugeMetricFamily("ringctx_max_step_tokens", "Tokens one step may run: decode tokens plus prompt "
                                "tokens prefilled (--max-step-tokens)", value=stats.max_step_tokens)
        yield GaugeMetricFamily("ringctx_step_tokens", "Tokens the last step ran", value=stats.step_tokens)
        yield GaugeMetricFamily("ringctx_ingest_slice_layers", "Layers of an ingest's chunk the last step ran beside "
                                "the answers decoding (0: none)", value=stats.slice_layers)
        yield GaugeMetricFamily("ringctx_ingest_share", "Decode steps a slice of an ingest beside answers takes "
                                "(--ingest-share)", value=stats.ingest_share)
        yield GaugeMetricFamily("ringctx_join_share", "Decode steps the questions joining in one step beside answers "
                                "take (--join-share)", value=stats.join_share)
        yield GaugeMetricFamily("ringctx_step_joins", "Questions that joined in the last step", value=stats.step_joins)
        yield CounterMetricFamily("ringctx_joins_held", "Steps in which a question waited for the next one because "
                                  "of --join-share", value=stats.joins_held)
        yield GaugeMetricFamily("ringctx_answer_rows", "KV rows the running questions may hold (prompts and "
                                "max_tokens)", value=stats.answer_rows)
        yield GaugeMetricFamily("ringctx_max_answer_rows", "KV rows of running questions beyond which new ones wait",
                                value=stats.max_answer_rows)
        yield CounterMetricFamily("ringctx_decode_steps", "Batched decode steps since start", value=stats.decode_steps)
        yield CounterMetricFamily("ringctx_decoded_tokens", "Tokens the batched decode steps decoded (over "
                                  "ringctx_decode_steps: the mean batch)", value=stats.decoded_tokens)
        yield CounterMetricFamily("ringctx_decode_step_seconds", "Seconds the batched decode steps took in the "
                                  "engine (over ringctx_decode_steps: the mean step)", value=stats.decode_seconds)
        yield CounterMetricFamily("ringctx_prefill_tokens", "Tokens prefilled since start", value=stats.prefill_tokens)
        yield GaugeMetricFamily("ringctx_prefill_tokens_per_second", "Tokens prefilled per second of prefill",
                                value=stats.prefill_tokens / stats.prefill_seconds if stats.prefill_seconds else 0.0)
        yield CounterMetricFamily("ringctx_document_chunks_prefilled", "Document chunks prefilled since start",
                                  value=stats.document_chunks_prefilled)
        cache = stats.prefix_cache
        if cache is None:
            return
        yield CounterMetricFamily("ringctx_prefix_cache_lookups", "Prompts looked up in the prefix cache",
                                  value=cache.lookups)
        yield CounterMetricFamily("ringctx_prefix_cache_hits", "Prompts that began with a cached prompt",
                                  value=cache.hits)
        yield CounterMetricFamily("ringctx_prefix_cache_tokens_reused", "Prompt tokens whose KV came from the "
                                  "prefix cache (not prefilled)", value=cache.tokens_reused)
        yield CounterMetricFamily("ringctx_prefix_cache_prompt_tokens", "Prompt tokens looked up (over them: the "
                                  "share reused)", value=cache.prompt_tokens)
        yield CounterMetricFamily("ringctx_prefix_cache_partial_hits", "Hits on part of a cached prompt (a view "
                                  "of its first tokens, nothing copied)", value=cache.partial_hits)
        yield CounterMetricFamily("ringctx_prefix_cache_tails_joined", "Kept turns joined to their prompt's rows "
                                  "because a next turn reached into them (one copy each)", value=cache.tails_joined)
        yield CounterMetricFamily("ringctx_prefix_cache_cuts", "Conversations' cached prompts cut back in place to "
                                  "where their next turn parted (an answer retold as text)", value=cache.cuts)
        yield CounterMetricFamily("ringctx_prefix_cache_loads", "Entries loaded back from disk",
                                  value=cache.loaded_from_disk)
        evictions = CounterMetricFamily("ringctx_prefix_cache_evictions", "Entries that left memory, by where "
                                        "they went", labels=["to"])
        evictions.add_metric(["disk"], cache.evicted_to_disk)
        evictions.add_metric(["dropped"], cache.evicted_dropped)
        yield evictions
        yield CounterMetricFamily("ringctx_prefix_cache_not_kept", "Prompts not kept (larger than the budget, or "
                                  "their rows could not be kept)", value=cache.not_kept)
        entries = GaugeMetricFamily("ringctx_prefix_cache_entries", "Cached prompts by place", labels=["place"])
        entries.add_metric(["memory"], cache.entries_in_memory)
        entries.add_metric(["disk"], cache.entries_on_disk)
        yield entries
        held = GaugeMetricFamily("ringctx_prefix_cache_bytes", "Bytes of cached prompts by place", labels=["place"])
        held.add_metric(["memory"], cache.bytes_in_memory)
        held.add_metric(["disk"], cache.bytes_on_disk)
        yield held
        budget = GaugeMetricFamily("ringctx_prefix_cache_budget_bytes", "Bytes the cached prompts may take by place",
                                   labels=["place"])
        budget.add_metric(["memory"], cache.budget_bytes)
        budget.add_metric(["disk"], cache.disk_budget_bytes)
        yield budget
