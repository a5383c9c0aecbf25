"""The options every command that builds an Engine shares, and the one-line errors they end with.

`engine_options` hands a command one `config` (an EngineConfig) built from its options, whose
defaults and help are the EngineConfig fields' own (`COMMAND_LINE`); `ask` and `serve` take some of
the same options one by one.
"""

from __future__ import annotations

import contextlib
import functools
import os

import click

from ..attention.quant import KV_DTYPES
from ..model.int8_weights import WEIGHT_CHOICES
from ..planning.engine_config import ATTN_BACKENDS, COMMAND_LINE, LINEAR_EXCHANGES, STRATEGY_CHOICES, field_help
from ..planning.strategy import RULES


class _OnePerHost:
    """For errors every rank raises alike (bad input, start-up mismatch, memory): under torchrun only
    local rank 0 of each host prints it, instead of every rank repeating it. The other ranks leave a
    moment later, so that torchrun does not stop local rank 0 before it has printed."""

    def show(self, file=None) -> None:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            super().show(file)
        else:
            import time

            time.sleep(3)


class _AgreedError(_OnePerHost, click.ClickException):
    pass


class _AgreedBadParameter(_OnePerHost, click.BadParameter):
    pass


def _rank_error(exc: Exception) -> click.ClickException:
    """One clear line for an error out of the engine (RankFailure lines are per rank: all print)."""
    from ..runtime.failures import CLOSED, RankFailure

    text = str(exc)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":  # str(KeyError) quotes its message
        text = text[1:-1]
    text = text.removesuffix(CLOSED)  # the CLI ends anyway: no "create a new Engine"
    return click.ClickException(text) if isinstance(exc, RankFailure) else _AgreedError(text)


