"""The guard over a model's trained context, and `--rope-scaling`, which stretches that context at load.

A sequence longer than the model was trained for (`ModelConfig.trained_context`: max_position_embeddings
as the checkpoint's own RoPE scaling extends it) runs, but what the model says past that length is
noise. So every way a sequence comes in asks `context_problem` (through the engine's
`ContextGuard`) before any rank computes or communicates:

    Engine.prefill / ingest / extend     the cached tokens and the new ones
    Engine.generate / ask, Batch.join    the document, the question and max_new_tokens
    Engine.chat (the prefix cache)       the whole prompt and max_new_tokens, before any prefill
    ringctx serve                        the same, answered 400 `context_length_exceeded` (as vLLM
                                         refuses prompt + max_tokens > max_model_len)

The refusal is `ContextTooLong` (a ValueError), one line naming both lengths and the ways out: a
longer-context model, `--rope-scaling yarn:FACTOR` (`stretch_config`: YaRN over the checkpoint's
max_position_embeddings, as llama.cpp's --rope-scaling and vLLM's rope overrides do), or
`--allow-long-context`, which turns it into one `LongContextWarning` per engine.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from .config import ModelConfig, RopeScaling, yarn_attention_factor

ROPE_STRETCHES = ("yarn", "linear")
"""The RoPE scalings `--rope-scaling TYPE:FACTOR` applies at load ("none" or unset: the checkpoint's own)."""


class ContextTooLong(ValueError):
    """A sequence past the model's trained context, refused before any rank ran it: `context_problem`'s line."""

    def __init__(self, message: str, *, total: int, limit: int):
        super().__init__(message)
        self.total, self.limit = total, limit


class LongContextWarning(UserWarning):
    """A sequence past the trained context, run anyway (allow_long_context): given once per engine."""


def _lengths(config: ModelConfig, new_tokens: int, cached_tokens: int, max_new_tokens: int) -> str:
    parts = [f"{cached_tokens:,} cached"] if cached_tokens else []
    parts.append(f"{new_tokens:,} new")
    if max_new_tokens:
        parts.append(f"{max_new_tokens:,} to generate")
    total = cached_tokens + new_tokens + max_new_tokens
    return (f"{total:,} tokens ({' + '.join(parts)}) pass the trained context of {config.name}, "
            f"{config.trained_context:,} tokens")


def context_problem(config: ModelConfig, new_tokens: int, *, cached_tokens: int = 0,
                    max_new_tokens: int = 0) -> str | None:
    """The one rule: None when cached_tokens + new_tokens + max_new_tokens (the tokens to generate,
    where known; 0 for a prefill or an ingest) fit `config.trained_context`; else the refusal's
    one line, naming both lengths and the ways out (at the limit exactly is allowed)."""
    total = cached_tokens + new_tokens + max_new_tokens
    limit = config.trained_context
    if total <= limit:
        return None
    if config.rope_scaling is None:
        factor = max(2, math.ceil(total / config.max_seq_len))
        stretch = f"stretch this one at load with --rope-scaling yarn:{factor} (rope_scaling=\"yarn:{factor}\")"
    else:  # stretch_config refuses a second scaling
        stretch = "use --rope-scaling only on a model without RoPE scaling of its own"
    fewer = " or fewer new tokens," if max_new_tokens and total - max_new_tokens <= limit else ""
    return (f"{_lengths(config, new_tokens, cached_tokens, max_new_tokens)}: use a longer-context model,{fewer} "
            f"{stretch}, or run it anyway with --allow-long-context (allow_long_context=True), knowing that "
            f"answers past {limit:,} tokens are unreliable")


class ContextGuard:
    """`context_problem` for one engine: refuse (ContextTooLong) or, with `allow`, warn once."""

    def __init__(self, config: ModelConfig, allow: bool = False):
        self.config, self.allow, self.warned = config, bool(allow), False

    @property
    def limit(self) -> int:
        """The model's trained context in tokens."""
        return self.config.trained_context

    def check(self, new_tokens: int, *, cached_tokens: int = 0, max_new_tokens: int = 0) -> None:
        """Raise ContextTooLong past the trained context; with `allow` warn (LongContextWarning) the first time."""
        problem = context_problem(self.config, new_tokens, cached_tokens=cached_tokens, max_new_tokens=max_new_tokens)
        if problem is None:
            return
        if not self.allow:
            raise ContextTooLong(problem, total=cached_tokens + new_tokens + max_new_tokens, limit=self.limit)
        if not self.warned:
            self.warned = True
            warnings.warn(LongContextWarning(
                f"{_lengths(self.config, new_tokens, cached_tokens, max_new_tokens)}; run anyway "
                f"(--allow-long-context): answers past {self.limit:,} tokens are unreliable (said once)"),
                stacklevel=3)


def parse_rope_scaling(spec: str | None) -> tuple[str, float] | None:
    """("yarn" or "linear", factor) of a `--rope-scaling` value; None for None, "" or "none" (the
    checkpoint's own scaling). A ValueError of one line for anything else (an unknown type, no
    factor, a factor that is not a number above 1)."""
    if spec is None:
        return None
    text = str(spec).strip().lower()
    if text in ("", "none"):
        return None
    kind, colon, factor = text.partition(":")
    if kind not in ROPE_STRETCHES:
        raise ValueError(f"rope scaling {spec!r}: unknown type {kind!r}; write yarn:FACTOR, linear:FACTOR or none")
    if not colon or not factor.strip():
        raise ValueError(f"rope scaling {spec!r}: {kind} needs a factor, e.g. {kind}:4 (the context 4 times longer)")
    try:
        value = float(factor)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 1:
        raise ValueError(f"rope scaling {spec!r}: the factor must be a number above 1 (the trained context is "
                         f"multiplied by it), got {factor.strip()!r}")
    return kind, value


def stretch_config(config: ModelConfig, spec: str | None) -> ModelConfig:
    """`config` with its RoPE stretched by `--rope-scaling` (`spec`; None / "none": unchanged).

    yarn:F is transformers' YaRN (RopeScaling rope_type "yarn", factor F, beta_fast 32, beta_slow 1,
    attention_factor 0.1 ln F + 1) over the checkpoint's max_position_embeddings as the original;
    linear:F divides every frequency by F. Either way max_seq_len becomes F x the original, as
    transformers writes a scaled config (max_position_embeddings = the post-scaling length), so the
    trained context is F x the original. The config's fingerprint changes with it, so documents
    made without the stretch do not load with it, nor the other way round. A model whose
    checkpoint already scales RoPE is refused: ringctx does not stack two scalings.
    """
    parsed = parse_rope_scaling(spec)
    if parsed is None:
        return config
    kind, factor = parsed
    own = config.rope_scaling
    if own is not None:
        raise ValueError(f"rope scaling {spec!r}: {config.name} already scales its RoPE ({own.rope_type}, factor "
                         f"{own.factor:g}: trained context {config.trained_context:,} tokens) and ringctx does not "
                         "stack a second scaling on it; leave --rope-scaling out (or none), and use "
                         "--allow-long-context to run past that")
    original = config.max_seq_len
    if kind == "yarn":
        scaling = RopeScaling(rope_type="yarn", factor=factor, original_max_position=original,
                              attention_factor=yarn_attention_factor(factor))
    else:
        scaling = RopeScaling(rope_type="linear", factor=factor, original_max_position=original)
    return dataclasses.replace(config, rope_scaling=scaling, max_seq_len=int(round(original * factor)))
