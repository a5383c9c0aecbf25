"""`ringctx serve`: the OpenAI-compatible server (ringctx/serve), from the command line."""

from __future__ import annotations

import sys

import click

from ..attention.quant import KV_DTYPES
from ..planning.engine_config import SERVING, field_help
from .options import (DECODE_RANKS_OPTION, EP_OPTION, MODEL_OPTION, ROPE_SCALING_OPTION, TIMEOUT_OPTION,
                      TP_OPTION, WEIGHTS_OPTION, _rank_error, nproc_option)


class _Bytes(click.ParamType):
    """A size: 8GiB, 512MiB, 1.5G or a number of bytes."""

    name = "BYTES"

    def convert(self, value, param, ctx):
        from ..runtime.memory_check import parse_bytes

        if isinstance(value, int):
            return value
        try:
            return parse_bytes(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size: write e.g. 8GiB, 512MiB or a number of bytes", param, ctx)


def _log(line: str) -> None:
    print(line, flush=True)


@click.command()
@MODEL_OPTION
@nproc_option("auto", serving=True)
@TP_OPTION
@EP_OPTION
@DECODE_RANKS_OPTION
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="model", show_default=True,
              help="KV cache storage of the documents (fp8/int8: 8 bits per value, half the memory of bf16).")
@click.option("--dtype", default="auto", show_default=True, help="auto, bfloat16, float16 or float32.")
@WEIGHTS_OPTION
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; give --api-key then).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@click.option("--api-key", envvar="RINGCTX_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health [env: RINGCTX_API_KEY].")
@click.option("--store", "store_dir", default="ringctx-store", show_default=True, type=click.Path(file_okay=False),
              help="Directory of the documents (records and KV caches); a restarted server answers from it.")
@click.option("--kv-budget", "kv_budget", type=_Bytes(), default=None,
              help="KV bytes the decode ranks keep in memory [default: half the memory free after loading]; "
                   "beyond it the least recently used documents wait on disk.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Answers that may wait for their turn; more get 429 with Retry-After.")
@click.option("--max-body-bytes", type=_Bytes(), default="64MiB", show_default=True,
              help="Largest request body (document uploads included): 413 past it.")
@click.option("--max-tokens", "max_tokens_limit", default=4096, show_default=True, type=click.IntRange(1),
              help="Largest max_tokens a request may ask for.")
@click.option("--max-document-tokens", type=click.IntRange(1), default=None,
              help="Longest document accepted [default: what the KV budget holds].")
@click.option("--chunk-tokens", type=click.IntRange(1), default=None,
              help="Tokens per chunk of a document's ingest and of a question's own long prompt (default: the "
                   "engine's, from the model's size, for documents, run in slices of whole layers so that no "
                   "answer waits a whole chunk; at most 512 on CPUs for a prompt). One layer of a chunk is the "
                   "longest pause an ingest puts between two tokens of an answer in flight.")
@click.option("--max-batch", default=16, show_default=True, type=click.IntRange(1),
              help="Questions decoded together at most: one step runs every one of them, each document's KV "
                   "read once for all its questions.")
@click.option("--max-step-tokens", type=click.IntRange(1), default=None,
              help="Tokens one step may run: one per question decoding plus the prompt tokens it prefills "
                   "(questions joining; an ingest's chunk when none decodes); bounds the questions' prefill "
                   "work between two tokens of an answer [default: one prefill chunk plus --max-batch].")
@click.option("--ingest-share", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Beside answers in flight an ingest runs whole layers of its chunk in each step, about this "
                   "many decode steps' worth: 1.0 keeps their inter-token time near 2x its time without the "
                   "ingest; lower favours the answers, higher the ingest.")
@click.option("--join-share", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Beside answers in flight the questions joining in one step (each a prefill over its "
                   "document) take about this many decode steps, at least one question: a burst of questions "
                   "joins over several steps instead of pausing the answers for all of them.")
@click.option("--prefix-cache/--no-prefix-cache", default=SERVING.prefix_cache, show_default=True,
              help=field_help()["prefix_cache"] + " Any client: the tokens are what is matched, not a document id.")
@click.option("--prefix-cache-min-tokens", default=SERVING.prefix_cache_min_tokens, show_default=True,
              type=click.IntRange(1), help=field_help()["prefix_cache_min_tokens"])
@click.option("--prefix-cache-share", default=SERVING.prefix_cache_share, show_default=True,
              type=click.FloatRange(min=0, max=1, min_open=True), help=field_help()["prefix_cache_share"])
@click.option("--prefix-cache-disk", "prefix_cache_disk", type=_Bytes(), default=None,
              help="Bytes the kept prompts may take in --store/prefix-cache once they leave memory [default: 4x "
                   "their memory budget; 0: none are saved].")
@click.option("--drain", "drain_s", default=30.0, show_default=True,
              help="Seconds answers in flight may take to finish on Ctrl-C or SIGTERM.")
@TIMEOUT_OPTION
@ROPE_SCALING_OPTION
@click.option("--allow-long-context", "allow_long_context", is_flag=True, default=SERVING.allow_long_context,
              help=field_help()["allow_long_context"] + " Without it a request past the trained context (its prompt "
                   "and max_tokens, as vLLM counts them) gets 400 with code context_length_exceeded.")
def serve(model, nproc, tp, ep, decode_ranks, kv_dtype, dtype, weights, host, port, api_key, store_dir, kv_budget, max_queue,
          max_body_bytes, max_tokens_limit, max_document_tokens, chunk_tokens, max_batch, max_step_tokens, ingest_share,
          join_share, prefix_cache, prefix_cache_min_tokens, prefix_cache_share, prefix_cache_disk, drain_s, timeout_s,
          rope_scaling, allow_long_context):
    """Serve the OpenAI API over documents kept prefilled across the ranks (see the README)."""
    from ..runtime.failures import RankFailure
    from ..serve.protocol import Limits
    from ..serve import serve as serve_forever

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        _log(f"ringctx serve: warning: listening on {host} without --api-key: anyone who reaches it can use it")
    try:
        status = serve_forever(host=host, port=port, api_key=api_key, drain_s=drain_s, log=_log,
                               limits=Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens_limit),
                               config=SERVING.replace(model=model, nproc=nproc, tp=tp, ep=ep, decode_ranks=decode_ranks,
                                                      kv_dtype=kv_dtype, dtype=dtype, weights=weights,
                                                      timeout_s=timeout_s, chunk_tokens=chunk_tokens,
                                                      prefix_cache=prefix_cache,
                                                      prefix_cache_min_tokens=prefix_cache_min_tokens,
                                                      prefix_cache_share=prefix_cache_share,
                                                      rope_scaling=rope_scaling,
                                                      allow_long_context=allow_long_context),
                               store_dir=store_dir, kv_budget_bytes=kv_budget, max_queue=max_queue,
                               max_document_tokens=max_document_tokens, max_batch=max_batch, max_step_tokens=max_step_tokens,
                               ingest_share=ingest_share, join_share=join_share,
                               prefix_cache_disk_bytes=prefix_cache_disk)
    except (ValueError, OSError, RankFailure) as exc:
        raise _rank_error(exc) from None
    sys.exit(status)