class _RankCount(click.ParamType):
    """--nproc: a positive integer, or "auto" (one rank per GPU; 2 on a CPU with 2+ cores)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of ranks nor 'auto'", param, ctx)
        if n < 1:
            self.fail(f"must be >= 1, got {n}", param, ctx)
        return n


class _RopeScalingSpec(click.ParamType):
    """--rope-scaling: yarn:FACTOR, linear:FACTOR or none, checked here (one line for a bad value)."""

    name = "yarn:F|linear:F|none"

    def convert(self, value, param, ctx):
        from ..model.context import parse_rope_scaling

        if value is None:
            return None
        try:
            parse_rope_scaling(value)
            return str(value).strip().lower()  # "none" kept: `ask` tells it from unset (the document's own)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def rope_scaling_option(help_extra: str = ""):
    return click.option("--rope-scaling", "rope_scaling", type=_RopeScalingSpec(), default=COMMAND_LINE.rope_scaling,
                        help=_help("rope_scaling") + help_extra)


# Options that `ask` shares with the commands of engine_options.
def nproc_option(default, serving: bool = False):
    auto = ("auto (the layout that serves fastest: one rank per GPU, one rank with every core on a CPU)" if serving
            else "auto (one per GPU; 2 on a CPU with 2+ cores, each with half the threads)")
    return click.option("--nproc", default=default, show_default=True, type=_RankCount(),
                        help=f"Local ranks to spawn: a number, or {auto}. Ignored under torchrun, which sets the world.")


def _help(name: str) -> str:
    """An engine option's help: the EngineConfig field's docstring (written once, there)."""
    return field_help()[name]


TIMEOUT_OPTION = click.option("--timeout", "timeout_s", default=COMMAND_LINE.timeout_s, show_default=True,
                              help=_help("timeout_s"))
TP_OPTION = click.option("--tp", "tp", default=COMMAND_LINE.tp, show_default=True, type=int,
                         help=_help("tp") + " Under torchrun launch tp x (CP ranks per host) per node.")
EP_OPTION = click.option("--ep", "ep", default=COMMAND_LINE.ep, show_default=True, type=int, help=_help("ep"))
WEIGHTS_OPTION = click.option(
    "--weights", type=click.Choice(WEIGHT_CHOICES), default=COMMAND_LINE.weights, show_default=True,
    help=_help("weights") + " bf16 or float32 models; the prefill keeps reading the same values in bf16, so the "
                            "codes add half the blocks' bytes.")
DECODE_RANKS_OPTION = click.option(
    "--decode-ranks", type=int, default=COMMAND_LINE.decode_ranks,
    help=_help("decode_ranks") + " A document saved by any number loads on any other.")
ALLOW_LONG_CONTEXT_OPTION = click.option("--allow-long-context", "allow_long_context", is_flag=True,
                                         default=COMMAND_LINE.allow_long_context, help=_help("allow_long_context"))
ROPE_SCALING_OPTION = rope_scaling_option()
MODEL_OPTION = click.option("--model", default=COMMAND_LINE.model, show_default=True, help=_help("model"))

ENGINE_OPTIONS = ("model", "nproc", "tp", "ep", "chunk_tokens", "strategy", "hardware", "rule", "linear_exchange",
                  "dtype", "device", "attn_backend", "timeout_s", "decode_ranks", "kv_dtype", "weights", "rope_scaling",
                  "allow_long_context")
"""The EngineConfig fields a command of `engine_options` takes from its command line."""


def engine_options(f=None, *, serving: bool = False):
    """The options of every command that builds an Engine, handed to it as one `config`
    (an EngineConfig; defaults: COMMAND_LINE). serving: --nproc auto is the serving layout."""
    if f is None:
        return lambda g: engine_options(g, serving=serving)
    options = [
        MODEL_OPTION,
        nproc_option(COMMAND_LINE.nproc, serving=serving),
        TP_OPTION,
        EP_OPTION,
        click.option("--chunk-tokens", type=int, default=COMMAND_LINE.chunk_tokens, help=_help("chunk_tokens")),
        click.option("--strategy", type=click.Choice(STRATEGY_CHOICES), default=COMMAND_LINE.strategy,
                     show_default=True, help=_help("strategy")),
        click.option("--hardware", default=COMMAND_LINE.hardware, help=_help("hardware")),
        click.option("--rule", type=click.Choice(RULES), default=COMMAND_LINE.rule, show_default=True,
                     help=_help("rule")),
        click.option("--linear-exchange", type=click.Choice(LINEAR_EXCHANGES), default=COMMAND_LINE.linear_exchange,
                     show_default=True, help=_help("linear_exchange")),
        click.option("--dtype", default=COMMAND_LINE.dtype, show_default=True, help=_help("dtype")),
        click.option("--device", default=COMMAND_LINE.device, help=_help("device")),
        click.option("--attn-backend", type=click.Choice(ATTN_BACKENDS), default=COMMAND_LINE.attn_backend,
                     show_default=True, help=_help("attn_backend")),
        TIMEOUT_OPTION,
        DECODE_RANKS_OPTION,
        click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=COMMAND_LINE.kv_dtype, show_default=True,
                     help=_help("kv_dtype")),
        WEIGHTS_OPTION,
        ROPE_SCALING_OPTION,
        ALLOW_LONG_CONTEXT_OPTION,
    ]

    @functools.wraps(f)
    def with_config(**kwargs):
        settings = {name: kwargs.pop(name) for name in ENGINE_OPTIONS}
        return f(config=COMMAND_LINE.replace(**settings), **kwargs)

    for option in reversed(options):
        with_config = option(with_config)
    return with_config


@contextlib.contextmanager
def warnings_as_lines(console):
    """The engine's LongContextWarning (allow_long_context) as one line on `console`, other warnings as usual."""
    import warnings

    from ..model.context import LongContextWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, LongContextWarning):
                if os.environ.get("LOCAL_RANK", "0") == "0":
                    console.print(f"ringctx: warning: {message}", markup=False, highlight=False, soft_wrap=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def build_engine(config):
    """The Engine of `config` (an EngineConfig), or the command's one-line error."""
    from ..engine import Engine
    from ..runtime.failures import RankFailure

    try:
        return Engine(config=config)
    except (ValueError, OSError, RankFailure) as exc:  # bad names, paths, files, lost ranks: one clear line
        raise _rank_error(exc) from None
