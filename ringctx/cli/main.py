"""The `ringctx` command line: parse options, call the Python API, render with rich.

No logic lives here that the Python API lacks. Under torchrun every rank runs the same command;
only the decode rank prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import click

from ..units import fmt_bytes
from rich.console import Console
from rich.table import Table

from ..planning.hardware import MEASURED, shown_source
from .options import (COMMAND_LINE, DECODE_RANKS_OPTION, EP_OPTION, TIMEOUT_OPTION, TP_OPTION, _AgreedBadParameter,
                      ALLOW_LONG_CONTEXT_OPTION, _AgreedError, _rank_error, build_engine,
                      engine_options, nproc_option, rope_scaling_option, warnings_as_lines)
from .progress import prefill_progress, work_bar

console = Console()
err_console = Console(stderr=True)

DEFAULT_PREFILL_TOKENS = 12288  # about a minute with the embedded model on 2 ranks of a 2-core CPU
DEFAULT_FOLLOW_UP_TOKENS = 48   # a question's length: on a CPU pair of ranks, pass-Q's case
DEFAULT_DECODE_TOKENS = 16      # decode steps timed against the memory floor: a fraction of a second


class _Group(click.Group):
    """Ctrl-C ends every command with one line and exit status 130 (the engine has already stopped
    its local ranks by then: see Engine.prefill); the long-context warning is one line."""

    def invoke(self, ctx):
        try:
            with warnings_as_lines(err_console):
                return super().invoke(ctx)
        except KeyboardInterrupt:
            if os.environ.get("LOCAL_RANK", "0") == "0":
                err_console.print("ringctx: interrupted; all local ranks stopped")
            raise click.exceptions.Exit(130) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ringctx")
def main() -> None:
    """ringctx: exact context-parallel prefill of very long prompts (ring pass-KV / pass-Q)."""


def _mesh_words(engine) -> str:
    """"2 rank(s)" or "4 ranks (CP 2 x TP 2)"."""
    ep = f", experts over EP {engine.ep_size}" if engine.ep_size > 1 else ""
    if engine.tp_size == 1:
        return f"{engine.world_size} rank(s){ep}"
    return f"{engine.world_size} ranks (CP {engine.cp_size} x TP {engine.tp_size}{ep})"


def _is_printing_rank() -> bool:
    from ..parallel.launch import is_first_rank

    return is_first_rank()


PREDICTION_NOTICE_S = 300.0
"""A run the cost model predicts to take longer than this gets a line in the header saying so."""


def _run_prefill(engine, token_ids, *, show_progress, **kwargs):
    """engine.prefill with a rich progress bar over the chunks' work (printing rank only)."""
    if not show_progress:
        return engine.prefill(token_ids, **kwargs)
    with prefill_progress(err_console) as progress:
        on_chunk = work_bar(progress, engine.model.full_config, engine.chunk_tokens, len(token_ids))
        return engine.prefill(token_ids, on_chunk=on_chunk, **kwargs)


def _duration(seconds: float) -> str:
    """"about 25 min", "about 3.2 h", "about 4.1 days"."""
    if seconds < 3600:
        return f"about {seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"about {seconds / 3600:.1f} h"
    return f"about {seconds / 86400:.1f} days"


def _predicted_seconds(engine, tokens: int, peaks: dict | None = None) -> float | None:
    """The cost model's time to first token of this prefill (as `ringctx plan` predicts it), or
    None when the planner cannot plan it. On an uncalibrated profile that was not measured at
    start-up (the built-in CPU one holds placeholder numbers) `peaks` (measure_peaks: this host's GEMM rate, measured now) stands in
    for its peak FLOP/s, shared by the ranks."""
    from ..planning.prefill_plan import plan_prefill

    hardware, dtype = engine.hardware, str(engine.model.dtype).removeprefix("torch.")
    gemm = (peaks or {}).get("gemm_flops_per_s", {})
    if not hardware.calibrated and hardware.name != MEASURED and gemm:  # a measured profile has its own
        rate = (gemm.get(dtype) or gemm["float32"]) / max(1, engine.cp_size * engine.tp_size)
        hardware = dataclasses.replace(hardware, peak_flops={**hardware.peak_flops, dtype: rate},
                                       linear_flops_per_s={**hardware.linear_flops_per_s, dtype: rate})
    try:
        plan = plan_prefill(engine.model.full_config, engine.cp_size, hardware, tokens, 0, engine.chunk_tokens,
                            tp_size=engine.tp_size, dtype=dtype, rule=engine.rule,
                            kv_dtype=engine.kv_dtype, decode_ranks=engine.decode_ranks, weights=engine.weights)
    except ValueError:
        return None
    return plan.ttft_ms / 1e3


