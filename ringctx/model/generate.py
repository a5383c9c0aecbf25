"""Single-host decoding: prefill into a static KV cache, then one token per step.

    result = model.generate("Why is the sky blue?", chat=True, max_new_tokens=64)
    for piece in model.stream([{"role": "user", "content": "Hi"}], temperature=0.7, seed=0):
        print(piece, end="", flush=True)

Greedy (temperature 0) or sampled (temperature, top-k, top-p, seeded) tokens; stops on an EOS id,
a stop string, or max_new_tokens. Text is streamed as it becomes final: a stop string is never
streamed, not even partly. Timing: time to first token (prefill + first sample) and the time of
every next token.

The loop does no per-step allocation in the cache (static buffers), and on AVX-512 CPUs no
per-layer Python work at all: each step is one call of the fused decode kernel (decode_step.py);
it runs under torch.inference_mode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..attention import attention_block
from ..attention.spans import KeyRows, LayerSoftmax, Run, is_plain, span_attention
from .decode_step import DecodeStep
from .kvcache import KVCache, forward_with_cache
from .tokenizer import IncrementalDecoder, Prompt, encode_prompt


@dataclass
class GenerationResult:
    """What `generate` returns."""

    text: str
    """Generated text (without the prompt, the EOS token or the stop string)."""
    token_ids: list[int]
    """Generated token ids (including a final EOS id if generation ended on one)."""
    prompt_tokens: int
    """Number of prompt tokens that were prefilled."""
    finish_reason: str
    """'eos' (an EOS id), 'stop' (a stop string) or 'length' (max_new_tokens)."""
    time_to_first_token_s: float
    """Seconds from the start of prefill until the first new token was known."""
    token_times_s: list[float] = field(default_factory=list)
    """Seconds each later token took (one decode step each)."""
    step_logits: list[torch.Tensor] | None = None
    """With keep_logits: the float32 logits [vocab] each token was sampled from (for checks)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from a cache (Engine.chat's prefix cache), not prefilled."""

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the prefill (including the first token's sampling)."""
        return self.prompt_tokens / self.time_to_first_token_s if self.time_to_first_token_s > 0 else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        """Mean milliseconds per decode step after the first token (0 if there was none)."""
        return 1000.0 * sum(self.token_times_s) / len(self.token_times_s) if self.token_times_s else 0.0


class Sampler:
    """Next-token choice from float32 logits [vocab]: greedy, or temperature / top-k / top-p.

    The filters apply in transformers' order (temperature, top-k, top-p); a seeded generator makes
    sampled runs reproducible.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = None
        if temperature > 0:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [vocab] float32 -> token id."""
        if self.temperature == 0:
            return int(torch.argmax(logits))
        scores = logits / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # Drop a token once the ones before it already reach top_p; the best one always stays.
            drop = (cumulative - sorted_scores.softmax(-1)) >= self.top_p
            drop[0] = False
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class StopStrings:
    """Finds stop strings in streamed text and holds back any tail that could start one."""

    def __init__(self, stop: str | Sequence[str] | None):
        self.stops = [stop] if isinstance(stop, str) else [s for s in (stop or ()) if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0  # longest tail of pending that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if s.startswith(self.pending[-n:]):
                    keep = n
                    break
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    """One generation as an iterator of text pieces; `.result` is set when it is exhausted."""

    def __init__(self, model, prompt: Prompt, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                 chat: bool | None = None, cache: KVCache | None = None, max_tokens: int | None = None,
                 prefill_chunk: int | None = None, decoder=None, keep_logits: bool = False):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.model = model
        tokenizer = model.tokenizer if isinstance(prompt, str) else _tokenizer_if_any(model)
        self.prompt_ids = encode_prompt(tokenizer, prompt, chat=chat, device=model.device)
        if self.prompt_ids.numel() == 0:
            raise ValueError("the prompt is empty: give at least one token")
        self.max_new_tokens = max_new_tokens
        self.sampler = Sampler(temperature, top_k, top_p, seed, device=model.device)
        self.stop = StopStrings(stop)
        eos = model.config.eos_token_ids if stop_token_ids is None else stop_token_ids
        self.stop_ids = frozenset(int(i) for i in eos)
        if decoder is None:
            if cache is None:
                need = self.prompt_ids.numel() + max_new_tokens
                cache = KVCache.for_model(model.config, max_tokens or need, dtype=model.dtype, device=model.device)
            else:
                cache.check_model(model.config)
                if cache.dtype != model.dtype:
                    raise ValueError(f"KV cache dtype {cache.dtype} differs from the model's {model.dtype}")
            cache.ensure_room(self.prompt_ids.numel(), "the prompt")
            decoder = LocalDecoder(model, cache, prefill_chunk)
        self.decoder = decoder
        self.keep_logits = keep_logits
        self.cache = cache
        self.result: GenerationResult | None = None
        self._state: _GenerationState | None = None
        self._closed = False

    def __iter__(self) -> Iterator[str]:
        try:
            while (piece := self.advance()) is not None:
                if piece:
                    yield piece
        finally:  # also when the caller stops iterating early: other ranks may be waiting
            if not self._closed:
                self.close()

    @property
    def done(self) -> bool:
        """Whether the answer is complete (`result` is set) or was closed."""
        return self.result is not None or self._closed

    def close(self) -> None:
        """End the generation now (idempotent): the decoder releases any rank waiting in it."""
        if not self._closed:
            self._closed = True
            self.decoder.close()

    def advance(self) -> str | None:
        """One step of the generation: the prompt's prefill and first token on the first call, one
        decode step on each later one. Returns the text that became final with it ("" when the
        token completes no character yet, or sits in what may start a stop string), or None once
        the generation is complete (then `result` is set). A scheduler calls this to interleave
        generations with other work one token at a time; iterating the Generation calls it too."""
        if self.result is not None:
            return None
        if self._closed:  # its ranks have left it (a newer question's answer has its rows now)
            raise ValueError("this answer was ended by a newer question on the same engine (or closed); read an "
                             "answer to its end before asking the next")
        if self._state is None:
            return self._first_token()
        state = self._state
        if state.finish is not None:  # the last token's text has gone out: finish
            return self._finish()
        token = self.next_input()
        if token is None:
            return self._finish()
        t = time.perf_counter()
        logits = self.decoder.step(token)[0]
        return self.accept(logits, time.perf_counter() - t)

    def next_input(self) -> int | None:
        """After the first token: the token the next decode step feeds (the last one sampled), or
        None when the generation decodes no more (`advance()` then finishes it). With `accept`, the
        two halves of `advance` for a caller that runs the decode step itself (a batch of
        generations decoded together, runtime/batch.py)."""
        state = self._state
        if state is None or self._closed or self.result is not None or state.finish is not None:
            return None
        if len(state.new_ids) >= self.max_new_tokens or self.decoder.full():
            return None  # a caller-provided cache that is full stops like max_new_tokens
        return state.new_ids[-1]

    def accept(self, logits: torch.Tensor, seconds: float = 0.0) -> str:
        """The decode step's float32 logits [vocab] for `next_input()`'s token: sample the next
        token and return the text it made final (as `advance`); `seconds` is the step's time."""
        self._state.token_times.append(seconds)
        return self._take(self._sample(logits))

    def accept_first(self, logits: torch.Tensor, started: float) -> str:
        """The prompt's prefill, run by the caller (a batch's join prefills a member's question on
        every decode rank): sample the first token from its float32 logits [vocab] and return the
        text it made final (as the first `advance`); `started`: time.perf_counter() when the
        prefill began (the time to the first token counts from it)."""
        if self._state is not None:
            raise RuntimeError("the generation has its first token already")
        state = self._begin()
        token = self._sample(logits)
        state.ttft = time.perf_counter() - started
        return self._take(token)

    def _first_token(self) -> str:
        state = self._begin()
        t0 = time.perf_counter()
        token = self._sample(self.decoder.prefill(self.prompt_ids)[0])
        state.ttft = time.perf_counter() - t0
        return self._take(token)

    def _begin(self) -> _GenerationState:
        tokenizer = _tokenizer_if_any(self.model)
        self._state = _GenerationState(IncrementalDecoder(tokenizer) if tokenizer is not None else None,
                                       [] if self.keep_logits else None)
        return self._state

    def _sample(self, logits: torch.Tensor) -> int:
        if self._state.kept is not None:
            self._state.kept.append(logits.detach().clone())
        return self.sampler(logits)

    def _take(self, token: int) -> str:
        """Record a sampled token; the text it makes final; marks the end where it is one."""
        state = self._state
        state.new_ids.append(token)
        if token in self.stop_ids:
            state.finish = "eos"
            return ""
        piece = ""
        if state.detok is not None:
            piece, stopped = self.stop.feed(state.detok.push(token))
            if stopped:
                state.finish = "stop"
        if piece:
            state.texts.append(piece)
        return piece

    def _finish(self) -> str | None:
        """The text held back until the end (an incomplete character, a possible stop string's
        start), then the result; None when nothing was held back."""
        state = self._state
        finish = state.finish or "length"
        tail = ""
        if state.detok is not None and finish != "stop":
            piece, stopped = self.stop.feed(state.detok.flush())
            tail = piece + ("" if stopped else self.stop.flush())
            finish = "stop" if stopped else finish
            if tail:
                state.texts.append(tail)
        self.result = GenerationResult("".join(state.texts), state.new_ids, int(self.prompt_ids.numel()), finish,
                                       state.ttft, state.token_times, state.kept)
        return tail if tail else None


@dataclass
class _GenerationState:
    """What a Generation has produced so far (set up by its first step)."""

    detok: IncrementalDecoder | None
    kept: list[torch.Tensor] | None
    new_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    ttft: float = 0.0
    finish: str | None = None
    """"eos" or "stop" once the generation has decided to end (its last text may still be due)."""


class LocalDecoder:
    """Prompt prefill and decode steps on this process's own KVCache (the default of `Generation`).

    The interface a decoder gives `Generation`: prefill(ids [T]) -> float32 logits [1, vocab] of
    the last prompt token; step(token) -> logits of the next position; full() -> no room for a
    step; close() when the generation ends (also early).
    """

    def __init__(self, model, cache: KVCache, prefill_chunk: int | None = None):
        self.model, self.cache, self.prefill_chunk = model, cache, prefill_chunk
        self._step: DecodeStep | None = None

    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            # Long prompts in chunks bound the activation memory (each chunk attends to the cache).
            # Every chunk rotates as the whole prompt does (LongRoPE's factors, DCA's length factor).
            chunks = token_ids.split(self.prefill_chunk or token_ids.numel())
            end = self.cache.length + token_ids.numel()
            for chunk in chunks[:-1]:
                forward_with_cache(self.model, chunk, self.cache, logits="none", sequence_end=end)
            return forward_with_cache(self.model, chunks[-1], self.cache, sequence_end=end)

    def step(self, token: int) -> torch.Tensor:
        if self._step is None:  # after the prompt: the fused CPU kernel where it applies
            self._step = DecodeStep(self.model, self.cache)
        with torch.inference_mode():
            return self._step(token)

    def full(self) -> bool:
        return self.cache.length >= self.cache.max_tokens

    def close(self) -> None:
        pass


def generate(model, prompt: Prompt, *, on_text: Callable[[str], None] | None = None, **kwargs) -> GenerationResult:
    """Generate a continuation of `prompt` with `model`.

    Args:
        prompt: text, chat messages [{"role", "content"}], or token ids.
        max_new_tokens: upper bound on new tokens (default 256).
        temperature: 0 for greedy (default), else sampling temperature.
        top_k: keep only the k most likely tokens (0 = off). top_p: nucleus sampling (1.0 = off).
        seed: seed of the sampling generator (None = random).
        stop: a stop string or strings; generation ends when one appears (it is not returned).
        stop_token_ids: ids that end generation (default: the config's EOS ids).
        chat: apply the chat template (default: only for message lists).
        cache: a KVCache to prefill into; if it already holds tokens, the prompt continues that
            sequence (a follow-up turn). Afterwards it holds the prompt and every generated token
            but the last (which was sampled, never fed back): start a follow-up prompt with it.
            Default: a new cache of prompt + max_new_tokens rows (or `max_tokens` rows).
        prefill_chunk: prefill the prompt this many tokens at a time (bounds activation memory for
            long prompts); default: all at once.
        decoder: where the prompt is prefilled and the steps run (default: a `LocalDecoder` on
            `cache`); the engine passes its decoder over a KV cache split across ranks.
        keep_logits: keep the logits of every sampled token in the result (`step_logits`).
        on_text: called with each piece of text as soon as it is final (streaming).

    Returns:
        GenerationResult with text, token ids, finish reason and timings.
    """
    gen = Generation(model, prompt, **kwargs)
    for piece in gen:
        if on_text is not None:
            on_text(piece)
    return gen.result


def stream(model, prompt: Prompt, **kwargs) -> Generation:
    """Like `generate`, but returns an iterator of text pieces; `.result` is set once exhausted."""
    return Generation(model, prompt, **kwargs)


def sequence_logits(model, token_ids) -> torch.Tensor:
    """float32 logits [T, vocab] of one sequence starting at position 0 (single-device attention).

    token_ids: ids (list or LongTensor [T]) or text (encoded with the model's tokenizer as is).
    """
    tokenizer = model.tokenizer if isinstance(token_ids, str) else None
    ids = encode_prompt(tokenizer, token_ids, chat=False, device=model.device)
    if ids.numel() == 0:
        raise ValueError("logits of an empty sequence: give at least one token")
    with torch.inference_mode():
        positions = torch.arange(ids.numel(), device=model.device)
        return model(ids, positions, OneSequence(model), logits="all")


class OneSequence:
    """The `attend` of one whole sequence from position 0 with no cache: causal attention as each
    layer says, and a linear-attention layer from its zero state."""

    def __init__(self, model):
        self.model = model

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, self.model.layer_softmax(layer))

    def mix_linear(self, layer: int, module, x: torch.Tensor) -> torch.Tensor:
        return module.forward(x)[0]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax: LayerSoftmax) -> torch.Tensor:
    """Causal self-attention of one sequence from position 0 (no cache to fill), as the layer says."""
    if is_plain(softmax):
        return attention_block(q, k, v, causal=True, softmax_scale=softmax.scale)[0]
    runs = [Run(0, 0, q.shape[0])]
    return softmax.finish(*span_attention(q, runs, [KeyRows(k, v, runs)], softmax))


def _tokenizer_if_any(model):
    """The model's tokenizer, or None when it has none or none can be built (token-id prompts then
    generate token ids, with no text pieces)."""
    try:
        return model.tokenizer
    except ValueError:
        return None
