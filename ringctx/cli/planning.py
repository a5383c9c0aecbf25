"""`ringctx plan` and `ringctx calibrate`: standalone click commands.

cli/main.py registers them with `main.add_command(plan)` and `main.add_command(calibrate)`.
Both render rich tables, or machine-readable JSON with --json. Bad input (unknown preset, tokens
<= 0, malformed profile, ...) ends with one "Error: ..." line and exit status 1; a plan whose
decode side does not fit ends with one such line and exit status DOES_NOT_FIT_EXIT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import click
from rich.console import Console
from rich.table import Table

from ..model.int8_weights import WEIGHT_CHOICES
from ..model.expert_parallel import ep_problem
from ..model.loader import DEFAULT_MODEL
from ..parallel.ring import PASS_KV, PASS_Q
from ..planning.engine_config import COMMAND_LINE
from ..planning.expert_plan import compare_expert_parallelism
from ..planning.hardware import AUTO, MEASURED, calibrated_profile_path, measured_profile_path, resolve_hardware, shown_source
from ..planning.strategy import RULES
from ..units import fmt_bytes, fmt_duration, fmt_gb
from .options import rope_scaling_option

console = Console()
err_console = Console(stderr=True)

DOES_NOT_FIT_EXIT = 3
WIDE_TERMINAL_COLUMNS = 120
"""From this width on, `plan`'s chunk table has a column of short reasons (it needs about 115)."""
"""Exit status of `plan` when the decode side does not fit: apart from bad input (1) and usage
errors (2), so a script can tell "wrong command" from "this setting would run out of memory"."""


class DoesNotFit(click.ClickException):
    """`plan` refusing a setting: the one-line reason on stderr, exit status DOES_NOT_FIT_EXIT."""

    exit_code = DOES_NOT_FIT_EXIT


def _fail(err: Exception) -> "click.ClickException":
    return click.ClickException(str(err).splitlines()[0] if str(err) else type(err).__name__)


def _table_gb(x: float) -> str:
    return fmt_gb(x, places=3)


def _ms(x: float) -> str:
    """A predicted time in milliseconds, in the unit that reads (ms, s, min, h, days)."""
    return fmt_duration(x / 1e3)


# ----------------------------------------------------------------------------- plan


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Model preset name, GGUF file, Hugging Face directory, or ORG/NAME from the local Hugging Face "
                   "cache (only its config is read).")
@click.option("--hosts", type=click.IntRange(min=1), default=None,
              help="Hosts of the job: propose (cp, tp) for hosts x --gpus-per-host GPUs (TP inside a host, "
                   "CP across hosts, the smallest TP that fits) and show every alternative. Not with --cp.")
@click.option("--gpus-per-host", type=click.IntRange(min=1), default=None,
              help="GPUs (ranks) of one host; a TP group lies inside one [default: the profile's devices_per_host].")
@click.option("--cp", "cp_size", type=int, default=None,
              help="Context-parallel ranks N (forces the mesh) [default: the ranks `ringctx prefill --nproc auto` "
                   "starts: here without --hardware, else one per device of the profile's host; / --tp].")
@click.option("--tp", "tp_size", type=int, default=None,
              help="Tensor-parallel degree inside each CP rank, a divisor of --gpus-per-host (forces it; with "
                   "--hosts, cp = hosts x gpus-per-host / tp) [default: 1, or proposed with --hosts].")
@click.option("--hardware", default=None,
              help="Hardware profile: built-in name (cpu, h100-rdma, h100-tcp, h200) or JSON path [default: as "
                   "prefill and ingest: this machine's calibrated profile (`ringctx calibrate`) if there is one, "
                   "else cpu (h200 with CUDA)].")
@click.option("--tokens", type=int, required=True, help="New tokens T of the prompt.")
@click.option("--cached", type=int, default=0, show_default=True, help="Tokens P already in the KV cache.")
@click.option("--chunk-tokens", type=int, default=None,
              help="Prefill in chunks of this many tokens; 0: one (partial) prefill of all T [default: the "
                   "engine's chunk for the model, ranks and dtype, as prefill and ingest take it].")
@click.option("--rule", type=click.Choice(RULES), default="alg5", show_default=True,
              help="Strategy rule: paper Algorithm 1 or 5, the empirical fit, or the cost model.")
@click.option("--dtype", default=COMMAND_LINE.dtype, show_default=True,
              help="Activation/attention dtype (and the KV cache's with --kv-dtype model); auto: as prefill's "
                   "--dtype auto, the dtype measured fastest here without --hardware, else bfloat16.")