def _short(c) -> str:
    return c.short_reason or c.reason


def stats_tables(stats, title: str, follow_up=None, efficiency=None, hardware=None, kv_bytes_per_token=0) -> list:
    """The summary table and the per-chunk table of a PrefillStats (and of the follow-up prefilled
    on top of it, whose chunks are numbered +0, +1, ...), each chunk with its short reason, then
    the rules' formulas with their constants once (the full reasons are in --json). `efficiency`
    (a RunEfficiency) adds the run's share of this machine's peak; `hardware` (the profile the
    rule decided with) a line saying which it was; kv_bytes_per_token (one token's KV over every
    layer) the decode ranks' kept KV against every row's."""
    summary = Table(title=title, show_header=False)
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    mix = {}
    for c in stats.chunks:
        mix[c.strategy] = mix.get(c.strategy, 0) + 1
    kept = _kept_words(stats, kv_bytes_per_token)
    rows = [
        ("tokens (new / cached before)", f"{stats.tokens:,} / {stats.cached:,}"),
        ("ranks x chunk tokens", f"{stats.world_size} x {stats.chunk_tokens:,}"
         + (f" (CP {stats.cp_size} x TP {stats.tp_size})" if stats.tp_size > 1 else "")),
        ("time to first token", f"{stats.ttft_s:.2f} s (hand-off {stats.handoff_s:.2f} s)"),
        ("prefill throughput", f"{stats.tokens_per_s:,.0f} tokens/s"),
        ("strategy mix (chunks)", ", ".join(f"{k}: {v}" for k, v in mix.items())),
        ("bytes sent per rank", ", ".join(fmt_bytes(b) for b in stats.bytes_sent_per_rank)),
        *([("  of which TP all-reduces per rank", ", ".join(fmt_bytes(b) for b in stats.tp_bytes_per_rank))]
          if stats.tp_size > 1 else []),
        *([("  of which EP all-to-alls per rank", ", ".join(fmt_bytes(b) for b in stats.ep_bytes_per_rank))]
          if any(stats.ep_bytes_per_rank) else []),
        ("KV shard per rank", ", ".join(fmt_bytes(b) for b in stats.kv_shard_bytes_per_rank)
         + ("" if stats.kv_dtype == "model" else f" ({stats.kv_dtype})")),
        ("decode ranks: KV tokens each", ", ".join(f"{n:,}" for n in stats.decode_slice_rows_per_rank if n)
         + f" ({stats.decode_ranks} rank{'s' if stats.decode_ranks > 1 else ''})"),
        *([("  KV kept (of every layer's rows)", kept)] if kept else []),
        ("hand-off sent per rank (across hosts)", ", ".join(
            f"{fmt_bytes(b)} ({fmt_bytes(c)})" for b, c in zip(stats.handoff_bytes_per_rank,
                                                                 stats.handoff_cross_host_bytes_per_rank))),
        ("peak RSS per rank (prefill)", ", ".join(fmt_bytes(b) for b in stats.peak_rss_bytes_per_rank)),
        ("peak RSS per rank (hand-off)", ", ".join(fmt_bytes(b) for b in stats.handoff_peak_rss_bytes_per_rank)),
    ]
    if follow_up is not None:
        follow_mix = ", ".join(sorted({c.strategy for c in follow_up.chunks}))
        rows.append((f"follow-up: {follow_up.tokens:,} tokens on {follow_up.cached:,} cached",
                     f"{follow_up.ttft_s:.2f} s ({follow_mix})"))
        rows.append(("follow-up: bytes sent per rank", ", ".join(fmt_bytes(b) for b in follow_up.bytes_sent_per_rank)))
    if efficiency is not None:
        rows += _efficiency_rows(efficiency)
    for k, v in rows:
        summary.add_row(k, v)
    chunks = Table(title="chunks")
    for col in ("#", "tokens", "cached", "strategy", "seconds", "reason"):
        chunks.add_column(col, justify="right" if col in ("#", "tokens", "cached", "seconds") else "left")
    shown = stats.chunks if len(stats.chunks) <= 24 else stats.chunks[:12] + stats.chunks[-12:]
    for i, c in enumerate(shown):
        if len(stats.chunks) > 24 and i == 12:
            chunks.add_row("...", "", "", "", "", f"({len(stats.chunks) - 24} more chunks)")
        chunks.add_row(str(c.index), f"{c.tokens:,}", f"{c.cached:,}", c.strategy, f"{c.seconds:.2f}", _short(c))
    for c in follow_up.chunks if follow_up is not None else ():
        chunks.add_row(f"+{c.index}", f"{c.tokens:,}", f"{c.cached:,}", c.strategy, f"{c.seconds:.2f}", _short(c))
    every = stats.chunks + (follow_up.chunks if follow_up is not None else [])
    formulas = list(dict.fromkeys(c.formula for c in every if c.formula))
    decided = [f"[dim]the rule decided with {hardware.name}: {shown_source(hardware)}[/dim]"] if hardware else []
    return [summary, chunks, *(f"[dim]{formula}[/dim]" for formula in formulas), *decided]


def _efficiency_rows(e) -> list[tuple[str, str]]:
    """Summary rows of a RunEfficiency: the prefill against the GEMM peak, the decode step against its floor."""
    rows = [("prefill FLOP/s (cost model)", f"{e.prefill_flops_per_s / 1e9:,.1f} GFLOP/s, "
                                            f"{e.prefill_share_of_peak:.0%} of peak"),
            (f"peak: {e.compute_dtype} GEMM, {e.threads} thread{'s' if e.threads > 1 else ''}",
             f"{e.peak_flops_per_s / 1e9:,.1f} GFLOP/s")]
    if e.decode_ms_per_token is not None:
        rows.append(("decode step / memory floor", f"{e.decode_ms_per_token:.1f} / {e.decode_floor_ms:.1f} ms "
                                                   f"({e.decode_share_of_floor:.0%})"))
    return rows


@main.command()
@click.option("--tokens", default=DEFAULT_PREFILL_TOKENS, show_default=True, type=int,
              help="Synthetic prompt length (random token ids).")
@click.option("--follow-up", "follow_up", default=DEFAULT_FOLLOW_UP_TOKENS, show_default=True, type=int,
              help="Then prefill this many more synthetic tokens on top of the cached prompt, as a question about "
                   "a document is (0: none); a short follow-up on a long cache is what pass-Q is for.")
@click.option("--decode", "decode_tokens", default=DEFAULT_DECODE_TOKENS, show_default=True, type=int,
              help="Then decode this many greedy tokens on the cached prompt, to report the decode step against "
                   "its memory floor (0: none).")
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic token ids.")
@click.option("--json", "json_path", is_flag=False, flag_value="-", metavar="[FILE]",
              type=click.Path(dir_okay=False, allow_dash=True),
              help="Print the results as JSON instead of the tables (`--json`), or also write them to a file "
                   "(`--json FILE`).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Write a Chrome/Perfetto trace of compute and communication per rank (the prompt's prefill).")
@click.option("--save-logits", "logits_path", type=click.Path(dir_okay=False),
              help="Write the prompt's last token's logits (float32) and the token ids as safetensors here.")
@click.option("--save-kv", "kv_path", type=click.Path(),
              help="Write the prompt's KV cache the decode ranks hold (a ringctx document directory, one slice per "
                   "rank) here.")