@click.option("--weight-dtype", default=None, help="Weight dtype [default: --dtype].")
@click.option("--weights", type=click.Choice(WEIGHT_CHOICES), default="model", show_default=True,
              help="int8: the block matrices as int8 codes (`prefill/ingest/serve --weights int8`); on CPU "
                   "profiles their codes are counted beside the bf16 weights.")
@click.option("--no-handoff", is_flag=True, help="Leave out the KV gather to the decode rank from the TTFT.")
@click.option("--decode-ranks", type=int, default=None,
              help="Devices of the decode host that keep the KV cache after the prefill, each with a balanced "
                   "1/N slice of the tokens and the full weights (/ --tp); at most the profile's devices per "
                   "host (devices_per_host) / --tp [default: all of them, or --cp if fewer].")
@click.option("--kv-dtype", default="model", show_default=True,
              help="KV-cache storage on the prefill ranks and the decode devices: model (= --dtype), bfloat16, "
                   "float16, float32, fp8 or int8 (1 byte per element + a float32 scale per token and KV head). "
                   "Ring messages stay in --dtype.")
@rope_scaling_option()
@click.option("--ep", "ep_size", type=int, default=COMMAND_LINE.ep, show_default=True,
              help="Expert-parallel ranks (a mixture of experts' experts spread over that many CP ranks: weights "
                   "per rank fall by the experts' (ep-1)/ep). A model with experts also gets EP against TP on "
                   "max(ep, tp, 2) ranks: weights per rank, bytes sent per token, and which one plan picks, why.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
def plan(model, hosts, gpus_per_host, cp_size, tp_size, hardware, tokens, cached, chunk_tokens, rule, dtype,
         weight_dtype, weights, no_handoff, decode_ranks, kv_dtype, rope_scaling, ep_size, as_json):
    """Plan a prefill and the decode after it: strategy per chunk and why, predicted times, TTFT,
    memory per prefill rank and per decode device. With --hosts, first propose the mesh (cp, tp).
    Options left out take what `ringctx prefill` would run with (ranks, chunks, dtype, this
    machine's profile); the header says which.

    \b
    Exit status:
      0  the decode side fits (the tables and JSON say if the prefill ranks do)
      3  the decode side does not fit: one line names what does not and the
         smallest --decode-ranks / --kv-dtype that fits; with --hosts also when
         no (cp, tp) fits the prefill GPUs (the table of meshes is printed
         first). With --json the JSON (fits false, a suggestion) is printed
         first and the status is still 3, so a script that launches the
         prefill when plan succeeds never starts one whose KV cache the decode
         host cannot hold.
      1  bad input (2: a malformed command line or a bad --hosts/--cp/--tp mix)
    """
    from ..planning.hardware import load_profile
    from ..planning.mesh_proposal import propose_mesh
    from ..model.context import context_problem, stretch_config
    from ..planning.prefill_plan import decode_problem, plan_prefill, resolve_model_config

    try:
        config = stretch_config(resolve_model_config(model), rope_scaling)
        hw_note = None
        if hardware is None:  # this machine, as prefill and ingest see it (hardware "auto")
            hardware, hw_note = _this_machine_profile(cp_size, tp_size or 1)
        hw = load_profile(hardware)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise _fail(err) from None
    context_warning = None
    if context_problem(config, tokens, cached_tokens=cached) is not None:  # planned all the same, and said
        context_warning = (f"{cached + tokens:,} tokens pass the trained context of {config.name}, "
                           f"{config.trained_context:,} tokens: ingest, ask and serve refuse them without "
                           "--rope-scaling or --allow-long-context")
    gpus = _check_mesh_options(hosts, gpus_per_host, cp_size, tp_size, hw)
    if gpus_per_host is not None:  # the job's hosts, whatever the profile says
        hw = dataclasses.replace(hw, devices_per_host=gpus)
    tp = 1 if tp_size is None else tp_size
    try:
        as_run = RunDefaults.resolve(config, hw, here=hw_note is not None, hosts=hosts, gpus=gpus, cp_size=cp_size,
                                     tp=tp, chunk_tokens=chunk_tokens, dtype=dtype)
    except ValueError as err:
        raise _fail(err) from None
    if hw_note:
        as_run.notes["hardware"] = hw_note
    common = dict(cached=cached, chunk_tokens=as_run.chunk_tokens, dtype=as_run.dtype, rule=rule,
                  weight_dtype=weight_dtype, handoff=not no_handoff, decode_ranks=decode_ranks, kv_dtype=kv_dtype,
                  weights=weights)
    if ep_size != 1:
        if hosts is not None:
            raise click.UsageError("--ep plans a given mesh: give --cp (and --tp) instead of --hosts")
        problem = ep_problem(config, ep_size, as_run.cp_size, 0, decode_ranks)
        if problem:
            raise _fail(ValueError(problem))
    try:
        if hosts is None:
            proposal = None
            result = plan_prefill(config, as_run.cp_size, hw, tokens, tp_size=tp, ep_size=ep_size, **common)
        else:
            proposal = propose_mesh(config, hosts, gpus, hw, tokens, tp_size=tp_size, **common)
            result = proposal.chosen.plan if proposal.chosen is not None else None
    except (ValueError, FileNotFoundError, OSError) as err:
        raise _fail(err) from None
    problem = proposal.problem() if result is None else decode_problem(result)
    experts = None
    if result is not None and config.has_experts:  # EP against TP for this model, policy in planning/expert_plan.py
        m = result.memory
        ranks = max(ep_size, tp, 2)
        experts = compare_expert_parallelism(config, hw, ranks, dtype=result.dtype,
                                             weight_dtype=result.weight_dtype, weights=weights,
                                             other_bytes=m.total_bytes - m.weights_bytes,
                                             cp_size=max(result.cp_size, ranks))
    if as_json:
        data = {} if result is None else result.to_dict()
        if experts is not None:
            data["experts"] = experts.to_dict()
        data["as_run"] = as_run.notes
        if context_warning:
            data["context_warning"] = context_warning
        if proposal is not None:
            data = {**data, "mesh": proposal.to_dict()}
        if result is None:
            data.update(fits=False, suggestion=problem)
        click.echo(json.dumps(data, indent=2))
    else:
        if proposal is not None:
            render_mesh(proposal)
        if not problem:
            render_plan(result, as_run.notes)
        if experts is not None:  # also when the plan does not fit: EP or TP may be the way out
            render_experts(experts)
        if not problem and context_warning:  # after the tables (a plan that does not fit ends with its own one line)
            err_console.print(f"ringctx plan: warning: {context_warning}", markup=False, highlight=False,
                              soft_wrap=True)
    if problem:
        raise DoesNotFit(problem)


def _ranks_here(tp: int) -> int:
    """CP ranks `ringctx prefill --nproc auto` starts on this machine (engine.startup.auto_nproc)."""
    from ..engine.startup import auto_nproc

    return max(1, auto_nproc(None, tp) // tp)


def _this_machine_profile(cp_size: int | None, tp: int) -> tuple[str, str]:
    """(profile, where it came from) for a plan of this machine, as `prefill` and `ingest` decide
    with it by default (hardware "auto"): the calibrated profile; on a CPU without one, what an
    engine measured here at start-up on as many CP ranks (it keeps it for plan), else the
    built-in "cpu" with a word on how to get this machine's numbers."""
    from ..engine.startup import runs_on_gpu

    name = resolve_hardware(AUTO, runs_on_gpu())
    if name != MEASURED:
        return name, (f"this machine's calibrated profile, {name}" if name.endswith(".json")
                      else f"the built-in {name}")
    cp = cp_size if cp_size is not None else _ranks_here(tp)
    path = measured_profile_path(cp)
    if path.is_file():
        return str(path), f"measured here by an engine on {cp} CP rank{'s' if cp > 1 else ''} ({path})"
    return "cpu", ("the built-in cpu: `prefill` and `ingest` measure this machine at start-up (run one, or "
                   "`ringctx calibrate`, then plan again with its numbers)")


@dataclasses.dataclass
class RunDefaults:
    """The settings `plan` fills in as `ringctx prefill` and `ingest` would with the same options,
    and for each, in `notes`, what it is and where it came from (printed in the plan's header)."""

    cp_size: int
    chunk_tokens: int | None
    dtype: str
    notes: dict[str, str]

    @classmethod
    def resolve(cls, config, hw, *, here: bool, hosts, gpus: int, cp_size, tp: int, chunk_tokens, dtype):
        from ..model.tensor_parallel import TensorParallel
        from ..planning.machine_speed import preferred_dtype
        from ..planning.prefill_plan import chunk_tokens_for

        notes = {}
        if cp_size is not None or hosts is not None:
            cp = 1 if cp_size is None else cp_size  # with --hosts the proposal chooses; its world is hosts x gpus
            notes["ranks"] = "as given"
        elif here:
            cp = _ranks_here(tp)
            notes["ranks"] = (f"CP {cp} x TP {tp}: the ranks `prefill --nproc auto` starts here (`ingest` and "
                              "`serve` run one rank with every core on a CPU: --cp 1)")
        else:
            cp = max(1, hw.host_devices() // tp)
            notes["ranks"] = f"CP {cp} x TP {tp}: one rank per device of one {hw.name} host, as --nproc auto"
        if dtype == "auto":
            dtype = preferred_dtype(None) if here else "bfloat16"
            notes["dtype"] = f"{dtype}: --dtype auto, " + ("what this machine runs fastest" if here
                                                            else "as on GPUs and bf16-capable CPUs")
        else:
            notes["dtype"] = f"{dtype}: as given"
        world = (hosts * gpus) if hosts is not None else cp * tp
        if chunk_tokens is None:
            shard = TensorParallel(tp, 0).shard_config(config) if tp > 1 else config
            chunk_tokens = chunk_tokens_for(shard, world, dtype, on_gpu=not _is_cpu_profile(hw))
            notes["chunks"] = f"{chunk_tokens:,} tokens: the engine's default chunk for this model on {world} ranks"
        elif chunk_tokens == 0:
            chunk_tokens, notes["chunks"] = None, "one prefill of all the tokens (--chunk-tokens 0)"
        else:
            notes["chunks"] = f"{chunk_tokens:,} tokens: as given"
        return cls(cp, chunk_tokens, dtype, notes)


def _is_cpu_profile(hw) -> bool:
    """Whether a profile describes CPU ranks (the engine then keeps its chunks to 4,096 tokens)."""
    return hw.name in ("cpu", MEASURED) or hw.host_cores is not None


def _check_mesh_options(hosts, gpus_per_host, cp_size, tp_size, hw) -> int:
    """The GPUs of one host, after a click.UsageError (exit 2) for a mesh that cannot be laid out."""
    gpus = gpus_per_host or hw.host_devices()
    where = "--gpus-per-host" if gpus_per_host else f"devices_per_host of profile {hw.name!r}; set --gpus-per-host"
    if hosts is not None and cp_size is not None:
        raise click.UsageError("--hosts and --cp both set the CP size; give --hosts (cp = hosts x gpus-per-host / tp) "
                               "or --cp, not both")
    if tp_size is None or tp_size < 1:  # the planner names a TP size below 1 (exit 1, as any bad value)
        return gpus
    if tp_size > gpus:
        raise click.UsageError(f"--tp {tp_size} is more than the {gpus} GPUs of one host ({where}): a TP group "
                               f"lies inside one host; use --tp {gpus} or less")
    if gpus % tp_size:
        raise click.UsageError(f"--tp {tp_size} does not divide the {gpus} GPUs of one host ({where}): TP groups "
                               f"must tile the hosts; use a divisor of {gpus}")
    return gpus


def render_mesh(proposal) -> None:
    """The table of every (cp, tp) for the hosts, the proposed (or forced) one marked."""
    chosen = proposal.chosen
    title = f"mesh: {proposal.hosts} hosts x {proposal.gpus_per_host} GPUs (TP inside a host, CP across hosts)"
    table = Table(title=title)
    for col in ("CP x TP", "GB per GPU", "fits", "TTFT", "TP all-reduce", ""):
        table.add_column(col, justify="left" if col in ("CP x TP", "") else "right", no_wrap=True)
    mark = "forced" if proposal.forced else "proposed"
    for o in proposal.options:
        picked = chosen is not None and o.tp_size == chosen.tp_size
        label = f"CP {o.cp_size} x TP {o.tp_size}"
        memory = f"{o.memory_bytes / 1e9:,.1f} of {o.plan.memory.usable_bytes / 1e9:,.1f}"
        table.add_row(f"[bold]{label}[/bold]" if picked else label, memory, _yes_no(o.fits), _seconds(o.ttft_ms),
                      _seconds(o.plan.tp_allreduce_ms), f"[bold]<- {mark}[/bold]" if picked else "")
    console.print(table)
    for tp, why in proposal.excluded.items():
        console.print(f"[dim]TP {tp} left out: {why}[/dim]")
    if chosen is not None:
        console.print(f"[bold]mesh:[/bold] {proposal.reason}")


def _seconds(ms: float) -> str:
    return fmt_duration(ms / 1e3)


def render_plan(result, as_run: dict[str, str] | None = None) -> None:
    """Rich tables of a Plan: the setting, the chunks, the times and the memory per rank; `as_run`
    (RunDefaults.notes) says where each setting came from."""
    hw = result.hardware
    head = Table(title="ringctx plan: what `ringctx prefill` runs with these options", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value")
    cal = "calibrated" if hw.calibrated else "UNCALIBRATED (run `ringctx calibrate`)"
    head.add_row("model", f"{result.model.name}: {result.model.n_layers} layers, {result.model.n_heads} q / "
                          f"{result.model.n_kv_heads} kv heads x {result.model.head_dim}")
    if not result.model.has_plain_attention or result.model.has_linear:
        head.add_row("attention", result.model.attention_summary())
    if result.model.has_linear:  # what the strategy rule sees of a hybrid
        head.add_row("linear layers", f"{len(result.model.linear_layers)} keep no KV rows and take no ring (a state of "
                                      f"{fmt_bytes(result.memory.state_bytes)} a sequence per rank); the rule "
                                      f"sees the {len(result.model.attention_layers)} attention layers' heads")
    if result.model.has_experts:  # memory holds every expert, time counts those a token reaches
        head.add_row("feed-forward", f"{result.model.feed_forward_summary()}; {result.model.n_params / 1e9:.1f}B "
                                     f"parameters, {result.model.active_params / 1e9:.1f}B reach a token")
    head.add_row("hardware", f"{hw.name} ({cal}): {(as_run or {}).get('hardware') or shown_source(hw)}")
    for what, note in (as_run or {}).items():
        if what != "hardware" and not note.endswith("as given"):
            head.add_row(f"default {what}", note)
    head.add_row("ranks", f"CP {result.cp_size} x TP {result.tp_size}"
                          + (f", experts over EP {result.ep_size}" if result.ep_size > 1 else ""))
    weights = f", weights {result.weight_dtype}" if result.weight_dtype != result.dtype else ""
    weights += ", int8 weights" if result.weights == "int8" else ""
    head.add_row("dtype", result.dtype + weights + (f", KV cache {result.kv_dtype}" if result.kv_dtype != "model" else ""))
    head.add_row("prompt", f"{result.tokens:,} new tokens after {result.cached:,} cached"
                           + (f", chunks of {result.chunk_tokens:,}" if len(result.entries) > 1 else ", one prefill"))
    head.add_row("rule", result.rule)
    console.print(head)

    if len(result.entries) == 1:
        (e,) = result.entries
        one = Table(title="strategy", show_header=True)
        for col in ("strategy", "pass-KV", "pass-Q", "miss rate"):
            one.add_column(col, justify="right" if col != "strategy" else "left")
        one.add_row(f"[bold]{e.strategy}[/bold]", _ms(e.predicted_ms[PASS_KV]), _ms(e.predicted_ms[PASS_Q]),
                    f"{e.choice.miss_rate:.3g}")
        console.print(one)
        console.print(f"[bold]reason:[/bold] {e.choice.short_reason}")
        console.print(f"[dim]{e.choice.formula}[/dim]")
    else:
        chunks = Table(title=f"{len(result.entries)} chunks", show_header=True)
        # each chunk's short reason where the terminal has room for it; the lines below the table
        # name the reason of chunk 0 and of each switch in any case
        wide = console.width >= WIDE_TERMINAL_COLUMNS
        for col in ("#", "new", "cached", "strategy", "pass-KV", "pass-Q", "miss rate") + (("reason",) if wide else ()):
            chunks.add_column(col, justify="left" if col in ("strategy", "reason") else "right")
        shown = result.entries if len(result.entries) <= 40 else result.entries[:20] + result.entries[-20:]
        for i, e in enumerate(shown):
            if len(result.entries) > 40 and i == 20:
                chunks.add_row("...", *[""] * (len(chunks.columns) - 1))
            fast = min(e.predicted_ms, key=e.predicted_ms.get)
            cells = {s: (f"[bold]{_ms(v)}[/bold]" if s == fast else _ms(v)) for s, v in e.predicted_ms.items()}
            chunks.add_row(str(e.index), f"{e.new_tokens:,}", f"{e.cached_tokens:,}", e.strategy, cells[PASS_KV],
                           cells[PASS_Q], f"{e.choice.miss_rate:.3g}", *((e.choice.short_reason,) if wide else ()))
        console.print(chunks)
        # where the strategy switches (rows of a long plan may be left out above), then the rule once
        switches = [e for prev, e in zip(result.entries, result.entries[1:]) if e.strategy != prev.strategy]
        first = result.entries[0]
        console.print(f"[bold]chunk 0:[/bold] {first.choice.short_reason}")
        for e in switches[:3]:
            console.print(f"[bold]chunk {e.index}:[/bold] {e.choice.short_reason}")
        for formula in dict.fromkeys(e.choice.formula for e in result.entries):
            console.print(f"[dim]{formula}[/dim]")

    times = Table(title="predicted time to first token", show_header=False)
    times.add_column("what", style="bold")
    times.add_column("time", justify="right")
    times.add_row("chunks (chosen strategies)", _ms(sum(e.chosen_ms for e in result.entries)))
    if result.tp_size > 1:
        times.add_row("  of which TP all-reduces", _ms(result.tp_allreduce_ms))
    if result.layer_overhead_ms:
        times.add_row("  of which fixed per-layer costs", _ms(result.layer_overhead_ms))
    if result.model.has_linear:
        times.add_row("  of which linear-attention layers", _ms(result.linear_attention_ms))
        if result.cp_size > 1:
            times.add_row("    of which their state exchanges", _ms(result.state_exchange_ms))
    times.add_row("LM head", _ms(result.lm_head_ms))
    times.add_row("KV hand-off to the decode ranks", _ms(result.handoff_ms))
    times.add_row("[bold]TTFT[/bold]", f"[bold]{_ms(result.ttft_ms)}[/bold]")
    if result.best_ttft_ms < result.ttft_ms * 0.999:
        times.add_row("TTFT with the faster strategy everywhere", _ms(result.best_ttft_ms))
    console.print(times)
    last = result.entries[-1].costs[result.entries[-1].strategy].state_exchange
    if last is not None and result.cp_size > 1:  # the summaries' way, its arithmetic (the last chunk's)
        console.print(f"[bold]state summaries:[/bold] {last.reason}", highlight=False)

    m = result.memory
    mem = Table(title="prefill memory per rank", show_header=False)
    mem.add_column("what", style="bold")
    mem.add_column("bytes", justify="right")
    mem.add_row("weights", _table_gb(m.weights_bytes))
    mem.add_row("KV-cache shard", _table_gb(m.kv_cache_bytes))
    if m.state_bytes:
        mem.add_row("linear-attention states", _table_gb(m.state_bytes))
    mem.add_row("activations (one layer)", _table_gb(m.activation_bytes))
    mem.add_row("total", _table_gb(m.total_bytes))
    mem.add_row("usable of capacity", f"{_table_gb(m.usable_bytes)} of {_table_gb(m.capacity_bytes)}")
    mem.add_row("fits", _yes_no(m.fits))
    # an ingest's checkpoint (runtime/checkpoint.py): each rank's rows once, and CP rank 0 the
    # linear-attention states at every chunk's end (appended, never rewritten)
    mem.add_row("ingest checkpoint on disk", _table_gb(m.kv_cache_bytes + len(result.entries) * m.state_bytes))
    console.print(mem)
    render_decode(result)
    console.print(f"[bold]fits:[/bold] {_yes_no(result.fits)} (prefill ranks and decode devices)")


def render_experts(choice) -> None:
    """EP against TP for the model's experts (planning/expert_plan.py): per option its weights and
    memory per rank, whether they fit, the bytes it sends per token, and the pick with its reason."""
    table = Table(title=f"experts on {choice.ranks} ranks: EP against TP", show_header=True)
    for column in ("option", "weights / rank", "total / rank", "fits", "sent / token", "note"):
        table.add_column(column, justify="left" if column in ("option", "note") else "right")
    for o in choice.options:
        picked = choice.chosen is not None and o.name == choice.chosen.name
        table.add_row(("* " if picked else "") + o.name, _table_gb(o.weights_bytes), _table_gb(o.total_bytes),
                      _yes_no(o.fits), f"{o.bytes_per_token / 1024:,.0f} KiB", o.problem or "")
    console.print(table)
    console.print(f"[bold]experts:[/bold] {'picks ' if choice.chosen else ''}{choice.reason}", highlight=False)


def render_decode(result) -> None:
    """The memory of one decode device: weights, its KV slice, one step's workspace."""
    d = result.decode
    kv = f"{result.dtype} (model)" if d.kv_dtype == "model" else d.kv_dtype
    tp = f", TP {result.tp_size} each" if result.tp_size > 1 else ""
    mem = Table(title="decode memory per device", show_header=False)
    mem.add_column("what", style="bold")
    mem.add_column("bytes", justify="right")
    mem.add_row("decode ranks", f"{d.decode_ranks} of {d.max_decode_ranks} on one host{tp}")
    mem.add_row("KV cache", kv)
    mem.add_row("weights", _table_gb(d.weights_bytes))
    if d.kv_slice_all_rows_bytes != d.kv_slice_bytes:  # windowed or chunked layers keep what later tokens see
        share = d.kv_slice_bytes / max(1, d.kv_slice_all_rows_bytes)
        mem.add_row(f"KV slice ({d.slice_tokens:,} tokens, {share:.0%} kept)", _table_gb(d.kv_slice_bytes))
        mem.add_row("  every row of every layer", _table_gb(d.kv_slice_all_rows_bytes))
    else:
        mem.add_row(f"KV slice ({d.slice_tokens:,} tokens)", _table_gb(d.kv_slice_bytes))
    if d.state_bytes:
        mem.add_row("linear-attention states", _table_gb(d.state_bytes))
    mem.add_row("workspace (one decode step)", _table_gb(d.workspace_bytes))
    mem.add_row("total", _table_gb(d.total_bytes))
    mem.add_row("usable of capacity", f"{_table_gb(d.usable_bytes)} of {_table_gb(d.capacity_bytes)}")
    mem.add_row("fits", _yes_no(d.fits))
    console.print(mem)


def _yes_no(fits: bool) -> str:
    return "[green]yes[/green]" if fits else "[red]NO[/red]"


# ----------------------------------------------------------------------------- calibrate


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        raise click.ClickException(f"--nproc must be ring sizes like 2 or 2,4; got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise click.ClickException(f"--nproc must be ring sizes >= 1 like 2 or 2,4; got {text!r}")
    return sizes


@click.command()
@click.option("--nproc", default="2", show_default=True,
              help="Ring size(s) of the live gloo groups to measure, e.g. 2 or 2,4 (ignored under torchrun).")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Model whose attention heads and linear shapes are measured (preset, GGUF or HF directory).")
@click.option("--dtype", "dtypes", multiple=True, default=("bfloat16",), show_default=True,
              help="Compute dtype to measure (repeat for several; communication uses the first).")
@click.option("--out", "out_path", default=None,
              help="Profile JSON to write [default: this machine's profile, which every run without --hardware "
                   "reads: $RINGCTX_HARDWARE_PROFILE, else ~/.config/ringctx/hardware.json].")
@click.option("--name", default=None, help="Profile name [default: calibrated-<hostname>].")
@click.option("--tp", "tp_size", type=int, default=0,
              help="Measure the tensor-parallel all-reduce (tp_latency_s, tp_bandwidth_bytes_per_s) among this many "
                   "local ranks, as `--tp` runs them [default: the smallest --nproc group].")
@click.option("--quick", is_flag=True, help="A few seconds: fewer sizes and repeats (rough numbers; for tests).")
@click.option("--repeats", type=int, default=None, help="Timed repeats per measurement [default: 5, quick: 2].")
@click.option("--json", "as_json", is_flag=True, help="Print the profile and the raw measurements as JSON.")
def calibrate(nproc, model, dtypes, out_path, name, tp_size, quick, repeats, as_json):
    """Measure compute, ring SendRecv and All2All here; write a hardware profile for --hardware."""
    from ..planning.calibrate import CalibrationSettings, calibrate as run_calibration, calibrate_spmd
    from ..planning.hardware import load_profile, save_profile

    if repeats is not None and repeats < 1:
        raise click.ClickException(f"--repeats must be >= 1, got {repeats}")
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    sizes = _parse_sizes(nproc)
    try:
        settings = CalibrationSettings.make(model, dtypes=dtypes, cp_sizes=sizes, quick=quick, repeats=repeats,
                                            tp_size=tp_size)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise _fail(err) from None
    if out_path is None:  # this machine's own profile: its directory is made when missing
        out_path = str(calibrated_profile_path())
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise click.ClickException(f"--out {out_path}: directory {out_dir} does not exist")

    def progress(msg: str) -> None:
        if not as_json:
            err_console.print(f"[dim]calibrate:[/dim] {msg}")

    if torchrun:
        from ..parallel.launch import is_first_rank

        result = calibrate_spmd(settings, name=name, progress=progress, join_torchrun=True)
        if result is None or not is_first_rank():  # not rank 0: nothing to print or write
            return
    else:
        result = run_calibration(settings, name=name, progress=progress)
    path = save_profile(result.profile, out_path)
    load_profile(str(path))  # what the planner will read
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "path": str(path)}, indent=2))
        return
    render_calibration(result, str(path))


def render_calibration(result, path: str) -> None:
    """Rich tables of a Calibration."""
    hw = result.profile
    host = result.samples.get("host", {})
    title = f"calibrated {hw.name} in {result.seconds:.0f} s"
    info = Table(title=title, show_header=False)
    info.add_column("what", style="bold")
    info.add_column("value")
    info.add_row("host", f"{host.get('cpu')}, {host.get('cores')} cores, load average {host.get('load_average')}")
    info.add_row("matrix engines", ", ".join(host.get("cpu_features", [])) or "none (no AMX, no avx512_bf16)")
    info.add_row("layer overhead", f"{hw.layer_overhead_s * 1e6:.0f} us a decoder layer beyond its FLOPs")
    if hw.tp_bandwidth_bytes_per_s is not None:
        info.add_row("TP all-reduce", f"{hw.tp_latency_s * 1e6:.0f} us + bytes at "
                                      f"{hw.tp_bandwidth_bytes_per_s / 1e9:.2f} GB/s among the local ranks")
    info.add_row("profile written", path)
    console.print(info)

    for dtype, c in result.samples.get("compute", {}).items():
        att = Table(title=f"attention ({dtype}, one thread; call overhead {c['attention']['overhead_s'] * 1e6:.0f} us)")
        for col in ("query rows", "full: keys", "full GFLOP/s", "causal GFLOP/s"):
            att.add_column(col, justify="right")
        for (r, keys, _t, f), (_r, _t2, fc) in zip(c["attention"]["full"], c["attention"]["causal"]):
            att.add_row(str(r), str(keys), f"{f / 1e9:.1f}", f"{fc / 1e9:.1f}")
        console.print(att)
        lin = Table(title=f"linear layers ({dtype}, one thread)")
        for col in ("tokens", "decoder block GFLOP/s", "plain GEMMs GFLOP/s"):
            lin.add_column(col, justify="right")
        for (t, _s, fb), (_t, _s2, fg) in zip(c["linear"]["block"], c["linear"]["gemm"]):
            lin.add_row(str(t), f"{fb / 1e9:.1f}", f"{fg / 1e9:.1f}")
        console.print(lin)

    # Two tables of few columns, so that each reads on 80 columns: messages, then compute and overlap.
    rings = sorted(hw.ring_sizes.items())
    messages = Table(title="ring messages per rank (N > 1)")
    for col in ("N", "SendRecv us", "SendRecv GB/s", "All2All us", "All2All GB/s"):
        messages.add_column(col, justify="right")
    for n, r in rings:
        if n > 1:
            messages.add_row(str(n), f"{r.latency_s * 1e6:.0f}", f"{r.bandwidth_bytes_per_s / 1e9:.2f}",
                             f"{r.all2all_latency_s * 1e6:.0f}", f"{r.all2all_bandwidth_bytes_per_s / 1e9:.2f}")
    if messages.row_count:
        console.print(messages)
    compute = Table(title="ring sizes: compute and overlap")
    for col in ("N", "threads", "compute x", "overlap", "pass-KV +ms", "pass-Q +ms"):
        compute.add_column(col, justify="right")
    for n, r in rings:
        comm = n > 1
        compute.add_row(str(n), str(r.threads_per_rank), f"{r.compute_scale:.2f}",
                        f"{r.comm_overlap:.2f}" if comm else "-",
                        f"{r.overhead_s[PASS_KV] * 1e3:.2f}" if comm else "-",
                        f"{r.overhead_s[PASS_Q] * 1e3:.2f}" if comm else "-")
    console.print(compute)
    console.print("[dim]compute x: a rank's compute rate against one alone; overlap: the share of messages hidden "
                  "under compute; +ms: a ring step's fixed overhead per strategy[/dim]")
    console.print(f"use it: [bold]ringctx plan --hardware {path} ...[/bold] or [bold]--hardware {path}[/bold] "
                  "with prefill/ingest")


if __name__ == "__main__":  # python -m ringctx.cli.planning plan ...
    group = click.Group(commands={"plan": plan, "calibrate": calibrate})
    sys.exit(group())