@engine_options
def prefill(tokens, follow_up, decode_tokens, seed, json_path, trace_path, logits_path, kv_path, config):
    """Benchmark a context-parallel prefill of synthetic tokens, e.g. `ringctx prefill --tokens 1000000`.

    With no options: the embedded model on every GPU of this machine (2 ranks on a CPU), about a
    minute on a 2-core CPU, then a short follow-up on top of the cached prompt and a few decode
    steps; the table says how close both ran to this machine's measured peak."""
    import torch

    from ..kernels.report import phase_dtypes
    from ..engine import auto_nproc
    from ..runtime.efficiency import kv_bytes_per_token, measure_efficiency, measure_peaks
    from ..runtime.failures import RankFailure

    if tokens < 1:
        raise _AgreedBadParameter(f"must be >= 1, got {tokens}", param_hint="--tokens")
    if follow_up < 0:
        raise _AgreedBadParameter(f"must be >= 0, got {follow_up}", param_hint="--follow-up")
    if decode_tokens < 0:
        raise _AgreedBadParameter(f"must be >= 0, got {decode_tokens}", param_hint="--decode")
    if config.nproc == "auto":
        config = config.replace(nproc=auto_nproc(config.device, config.tp * config.ep))  # EP: ep CP ranks at least
    world = int(os.environ.get("WORLD_SIZE", config.nproc))
    if world > tokens:
        raise _AgreedBadParameter(f"{world} ranks for {tokens} tokens: use at most as many ranks as tokens",
                                 param_hint="--nproc")
    # A timing run on synthetic tokens runs past the trained context too; its header says so instead.
    engine = build_engine(config.replace(allow_long_context=True))
    engine.context.warned = True  # as if said: the header says it
    printing = _is_printing_rank()
    follow_stats = answer = None
    dtypes = phase_dtypes(engine.model.dtype, str(engine.model.device))
    try:
        # this host's peaks, measured while its ranks wait (the prediction and the run's share of peak use them)
        peaks = measure_peaks(engine) if printing else {}
        predicted_s = _predicted_seconds(engine, tokens, peaks)
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, engine.model.config.vocab_size, (tokens + follow_up,), generator=generator)
        if printing:
            err_console.print(f"[dim]prefill of {tokens:,} synthetic tokens with {config.model} ({engine.model.dtype}) "
                              f"on {_mesh_words(engine)}, chunks of {engine.chunk_tokens:,} tokens, KV cache "
                              f"left on {engine.decode_ranks} decode rank(s)"
                              + (f", then {follow_up:,} more on top of it" if follow_up else "")
                              + _past_context(engine, tokens + follow_up + (decode_tokens + 2 if decode_tokens else 0))
                              + "[/dim]")
            for phase in ("prefill", "decode"):
                err_console.print(f"[dim]{phase} computes in {dtypes[phase]}[/dim]")
            if predicted_s is not None and predicted_s > PREDICTION_NOTICE_S:
                err_console.print(f"[bold]predicted: {_duration(predicted_s)} on this machine[/bold]; "
                                  f"`ringctx plan` sizes a cluster for it", soft_wrap=True)
        try:
            as_document = bool(kv_path or follow_up or decode_tokens)
            result = _run_prefill(engine, ids[:tokens], show_progress=printing, trace=bool(trace_path),
                                  as_document=as_document, drop_unseen=as_document)
            if kv_path:
                engine.save_document(result.document, kv_path)
            if follow_up and result.document is not None:
                follow_stats = engine.extend(result.document, ids[tokens:])
            if decode_tokens and result.document is not None and engine.state.is_decode_rank:
                answer = _decode_steps(engine, result.document, ids[:1], decode_tokens)
        except (ValueError, RankFailure) as exc:
            raise _rank_error(exc) from None
    finally:
        engine.close()
    if not printing:
        return
    stats = result.stats
    efficiency = measure_efficiency(engine, stats, answer, before=peaks)
    report = {"model": config.model, "dtype": str(engine.model.dtype).removeprefix("torch."),
              "engine_config": engine.config.to_dict(),
              "hardware": {"name": engine.hardware.name, "source": shown_source(engine.hardware),
                           "peak_flops": engine.hardware.peak_flops,
                           "bandwidth_bytes_per_s": engine.hardware.bandwidth_bytes_per_s},
              **stats.to_dict(),
              "follow_up": follow_stats.to_dict() if follow_stats else None, "compute_dtypes": dtypes,
              "predicted_s": predicted_s, "efficiency": efficiency.to_dict() if efficiency else None}
    if json_path == "-":  # for machines: JSON alone on stdout (the headers and notes are on stderr)
        click.echo(json.dumps(report, indent=2))
    else:
        for table in stats_tables(stats, f"ringctx prefill: {config.model}, {tokens:,} tokens", follow_stats, efficiency,
                                  engine.hardware, kv_bytes_per_token(engine)):
            console.print(table)
        if json_path:
            _write_json(json_path, report)
    if logits_path:
        _save_logits(logits_path, result)
    if trace_path:
        from ..telemetry import write_chrome_trace

        write_chrome_trace(trace_path, result.trace_events)
        err_console.print(f"trace written to {trace_path} (open in ui.perfetto.dev)")
    if tokens == DEFAULT_PREFILL_TOKENS:
        err_console.print("[dim]Go bigger: `ringctx prefill --tokens 1000000 --nproc N` on a machine with N GPUs or "
                          "cores, torchrun across hosts (see README), and `ringctx plan` to size it first.[/dim]")


def _kept_words(stats, bytes_per_token: int) -> str:
    """'1.2 GB of 4.8 GB (25%)' when the decode ranks' windowed and chunked layers dropped rows, else ''."""
    kept = sum(stats.decode_kv_bytes_per_rank)
    every = sum(stats.decode_slice_rows_per_rank) * bytes_per_token
    if not kept or not every or kept >= every:
        return ""
    return f"{fmt_bytes(kept)} of {fmt_bytes(every)} ({kept / every:.0%})"


def _past_context(engine, total: int) -> str:
    """The header's words for a run past the model's trained context ("" within it)."""
    limit = engine.context.limit
    if total <= limit:
        return ""
    return (f"; {total:,} tokens pass the trained context of {engine.model.full_config.name}, {limit:,} tokens "
            "(run anyway: a timing run, what the model computes past it is noise)")


def _decode_steps(engine, document, prompt_ids, steps: int):
    """`steps` greedy decode steps after `prompt_ids` on the document (no stop token): the
    GenerationResult on the leading decode rank, None elsewhere."""
    generation = engine.generate(document, prompt_ids.tolist(), max_new_tokens=steps + 1, stop_token_ids=[])
    for _ in generation:
        pass
    return getattr(generation, "result", None)


def _save_logits(path: str, result) -> None:
    """The last token's logits and the prompt's token ids as safetensors, written atomically."""
    from safetensors.torch import save_file

    tmp = f"{path}.tmp.{os.getpid()}"
    save_file({"logits": result.logits.detach().float().cpu().contiguous(),
               "token_ids": result.token_ids.cpu().contiguous()}, tmp)
    os.replace(tmp, path)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--save", "save_path", required=True, type=click.Path(),
              help="Document to write (a directory: one KV slice per decode rank, a manifest, the tokens).")
@click.option("--no-chat", is_flag=True, help="Prefill the raw text, without the model's chat template.")
@click.option("--restart", is_flag=True,
              help="Start over, discarding the checkpoint (SAVE.ingest) a stopped ingest of this document left.")
@engine_options(serving=True)
def ingest(file, save_path, no_chat, restart, config):
    """Prefill a document and save its KV cache, to `ask` questions about it later.

    The ingest keeps a checkpoint beside SAVE (SAVE.ingest: every chunk's rows as it completes);
    run the same command again after a crash or a kill and it resumes after the last chunk every
    rank wrote (on the same ranks: the same bits as an ingest that never stopped). It is removed
    once the document is saved."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise _AgreedError(f"{file}: no such file") from None
    except UnicodeDecodeError as exc:
        raise _AgreedError(f"{file} is not UTF-8 text (byte {exc.start}); convert it first") from None
    if not text.strip():
        raise _AgreedError(f"{file} is empty: nothing to ingest")
    from ..runtime.failures import RankFailure

    from ..engine import serving_layout

    nproc, layout_note = serving_layout(config.nproc, config.device, config.tp * config.ep)  # the note goes with the closing lines
    from ..runtime.checkpoint import checkpoint_path, remove_checkpoint

    engine = build_engine(config.replace(nproc=nproc))
    printing = _is_printing_rank()
    checkpoint = checkpoint_path(save_path)
    try:
        try:
            document = _ingest_with_progress(engine, text, not no_chat, checkpoint, restart, printing)
            if document is not None:
                engine.save_document(document, save_path)
            if printing:  # the saved document holds every row now
                remove_checkpoint(checkpoint)
        except (ValueError, RankFailure) as exc:
            raise _rank_error(exc) from None
    finally:
        engine.close()
    if printing:
        from ..runtime.efficiency import kv_bytes_per_token

        for table in stats_tables(document.stats, f"ringctx ingest: {file} ({document.length:,} tokens)",
                                  hardware=engine.hardware, kv_bytes_per_token=kv_bytes_per_token(engine)):
            console.print(table)
        if layout_note:
            err_console.print(f"[dim]{layout_note}[/dim]")
        err_console.print(f"saved the KV cache to {save_path}; ask with: ringctx ask {save_path} \"your question\"")


def _ingest_with_progress(engine, text, chat: bool, checkpoint: str, restart: bool, printing: bool):
    """The ingest with its checkpoint (a line when it resumes), and a progress bar on the printing rank."""
    with prefill_progress(err_console) if printing else contextlib.nullcontext() as progress:
        bar = work_bar(progress, engine.model.full_config, engine.chunk_tokens) if printing else None
        job = engine.start_ingest(text, chat=chat, on_chunk=bar, checkpoint=checkpoint, restart=restart,
                                  keep_checkpoint=True)
        if printing and job.resume.mode != "fresh":
            err_console.print(f"[dim]{job.resume.describe(job.run.T + job.run.cached_len)}[/dim]")
            for i, record in enumerate(job.run.stats.chunks):  # the chunks it did before: the bar starts after them
                bar(i + 1, job.total_chunks, record)
        while not job.done:
            job.step()
        return job.finish().document


@main.command()
@click.argument("kv_file", type=click.Path())
@click.argument("questions", nargs=-1, required=True)
@click.option("--model", default=COMMAND_LINE.model, show_default=True, help="The model the document was made with.")
@click.option("--dtype", default=None, help="Default: the document's dtype.")
@nproc_option("auto", serving=True)
@TP_OPTION
@EP_OPTION
@DECODE_RANKS_OPTION
@click.option("--max-new-tokens", default=256, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--seed", default=None, type=int)
@TIMEOUT_OPTION
@rope_scaling_option(" [default: what the document was made with]")
@ALLOW_LONG_CONTEXT_OPTION
def ask(kv_file, questions, model, dtype, nproc, tp, ep, decode_ranks, max_new_tokens, temperature, top_p, top_k, seed,
        timeout_s, rope_scaling, allow_long_context):
    """Answer questions about a document saved by `ringctx ingest`: one question streams its answer;
    several are answered together (one decode step for all, the document read once per step for
    every question) and the answers are printed labelled, in the order asked, once all are complete."""
    for i, question in enumerate(questions):
        if not question.strip():
            which = "the question" if len(questions) == 1 else f"the question {i + 1}"
            raise _AgreedBadParameter(f"{which} is empty: ask something about the document",
                                      param_hint="QUESTIONS")
    context = dict(rope_scaling=rope_scaling, allow_long_context=allow_long_context, ep=ep)
    if len(questions) > 1:
        return _ask_many(kv_file, questions, model, dtype, nproc, tp, decode_ranks, timeout_s, context,
                         dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed))
    question = questions[0]
    printing = _is_printing_rank()
    with _document_engine(kv_file, model, dtype, nproc, tp, decode_ranks, timeout_s, context) as (
            engine, document, layout_note):
        generation = engine.generate(document, question, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, top_k=top_k, seed=seed) if document is not None else iter(())
        for piece in generation:
            click.echo(piece, nl=False)
    if not printing:
        return
    click.echo()
    r = generation.result
    if layout_note:
        err_console.print(f"[dim]{layout_note}[/dim]")
    err_console.print(f"[dim]{document.length:,} cached tokens on {engine.decode_ranks} decode rank(s); first token "
                      f"{r.time_to_first_token_s * 1000:.0f} ms, then {r.decode_ms_per_token:.1f} ms/token over "
                      f"{len(r.token_ids)} tokens[/dim]")


@contextlib.contextmanager
def _document_engine(kv_file, model, dtype, nproc, tp, decode_ranks, timeout_s, context):
    """`ringctx ask`'s engine: yields (engine, document, layout note), an Engine in the saved
    document's dtype, KV dtype and RoPE stretch (unless `context`'s rope_scaling is given; nproc auto:
    the serving layout) with the document loaded on it.
    The engine is closed on leaving; bad input and a lost rank become the command's error."""
    from ..engine import Engine, serving_layout
    from ..runtime.documents import describe_document
    from ..runtime.failures import RankFailure

    engine = None
    try:
        meta = describe_document(kv_file)
        nproc, layout_note = serving_layout(nproc, None, tp * context.get("ep", 1))  # EP: ep CP ranks at least
        rope_scaling = context["rope_scaling"]
        if rope_scaling is None:
            rope_scaling = (meta["engine_config"] or {}).get("rope_scaling")
        engine = Engine(model, dtype=dtype or meta["dtype"], nproc=nproc, decode_ranks=decode_ranks,
                        kv_dtype=meta["kv_dtype"], timeout_s=timeout_s, tp=tp, weights=meta["weights"],
                        rope_scaling=rope_scaling, allow_long_context=context["allow_long_context"],
                        ep=context.get("ep", 1))
        yield engine, engine.load_document(kv_file), layout_note
    except (ValueError, OSError, RankFailure) as exc:
        raise _rank_error(exc) from None
    finally:
        if engine is not None:
            engine.close()


def _ask_many(kv_file, questions, model, dtype, nproc, tp, decode_ranks, timeout_s, context, sampling):
    """`ringctx ask` with several questions: Engine.ask_many (under torchrun rank 0 leads, the others follow)."""
    import time

    printing = _is_printing_rank()
    with _document_engine(kv_file, model, dtype, nproc, tp, decode_ranks, timeout_s, context) as (
            engine, document, layout_note):
        if engine.mode == "torchrun" and engine.rank != 0:
            engine.follow()  # rank 0 drives the batch; this rank runs its commands until it closes
            return
        if engine.mode == "torchrun":
            engine.lead()
        t0 = time.perf_counter()
        answers = engine.ask_many(document, questions, **sampling)
        texts = [[] for _ in questions]
        for i, piece in answers:
            texts[i].append(piece)
        seconds = time.perf_counter() - t0
        for i, question in enumerate(questions):  # each labelled, in the order asked
            click.echo(f"[{i + 1}] {question}")
            click.echo("".join(texts[i]))
            click.echo()
    if not printing:
        return
    tokens = sum(len(r.token_ids) for r in answers.results if r is not None)
    if layout_note:
        err_console.print(f"[dim]{layout_note}[/dim]")
    err_console.print(f"[dim]{document.length:,} cached tokens on {engine.decode_ranks} decode rank(s); "
                      f"{len(questions)} questions answered together: {tokens} tokens in {seconds:.1f} s "
                      f"({tokens / seconds:.1f} tokens/s)[/dim]")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
@click.option("--measure-dtype", is_flag=True,
              help="Measure what --dtype auto picks on this CPU afresh (about a second idle), dropping the cached "
                   "measurements, and show it.")
def info(as_json: bool, measure_dtype: bool) -> None:
    """Devices, attention and distributed backends, versions, the CPU kernels that run here and why
    any does not, whether weights and KV caches go to 2 MiB pages, and what --dtype auto picks on
    this machine and why: its measured numbers and conditions, whether it is settled or
    provisional (then engine starts measure it again) and its cache file."""
    from .environment import environment_report

    if measure_dtype and not as_json:
        err_console.print("[dim]measuring what --dtype auto picks on this CPU...[/dim]")
    report = environment_report(measure_dtype=measure_dtype)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    table = Table(title="ringctx environment", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in report.items():
        table.add_row(key, _cell(value))
    console.print(table)


def _cell(value, indent: str = "") -> str:
    """A report value as table text: lists joined, dicts one "key: value" line each (nested ones
    indented below their key), a list of dicts one "- key: value, ..." line each."""
    if isinstance(value, dict):
        return "\n".join(f"{indent}{k}:\n{_cell(v, indent + '  ')}" if isinstance(v, dict) or _rows(v)
                         else f"{indent}{k}: {_cell(v)}" for k, v in value.items())
    if _rows(value):  # a list of dicts: one line each
        return "\n".join(f"{indent}- " + ", ".join(f"{k}: {_cell(v)}" for k, v in item.items()) for item in value)
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _rows(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


from .planning import calibrate, plan  # noqa: E402  (the planner's commands live beside this file)

main.add_command(plan)
main.add_command(calibrate)

# `ringctx serve` lives in a module of its own (it registers itself on `main`).
from .serve import serve  # noqa: E402

main.add_command(serve)

if __name__ == "__main__":
    sys.exit(main())
