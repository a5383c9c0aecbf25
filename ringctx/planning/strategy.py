"""Choosing ring pass-KV or pass-Q (paper Eq. 1-3, Algorithms 1 and 5), and the cost model.

Notation (paper): T new tokens, P cached tokens, N = cp_size ranks, NH query heads, NKV KV heads,
DH head dim, D = NH*DH, e bytes per element, C peak FLOP/s per rank, BW bytes/s per rank. Miss
rate m = T/(T+P). Under tensor parallelism of TP GPUs every GPU runs its own ring over its heads,
so NH and NKV are the heads of one GPU (`local_heads`): the ratio NKV/NH is the model's, except
when TP > NKV and the KV heads are replicated (one KV head for NH/TP query heads: TP/NH).

Rules of `choose_strategy`:
- ``alg1``  (Algorithm 1): pass-KV if T >= N*C*NKV*e/(2*NH*BW) (Eq. 2) or m >= 2*NKV/NH (Eq. 1).
- ``alg5``  (Algorithm 5, the default): pass-KV if T >= N*C*NKV*e/(2*NH*BW)
            or m >= 2*NKV/NH - 4*T*BW/(N*C*e) * (1 - m/2)  (the All2All of pass-Q counted; the
            factor 1 - m/2 counts the causal half of the new tokens' own block as not computed).
- ``empirical``: pass-KV if h = a*ln T + b*ln m + c > 0, coefficients from the hardware profile.
- ``cost``: the strategy with the smaller predicted attention time of the cost model below.

C in the thresholds is the profile's peak FLOP/s, as in the paper (`threshold_flops`); the cost
model runs on the achieved rate (peak * achieved_fraction, or calibrated tables).

The cost model (`predict_strategy_cost`) prices one prefill chunk per layer and per ring step:
SendRecv of a message (latency + bytes/BW) overlapped with the attention of the block at hand,
the un-overlapped All2All of pass-Q, the linear layers, the two tensor-parallel all-reduces and a
fixed cost per layer. It agrees with Algorithm 5 where Algorithm 5 was derived (pass-Q's ring
hidden, Eq. 3) and the cost model's C is the thresholds' C. Where nothing hides, pass-Q's All2All
returns as many bytes as its ring carried, so the model's crossover falls to m ~ NKV/NH while
Algorithms 1 and 5 keep 2*NKV/NH: between the two the "cost" rule picks pass-KV, they pass-Q.

`fit_empirical_rule` fits h(T, P) by logistic regression to labelled (T, P) samples: to
Algorithm 5's decisions for the built-in defaults, to measured winners during calibration.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from ringctx.attention.spans import Span
from ringctx.model.config import LinearShape, ModelConfig
from ringctx.model.presets import get_preset
from ringctx.parallel.ring import PASS_KV, PASS_Q, STRATEGIES
from ringctx.planning.hardware import (
    EmpiricalRuleCoefficients, HardwareProfile, canonical_dtype, element_bytes, load_profile,
)
from ringctx.planning.linear_attention import (
    SummaryExchange, delta_rule_flops_per_token, linear_layer_shapes, projection_params, summary_exchange,
)

RULES = ("alg1", "alg5", "empirical", "cost")
"""Names accepted by `choose_strategy(rule=...)`."""

LSE_BYTES = 4
"""Bytes of one log-sum-exp value: partial LSEs travel as float32 (docs/CONTRACTS.md)."""


# ----------------------------------------------------------------------------- threshold formulas


def miss_rate(new_tokens: int, cached_tokens: int) -> float:
    """KV-cache miss rate m = T/(T+P)."""
    return new_tokens / (new_tokens + cached_tokens)


def message_size_threshold(n_heads: int, n_kv_heads: int) -> float:
    """Eq. 1: pass-Q sends fewer bytes than pass-KV iff m = T/(T+P) <= 2*NKV/NH.

    Per step pass-KV sends K and V of (T+P)/N tokens at NKV heads, 2*(T+P)/N*NKV*DH*e bytes, and
    pass-Q sends Q of T/N tokens at NH heads, T/N*NH*DH*e bytes.
    """
    return 2 * n_kv_heads / n_heads


def pass_kv_compute_threshold(cp_size: int, flops: float, n_heads: int, n_kv_heads: int,
                              elem_bytes: int, bandwidth: float) -> float:
    """Eq. 2: pass-KV's SendRecv hides under attention compute iff T >= N*C*NKV*e/(2*NH*BW).

    From 4*(T/N)*((T+P)/N)*D/C >= 2*((T+P)/N)*D*(NKV/NH)*e/BW (compute per step >= KV transfer).
    """
    return cp_size * flops * n_kv_heads * elem_bytes / (2 * n_heads * bandwidth)


def pass_q_context_threshold(cp_size: int, flops: float, elem_bytes: int, bandwidth: float) -> float:
    """Eq. 3: pass-Q's ring SendRecv hides under compute iff T+P >= N*e*C/(4*BW).

    From 4*(T/N)*((T+P)/N)*D/C >= (T/N)*D*e/BW.
    """
    return cp_size * elem_bytes * flops / (4 * bandwidth)


def alg5_miss_rate_threshold(new_tokens: int, cached_tokens: int, cp_size: int, flops: float, n_heads: int,
                             n_kv_heads: int, elem_bytes: int, bandwidth: float) -> float:
    """Algorithm 5's miss-rate threshold 2*NKV/NH - 4*T*BW/(N*C*e) * (1 - m/2), below Algorithm 1's 2*NKV/NH.

    Pass-KV wins when its exposed KV transfer costs no more than pass-Q's All2All (~T*D*e/BW):
        2*(T+P)*D*(NKV/NH)*e/BW <= T*D*e/BW + attention FLOPs / (N*C).
    The paper counts the attention FLOPs as 4*T*(T+P)*D, the new tokens' own T x T block in full,
    and gets 2*NKV/NH - 4*T*BW/(N*C*e). That block is causal: half of it is masked and never
    computed (`attention_flops` = 4*T*(T+P)*D*(1 - m/2)), so less compute hides the KV transfer:
    the subtracted term shrinks by the factor (1 - m/2) and the threshold rises. It changes nothing when
    P >> T (m -> 0); it is what decides the paper's CP4 partial prefill of 3200 new tokens on a
    124,800-token cache (m = 2.5%, where the paper's form gives exactly 0.125 - 0.1 = m, a tie that
    Algorithm 5's >= hands to pass-KV) for pass-Q, the faster one in the paper's measurements.
    """
    m = miss_rate(new_tokens, cached_tokens)
    all2all_vs_compute = 4 * new_tokens * bandwidth / (cp_size * flops * elem_bytes)
    return message_size_threshold(n_heads, n_kv_heads) - all2all_vs_compute * (1 - m / 2)


def threshold_flops(hw: HardwareProfile, dtype: str, cp_size: int) -> float:
    """C of Eq. 2/3 and Algorithms 1/5: the peak FLOP/s of one rank, as the paper uses it.

    peak_flops[dtype] times the ring's compute scale (1 on GPUs; ranks sharing a CPU host get
    their share of it). Not the achieved rate the cost model runs on: the paper derives its
    thresholds from peak C and BW, and with an achieved C (63% of peak on the paper's H100s) the
    Eq. 2 threshold of its CP4 x TP8 Llama3-405B runs drops from 4000 to 2520 tokens, so a
    3200-token follow-up on a 128K context would run pass-KV where the paper finds pass-Q faster.
    """
    return hw.peak(dtype) * hw.ring(cp_size).compute_scale


# ----------------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class StrategyChoice:
    """Which ring strategy to run for one (chunk of a) prefill, why, and the numbers behind it."""

    strategy: str
    """"pass-kv" or "pass-q"."""
    rule: str
    """The rule that decided: "alg1", "alg5", "empirical" or "cost"."""
    reason: str
    """A sentence naming the condition that fired, with its numbers (and the heads per TP rank
    when TP > 1)."""
    new_tokens: int
    """T: tokens of this prefill (chunk) whose KV is new."""
    cached_tokens: int
    """P: tokens already in the KV cache that the new tokens attend to."""
    cp_size: int
    """N: ranks in the ring."""
    tp_size: int
    """TP: tensor-parallel GPUs per CP rank; each runs its own ring over its heads."""
    n_heads: int
    """NH in the formulas: query heads of one GPU, the model's / TP."""
    n_kv_heads: int
    """NKV in the formulas: KV heads of one GPU, the model's / TP, or 1 when TP > NKV replicates them."""
    miss_rate: float
    """m = T/(T+P)."""
    message_size_threshold: float
    """Eq. 1: 2*NKV/NH; pass-Q's message is smaller when m is below it."""
    compute_threshold_tokens: float
    """Eq. 2: N*C*NKV*e/(2*NH*BW); pass-KV's transfer hides under compute when T is at least this."""
    alg5_miss_rate_threshold: float
    """Algorithm 5: 2*NKV/NH - 4*T*BW/(N*C*e) * (1 - m/2) (see `alg5_miss_rate_threshold`)."""
    pass_q_context_threshold_tokens: float
    """Eq. 3: N*e*C/(4*BW); pass-Q's ring transfer hides under compute when T+P is at least this."""
    empirical_score: float | None
    """h(T, P) of the empirical rule when that rule decided, else None."""
    peak_flops: float
    """C: peak FLOP/s of one rank used in the formulas (`threshold_flops`)."""
    bandwidth_bytes_per_s: float
    """BW: bytes/s per rank used in the formulas (the ring's bandwidth in the profile)."""
    element_bytes: int
    """e: bytes per element of the attention dtype."""
    short_reason: str = ""
    """The reason in under 60 characters for a table cell: the condition that decided, its numbers
    and the verdict, e.g. "Eq.2: T=4096 >= 1713 -> pass-KV" (the constants are in `formula`)."""
    formula: str = ""
    """The rule with its constants (N, C, BW, e, NH, NKV), the same for every chunk of a prefill:
    printed once below a table of short reasons."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


DUAL_CHUNK_PASS_KV = ("dual chunk attention: pass-KV (ring_attention declines pass-Q for DCA layers, whose "
                      "queries would travel in three rotations)")
"""Why a model with Dual Chunk Attention layers runs pass-KV whatever the rule says (the one policy)."""


def pass_kv_only(model: "ModelConfig") -> str | None:
    """The reason `model` must run pass-KV (DUAL_CHUNK_PASS_KV for DCA layers), or None: both run."""
    return DUAL_CHUNK_PASS_KV if model.has_dual_chunk else None


def choose_strategy(new_tokens: int, cached_tokens: int, model: "ModelConfig | str", cp_size: int,
                    hardware: "HardwareProfile | str", rule: str = "alg5", *, dtype: str = "bfloat16",
                    tp_size: int = 1, max_cached_per_rank: int | None = None) -> StrategyChoice:
    """Pick pass-KV or pass-Q for T = `new_tokens` new and P = `cached_tokens` cached tokens.

    `model` is a ModelConfig or preset name; `hardware` a profile or a profile name/path, giving
    C = `threshold_flops` (the peak, as in the paper) and BW = the ring's bandwidth. Under TP of
    `tp_size` every GPU runs its own ring over its heads, so the formulas take the heads of one GPU
    (`local_heads`): FLOP/s and bytes per GPU scale alike, and the ratio NKV/NH is the model's
    unless TP > NKV replicates the KV heads (then it is TP/NH, the KV messages relatively larger).
    `max_cached_per_rank` only matters to the "cost" rule (see `predict_strategy_cost`). With
    N = 1 there is no ring; the rule still runs and its reason says the choice has no effect.
    """
    model = get_preset(model) if isinstance(model, str) else model
    hardware = load_profile(hardware)
    validate_ring_inputs(new_tokens, cached_tokens, cp_size)
    local_heads(model, tp_size)  # a clear error for a TP size that cannot split the heads
    if rule not in RULES:
        raise ValueError(f"unknown strategy rule {rule!r}; use one of {', '.join(RULES)}")
    dtype = canonical_dtype(dtype)
    numbers = _threshold_numbers(new_tokens, cached_tokens, model, cp_size, tp_size, hardware, dtype)
    if rule == "alg1":
        strategy, reason = _decide_alg1(numbers)
    elif rule == "alg5":
        strategy, reason = _decide_alg5(numbers)
    elif rule == "empirical":
        strategy, reason, score = _decide_empirical(numbers, model, hardware, dtype)
        numbers = dataclasses.replace(numbers, empirical_score=score)
    else:
        costs = predict_costs(new_tokens, cached_tokens, model, cp_size, hardware, tp_size=tp_size,
                              dtype=dtype, max_cached_per_rank=max_cached_per_rank)
        strategy, reason = _decide_cost(costs)
    overruled = strategy == PASS_Q and pass_kv_only(model)
    if overruled:
        strategy, reason = PASS_KV, f"{pass_kv_only(model)}; the rule said: {reason}"
    numbers = dataclasses.replace(numbers, strategy=strategy, rule=rule)
    short, formula = _short_reason(numbers, costs if rule == "cost" else None), _formula(numbers, hardware)
    if overruled:
        short = "dual chunk attention -> pass-KV"
    reason += tp_heads_note(model, tp_size)
    formula += tp_heads_note(model, tp_size)
    if cp_size == 1:
        reason += " (cp_size=1: no ring, both strategies run the same local attention)"
        short = f"N=1, no ring: {short}"
    return dataclasses.replace(numbers, reason=reason, short_reason=short, formula=formula)


def validate_ring_inputs(new_tokens: int, cached_tokens: int, cp_size: int) -> None:
    """ValueError unless T >= 1, P >= 0 and N >= 1 are integers."""
    for name, value, least in (("new_tokens (T)", new_tokens, 1), ("cached_tokens (P)", cached_tokens, 0),
                               ("cp_size (N)", cp_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def tp_heads_note(model: ModelConfig, tp_size: int) -> str:
    """The end of a decision's reason under TP: the heads of one GPU the formulas used ("" at TP 1)."""
    if tp_size == 1:
        return ""
    heads, kv_heads = local_heads(model, tp_size)
    note = (f"; heads per TP rank (TP {tp_size}): NH={heads}, NKV={kv_heads} "
            f"of the model's {model.n_heads}/{model.n_kv_heads}")
    if tp_size > model.n_kv_heads:
        note += (f" (TP > NKV: each GPU keeps a replica of one KV head for its {heads} query heads, "
                 f"so NKV/NH = {tp_size}/{model.n_heads}, not {model.n_kv_heads}/{model.n_heads})")
    return note


def _threshold_numbers(T: int, P: int, model: ModelConfig, N: int, tp_size: int, hw: HardwareProfile,
                       dtype: str) -> StrategyChoice:
    """Every number of Eq. 1-3 and Algorithm 5 for this case, per GPU (strategy/rule/reason blank)."""
    C, BW, e = threshold_flops(hw, dtype, N), hw.ring(N).bandwidth_bytes_per_s, element_bytes(dtype)
    NH, NKV = ring_heads(model, tp_size)
    return StrategyChoice(
        strategy="", rule="", reason="", new_tokens=T, cached_tokens=P, cp_size=N, tp_size=tp_size,
        n_heads=NH, n_kv_heads=NKV, miss_rate=miss_rate(T, P),
        message_size_threshold=message_size_threshold(NH, NKV),
        compute_threshold_tokens=pass_kv_compute_threshold(N, C, NH, NKV, e, BW),
        alg5_miss_rate_threshold=alg5_miss_rate_threshold(T, P, N, C, NH, NKV, e, BW),
        pass_q_context_threshold_tokens=pass_q_context_threshold(N, C, e, BW),
        empirical_score=None, peak_flops=C, bandwidth_bytes_per_s=BW, element_bytes=e,
    )


def _compute_clause(n: StrategyChoice, op: str) -> str:
    return (f"T={n.new_tokens} {op} {n.compute_threshold_tokens:.0f} tokens "
            f"(Eq. 2, N*C*NKV*e/(2*NH*BW) with N={n.cp_size}, C={n.peak_flops:.3g} FLOP/s (peak), "
            f"BW={n.bandwidth_bytes_per_s:.3g} B/s, e={n.element_bytes}, NH={n.n_heads}, NKV={n.n_kv_heads})")


def _decide_alg1(n: StrategyChoice) -> tuple[str, str]:
    if n.new_tokens >= n.compute_threshold_tokens:
        return PASS_KV, f"alg1: pass-KV because {_compute_clause(n, '>=')}: the KV SendRecv hides under attention"
    if n.miss_rate >= n.message_size_threshold:
        return PASS_KV, (f"alg1: pass-KV because miss rate T/(T+P)={n.miss_rate:.4g} >= "
                         f"{n.message_size_threshold:.4g} (Eq. 1, 2*NKV/NH): KV messages are the smaller ones")
    return PASS_Q, (f"alg1: pass-Q because {_compute_clause(n, '<')} and miss rate T/(T+P)={n.miss_rate:.4g} < "
                    f"{n.message_size_threshold:.4g} (Eq. 1, 2*NKV/NH): Q messages are smaller")


def _decide_alg5(n: StrategyChoice) -> tuple[str, str]:
    if n.new_tokens >= n.compute_threshold_tokens:
        return PASS_KV, f"alg5: pass-KV because {_compute_clause(n, '>=')}: the KV SendRecv hides under attention"
    threshold = (f"{n.alg5_miss_rate_threshold:.4g} (Alg. 5, 2*NKV/NH - 4*T*BW/(N*C*e)*(1-m/2) = "
                 f"{n.message_size_threshold:.4g} - {n.message_size_threshold - n.alg5_miss_rate_threshold:.4g})")
    if n.miss_rate >= n.alg5_miss_rate_threshold:
        return PASS_KV, (f"alg5: pass-KV because miss rate T/(T+P)={n.miss_rate:.4g} >= {threshold}: "
                         f"its exposed KV transfer costs less than pass-Q's All2All")
    return PASS_Q, (f"alg5: pass-Q because {_compute_clause(n, '<')} and miss rate T/(T+P)={n.miss_rate:.4g} < "
                    f"{threshold}: pass-Q's All2All costs less than pass-KV's exposed KV transfer")


def _short_reason(n: StrategyChoice, costs: "dict[str, StrategyCost] | None" = None) -> str:
    """The deciding condition in about 32 characters, e.g. "Eq.2: T=4096 >= 1713 -> pass-KV" or
    "Alg.5: m=0.0039 < 0.21 -> pass-Q" (pass-Q also had T below Eq. 2's threshold: see `formula`)."""
    verdict = "pass-KV" if n.strategy == PASS_KV else "pass-Q"
    if n.rule == "empirical":
        return f"h(T,m)={n.empirical_score:.3g} {'>' if n.strategy == PASS_KV else '<='} 0 -> {verdict}"
    if n.rule == "cost":
        kv, q = costs[PASS_KV].attention_s * 1e3, costs[PASS_Q].attention_s * 1e3
        return f"cost: {kv:.3g} vs {q:.3g} ms/layer -> {verdict}"
    if n.new_tokens >= n.compute_threshold_tokens:
        return f"Eq.2: T={n.new_tokens} >= {n.compute_threshold_tokens:.0f} -> {verdict}"
    label, threshold = (("Eq.1", n.message_size_threshold) if n.rule == "alg1"
                        else ("Alg.5", n.alg5_miss_rate_threshold))
    return f"{label}: m={n.miss_rate:.2g} {'>=' if n.miss_rate >= threshold else '<'} {threshold:.2g} -> {verdict}"


def _formula(n: StrategyChoice, hw: HardwareProfile) -> str:
    """The rule of `n` with its constants, the same for every chunk of one setting."""
    constants = (f"N={n.cp_size}, C={n.peak_flops:.3g} FLOP/s (peak), BW={n.bandwidth_bytes_per_s:.3g} B/s, "
                 f"e={n.element_bytes}, NH={n.n_heads}, NKV={n.n_kv_heads}")
    eq2 = f"T >= N*C*NKV*e/(2*NH*BW) = {n.compute_threshold_tokens:.0f} (Eq. 2)"
    if n.rule == "alg1":
        return f"alg1: pass-KV if {eq2} or m=T/(T+P) >= 2*NKV/NH = {n.message_size_threshold:.4g} (Eq. 1); {constants}"
    if n.rule == "alg5":
        return (f"alg5: pass-KV if {eq2} or m=T/(T+P) >= 2*NKV/NH - 4*T*BW/(N*C*e)*(1-m/2) (Alg. 5, "
                f"2*NKV/NH = {n.message_size_threshold:.4g}); {constants}")
    if n.rule == "empirical":
        return (f"empirical: pass-KV if h = a*ln T + b*ln m + c > 0, m=T/(T+P), coefficients of profile "
                f"{hw.name!r} (or fitted to alg5); {constants}")
    return (f"cost: the strategy with the smaller predicted attention time per layer (ring steps, exposed "
            f"transfers, pass-Q's All2All) on profile {hw.name!r}")


def _decide_empirical(n: StrategyChoice, model: ModelConfig, hw: HardwareProfile, dtype: str):
    # coefficients are matched by the ratio NKV/NH of one GPU, which TP > NKV changes
    coeffs = hw.empirical_rule_for(n.n_heads, n.n_kv_heads, n.cp_size, dtype)
    origin = f"{coeffs.source} coefficients of profile {hw.name!r}" if coeffs else None
    if coeffs is None:
        coeffs = fit_empirical_rule_to_alg5(model, n.cp_size, hw, dtype, tp_size=n.tp_size)
        origin = (f"profile {hw.name!r} has no coefficients for NKV/NH={n.n_kv_heads}/{n.n_heads}, "
                  f"N={n.cp_size}, {dtype}: fitted to alg5 now")
    h = coeffs.score(n.new_tokens, n.cached_tokens)
    formula = (f"h = {coeffs.a:.4g}*ln({n.new_tokens}) + {coeffs.b:.4g}*ln({n.miss_rate:.4g}) + {coeffs.c:.4g} "
               f"= {h:.4g}")
    strategy = PASS_KV if h > 0 else PASS_Q
    verdict = "pass-KV because" if h > 0 else "pass-Q because"
    return strategy, f"empirical: {verdict} {formula} {'>' if h > 0 else '<='} 0 ({origin})", h


def _decide_cost(costs: dict[str, "StrategyCost"]) -> tuple[str, str]:
    # the fixed costs of a layer (TP all-reduces, launches) are the same for both strategies, so
    # the attention time decides; the per-message latencies of the ring and the All2All are in it
    kv, q = costs[PASS_KV], costs[PASS_Q]
    strategy = PASS_KV if kv.attention_s <= q.attention_s else PASS_Q
    winner = "pass-KV" if strategy == PASS_KV else "pass-Q"
    return strategy, (f"cost: {winner} predicted faster, attention per layer {kv.attention_s * 1e3:.4g} ms "
                      f"(pass-KV, exposed comm {kv.exposed_comm_s * 1e3:.4g} ms) vs {q.attention_s * 1e3:.4g} ms "
                      f"(pass-Q, exposed comm incl. All2All {q.exposed_comm_s * 1e3:.4g} ms)")


# ----------------------------------------------------------------------------- cost model: formulas


def tokens_per_rank(tokens: int, cp_size: int) -> int:
    """New-token rows of the fullest rank under load-balanced sharding (ring messages pad to it).

    The T tokens are cut into 2N chunks of c = ceil(T/(2N)) (the last ones short or empty) and
    rank i holds chunks i and 2N-1-i (ShardLayout.balanced). This is ceil(T/N) when 2N divides T,
    the paper's figure, and at most one row more otherwise.
    """
    chunk = -(-tokens // (2 * cp_size))

    def chunk_len(j: int) -> int:
        return max(0, min(chunk, tokens - j * chunk))

    return max(chunk_len(i) + chunk_len(2 * cp_size - 1 - i) for i in range(cp_size))


def local_heads(model: ModelConfig, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on one GPU under tensor parallelism of `tp_size`.

    Query heads are split (tp_size must divide NH); KV heads are split when tp_size divides NKV,
    else replicated so each GPU keeps one (tp_size must then be a multiple of NKV).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    NH, NKV = model.n_heads, model.n_kv_heads
    if NH % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the {NH} query heads of {model.name}; "
                         f"use a divisor of {NH}")
    if NKV % tp_size and tp_size % NKV:
        raise ValueError(f"tp_size={tp_size} neither divides nor is a multiple of the {NKV} KV heads of {model.name}")
    if model.ffn_dim % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide ffn_dim={model.ffn_dim} of {model.name}")
    return NH // tp_size, max(1, NKV // tp_size)


def ring_heads(model: ModelConfig, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on one GPU of the layers that ring (full and dual chunk ones; windowed
    and chunked layers exchange a few rows): the NH and NKV of Eq. 1-3 and Algorithm 5. The model's
    (`local_heads`) unless those layers have their own KV heads (Gemma 4 31B's full layers: 4 where
    the model's are 16), then theirs (the most common count among them). Head widths cancel in
    every ratio: a layer's q and K/V heads share one. A hybrid's linear-attention layers take no
    ring and are left out (Qwen3.5: the NKV of its 1-in-4 full layers)."""
    NH, NKV = local_heads(model, tp_size)
    counts: dict[int, int] = {}
    for layer in model.attention_layers:  # a hybrid's linear layers take no ring
        if model.attention(layer).span.sees_everything:
            kv = model.kv_heads_of(layer)
            counts[kv] = counts.get(kv, 0) + 1
    if counts:
        NKV = max(1, max(counts, key=counts.get) // tp_size)
    return NH, NKV


def cached_rows_per_rank(cached_tokens: int, cp_size: int) -> int:
    """ceil(P/N): cache rows of the fullest rank when a cache is split evenly (ShardLayout default)."""
    return -(-cached_tokens // cp_size)


def pass_kv_message_bytes(max_cached_per_rank: int, new_tokens: int, cp_size: int, kv_heads: int,
                          head_dim: int, elem_bytes: int) -> int:
    """Bytes of one pass-KV SendRecv message: 2 * (max_i(P_i) + n) * NKV * DH * e, n = tokens_per_rank(T, N).

    K and V of the largest shard (messages must be equal-sized, shorter ones are padded).
    """
    return 2 * (max_cached_per_rank + tokens_per_rank(new_tokens, cp_size)) * kv_heads * head_dim * elem_bytes


def pass_q_message_bytes(new_tokens: int, cp_size: int, heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of one pass-Q SendRecv message: n * NH * DH * e, n = tokens_per_rank(T, N) (~ceil(T/N))."""
    return tokens_per_rank(new_tokens, cp_size) * heads * head_dim * elem_bytes


def all2all_bytes_per_rank(new_tokens: int, cp_size: int, heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes one rank sends in pass-Q's All2All: (N-1) * n * NH * (DH*e + 4), n = tokens_per_rank(T, N).

    Partial outputs (DH elements of e bytes) and one float32 LSE per head and token go back to the
    N-1 ranks owning the queries: as many output bytes as the Q ring carried. The paper writes the
    cost as (N-1)*(D+1)*T*e/BW, counting all T tokens; one rank holds only T/N of them, so per
    rank the volume is 1/N of that, with a float32 LSE per head instead of one e-byte value.
    """
    return (cp_size - 1) * tokens_per_rank(new_tokens, cp_size) * heads * (head_dim * elem_bytes + LSE_BYTES)


def attention_flops(new_tokens: int, cached_tokens: int, attn_dim: int) -> int:
    """Attention FLOPs of T new tokens over P cached + T new keys: 4*T*D*(P + T/2) = 2*T*D*(2P + T).

    4*T*D*(T+P) (QK^T and PV, 2 FLOPs per multiply-add) with the causal new-new part halved;
    D = heads * DH of the heads computed (local heads under TP).
    """
    return 2 * new_tokens * attn_dim * (2 * cached_tokens + new_tokens)


def visible_keys(first: int, stop: int, span: Span) -> int:
    """Keys that the tokens at positions first..stop-1 see in all, under `span`: sum of p + 1 (full),
    min(p + 1, W) (a window), (p mod C) + 1 (chunks), the smaller of the two with both."""
    def capped_run(lo: int, hi: int, offset: int) -> int:
        """sum over p in [lo, hi) of min(p - offset + 1, W or no cap)."""
        if hi <= lo:
            return 0
        a, b = lo - offset + 1, hi - offset  # the uncapped values run a..b
        if span.window and b > span.window:
            capped = max(0, b - max(a, span.window + 1) + 1)  # values above W count W each
            b2 = min(b, span.window)
            below = (a + b2) * (b2 - a + 1) // 2 if b2 >= a else 0
            return below + capped * span.window
        return (a + b) * (b - a + 1) // 2

    if not span.chunk:
        return capped_run(first, stop, 0)
    total, p = 0, first
    while p < stop:
        start = p - p % span.chunk
        end = min(stop, start + span.chunk)
        total += capped_run(p, end, start)
        p = end
    return total


def span_attention_flops(new_tokens: int, cached_tokens: int, attn_dim: int, span: Span) -> int:
    """Attention FLOPs of T new tokens after P cached ones in a layer with `span`: 4*D per key
    seen (attention_flops for a full span, up to its halved diagonal's rounding)."""
    if span.sees_everything:  # full, or dual chunk (every key once, through one of three query rotations)
        return attention_flops(new_tokens, cached_tokens, attn_dim)
    return 4 * attn_dim * visible_keys(cached_tokens, cached_tokens + new_tokens, span)


def linear_params_per_layer(model: ModelConfig) -> int:
    """Weights of one block's matmuls that a token goes through: Q,K,V,O projections (and the
    output gate's, Qwen3.5's) or a linear-attention layer's projections (`projection_params`), and
    the SwiGLU MLP (gate, up, down), or of a mixture of experts the router and the experts_per_token
    experts a token reaches (`ModelConfig.ffn_params(active=True)`: time follows the active weights,
    memory all of them); the mean over the layers when layers differ (n_layers times it is their sum)."""
    gate = 1 if model.attn_output_gate else 0
    attention = sum(projection_params(model.linear(i), model.dim) if model.linear(i) is not None
                    else model.dim * ((1 + gate) * model.n_heads + 2 * h) * d + model.n_heads * d * model.dim
                    for i, (h, d) in enumerate(model.kv_shapes))
    ffn = sum(model.ffn_params(i, active=True) for i in range(model.n_layers))
    return (attention + ffn) // model.n_layers


def layer_widths(model: ModelConfig, tp_size: int, layer: int) -> tuple[int, int]:
    """(NH_local * DH, NKV_local * DH) of layer `layer` on one GPU: the width its attention FLOPs
    and its K/V messages scale with (a layer may have its own head shape); (0, 0) for a
    linear-attention layer, which has no attention heads (`linear_attention.py` prices it)."""
    if model.linear(layer) is not None:
        return 0, 0
    heads, _ = local_heads(model, tp_size)
    kv_heads, head_dim = model.kv_shapes[layer]
    return heads * head_dim, max(1, kv_heads // tp_size) * head_dim


def widest_kv_width(model: ModelConfig, tp_size: int) -> int:
    """The widest layer's NKV_local * DH (`layer_widths`): what a buffer of one layer's K or V rows
    is sized for."""
    return max(layer_widths(model, tp_size, layer)[1] for layer in range(model.n_layers))


def linear_flops(tokens: int, model: ModelConfig, tp_size: int) -> int:
    """FLOPs of one block's linear layers for `tokens` tokens on one GPU: 2 * tokens * params / TP."""
    return 2 * tokens * linear_params_per_layer(model) // tp_size


def transfer_seconds(nbytes: int, bandwidth: float, latency_s: float, messages: int = 1) -> float:
    """Time to send `nbytes` in `messages` messages: messages * latency + bytes / BW (0 if nothing)."""
    if nbytes == 0 and messages == 0:
        return 0.0
    return messages * latency_s + nbytes / bandwidth


TP_ALLREDUCES_PER_LAYER = 2
"""All-reduces of one decoder layer under TP: after the attention output projection and after the
MLP down projection (row-parallel layers each sum partial products over the TP GPUs)."""


def allreduce_bus_bytes(buffer_bytes: float, group_size: int) -> float:
    """Bytes one member sends in an all-reduce of a `buffer_bytes` buffer: 2*(G-1)/G * buffer_bytes.

    A ring all-reduce is a reduce-scatter then an all-gather, each passing (G-1)/G of the buffer
    through every member's link (NCCL's "bus bandwidth" counts the same); 0 when G = 1.
    """
    return 2 * (group_size - 1) / group_size * buffer_bytes


def tp_allreduce_bytes(tokens: int, dim: int, elem_bytes: int, tp_size: int) -> float:
    """Bytes one GPU moves in one all-reduce of `tokens` activation rows: 2*(TP-1)/TP * tokens*dim*e."""
    return allreduce_bus_bytes(tokens * dim * elem_bytes, tp_size)


def tp_allreduce_seconds(tokens: int, model: ModelConfig, tp_size: int, hw: HardwareProfile, elem_bytes: int) -> float:
    """One TP all-reduce of `tokens` rows: tp_latency + tp_allreduce_bytes / tp_bandwidth (`tp_link`); 0 at TP 1."""
    if tp_size == 1:
        return 0.0
    latency, bandwidth = hw.tp_link()
    return latency + tp_allreduce_bytes(tokens, model.dim, elem_bytes, tp_size) / bandwidth


def overlapped_seconds(compute_s: float, comm_s: float, overlap: float = 1.0) -> float:
    """One ring step: compute + comm - overlap * min(compute, comm).

    overlap = 1: max(compute, comm) (the transfer hides under compute or vice versa); overlap = 0:
    compute + comm (e.g. CPU ranks whose transfer copies compete with compute for the cores).
    """
    return compute_s + comm_s - overlap * min(compute_s, comm_s)


def ring_seconds(compute_step_s: float, comm_step_s: float, cp_size: int, overlap: float = 1.0) -> float:
    """Ring of N compute steps with the N-1 SendRecvs overlapped: (N-1)*max(comp, comm) + comp.

    Step s computes on the block at hand while the next block is in flight; the last step only
    computes. With overlap < 1 a step costs `overlapped_seconds(comp, comm, overlap)` instead.
    """
    return (cp_size - 1) * overlapped_seconds(compute_step_s, comm_step_s, overlap) + compute_step_s


def attention_seconds_per_rank(new_tokens: int, cached_tokens: int, cp_size: int, attn_dim: int,
                               hw: HardwareProfile, dtype: str, compute_scale: float = 1.0) -> float:
    """Attention compute of one layer on the slowest rank, summed over its N ring steps.

    Follows the attention calls of `ShardLayout.block_tasks` for one sequence of T new tokens in
    2N chunks of c = T/(2N) and P/N cached tokens per rank (D = attn_dim): rank r makes
      its own KV:      a x cache, a x a (causal), b x [cache, a], b x b (causal)
      each lower rank: [a, b] x [cache, a']              (one call of 2c query rows)
      each higher rank: b x [cache, a', b'], a x cache
    With one rank: [a, b] x cache and one diagonal block [a, b] x [a, b].
    Each call costs attention_call_overhead_s + FLOPs / FLOP/s(query rows), with FLOPs 4*q*k*D
    (2*c*c*D for causal blocks) and the full or causal table of the profile; summed, the FLOPs
    are attention_flops(T, P, D) / N on every rank. Throughputs are scaled by `compute_scale`.
    """
    N, D = cp_size, attn_dim
    c = new_tokens / (2 * N)
    p = cached_tokens / N
    rows = max(1, -(-new_tokens // (2 * N)))
    full = hw.attention_flops_per_s(dtype, rows) * compute_scale
    full2 = hw.attention_flops_per_s(dtype, 2 * rows) * compute_scale
    causal = hw.attention_causal_flops_per_s(dtype, rows) * compute_scale
    o = hw.attention_call_overhead_s
    has_cache = 1 if cached_tokens else 0
    if N == 1:  # chunks a and b are adjacent: [a, b] x cache, [a, b] x [a, b] (one diagonal block)
        T = new_tokens
        rows1 = max(1, new_tokens)
        return (4 * T * cached_tokens * D / (hw.attention_flops_per_s(dtype, rows1) * compute_scale)
                + 2 * T * T * D / (hw.attention_causal_flops_per_s(dtype, rows1) * compute_scale) + (1 + has_cache) * o)
    own = (4 * c * p * D + 4 * c * (p + c) * D) / full + 2 * (2 * c * c * D) / causal + (3 + has_cache) * o
    lower = 4 * 2 * c * (p + c) * D / full2 + o
    higher = (4 * c * (p + 2 * c) * D + 4 * c * p * D) / full + (1 + has_cache) * o
    return max(own + r * lower + (N - 1 - r) * higher for r in (0, N - 1))


# ----------------------------------------------------------------------------- cost model: prediction


@dataclass(frozen=True)
class StrategyCost:
    """Predicted time of one strategy for one prefill (chunk), per ring step, per layer and total."""

    strategy: str
    """"pass-kv" or "pass-q"."""
    sendrecv_bytes: int
    """Bytes of one ring SendRecv message (per rank, per step, per layer)."""
    sendrecv_s: float
    """Time of one SendRecv: latency + bytes/BW."""
    compute_s: float
    """Attention compute of one ring step on one rank: the slowest rank's attention calls / N
    (attention FLOPs / N^2 / C_attention for an uncalibrated profile)."""
    all2all_bytes: int
    """Bytes one rank sends in the All2All of pass-Q (0 for pass-KV)."""
    all2all_s: float
    """Time of that All2All, not overlapped: (N-1) * latency + bytes/BW, or with calibrated
    all_to_all numbers 2 calls (outputs, LSEs) * all2all latency + bytes / all2all bandwidth."""
    attention_s: float
    """Attention of one layer: overhead + (N-1)*step(compute, sendrecv) + compute + All2All, where
    step = max(compute, sendrecv) under full overlap (see `overlapped_seconds`)."""
    exposed_comm_s: float
    """Communication not hidden under compute, per layer: (N-1)*(step - compute) + All2All."""
    linear_s: float
    """Linear layers (QKV/O projections, MLP) of one layer on one rank."""
    n_layers: int
    """Layers of the model."""
    overhead_s: float = 0.0
    """Fixed cost of one ring_attention call of this strategy (calibrated; 0 otherwise), in attention_s."""
    tp_allreduce_s: float = 0.0
    """The TP all-reduces of one layer (TP_ALLREDUCES_PER_LAYER x `tp_allreduce_seconds`), over
    the intra-host link, not overlapped; 0 at TP 1."""
    layer_overhead_s: float = 0.0
    """Fixed cost of one layer beyond FLOPs and transfers (the profile's layer_overhead_s: kernel
    launches on GPUs); what a few new tokens on a long cache pay even when their FLOPs are few."""
    span_layers_s: float = 0.0
    """All layers with a sliding window or chunks together (`span_layer_seconds` each: the keys
    their span lets the tokens see, their span exchange, linear layers and fixed costs); they take
    no ring, so the strategy does not change them. n_layers counts the other, full layers."""
    span_layers: int = 0
    """How many layers span_layers_s covers."""
    linear_attention_s: float = 0.0
    """All linear-attention (Gated DeltaNet) layers together (`linear_attention_seconds` each: the
    gated delta rule over this rank's tokens, its two exchanges, its matmuls and fixed costs); they
    take no ring, so the strategy does not change them. n_layers leaves them out too."""
    linear_attention_layers: int = 0
    """How many layers linear_attention_s covers."""
    state_exchange: SummaryExchange | None = None
    """One linear layer's exchanges for this chunk and how its summaries travel (the first linear
    layer's shape); None without linear layers."""

    @property
    def layer_s(self) -> float:
        """One full-attention layer: attention + linear layers + TP all-reduces + the fixed layer overhead."""
        return self.attention_s + self.linear_s + self.tp_allreduce_s + self.layer_overhead_s

    @property
    def all_layers(self) -> int:
        """Every layer of the model: full, windowed or chunked, and linear-attention ones."""
        return self.n_layers + self.span_layers + self.linear_attention_layers

    @property
    def total_s(self) -> float:
        """The whole prefill (chunk) over all layers: n_layers * layer_s + span_layers_s + linear_attention_s."""
        return self.n_layers * self.layer_s + self.span_layers_s + self.linear_attention_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "layer_s": self.layer_s, "total_s": self.total_s}


def predict_strategy_cost(strategy: str, new_tokens: int, cached_tokens: int, model: "ModelConfig | str",
                          cp_size: int, hardware: "HardwareProfile | str", *, tp_size: int = 1,
                          dtype: str = "bfloat16", weight_dtype: str | None = None,
                          max_cached_per_rank: int | None = None) -> StrategyCost:
    """Predicted time of `strategy` for T new over P cached tokens on N ranks (per GPU under TP).

    Per layer (n = tokens_per_rank(T, N) ~ ceil(T/N), heads and KV heads per GPU under TP,
    D = heads*DH, ring numbers from `hardware.ring(N)`):
      compute  = attention_seconds_per_rank(...) / N per step (= 2*T*D*(2P+T) / N^2 / C for an
                 uncalibrated profile: attention FLOPs spread over N ranks x N steps)
      pass-KV  : message 2*(max_i P_i + n)*NKV*DH*e        (pass_kv_message_bytes)
      pass-Q   : message n*NH*DH*e, plus All2All (N-1)*n*NH*(DH*e+4) bytes
      sendrecv = latency + message/BW
      attention= overhead + (N-1)*step(compute, sendrecv) + compute + All2All
                 (step = max(compute, sendrecv) with full overlap, see `overlapped_seconds`)
      linear   = 2*n*params_per_layer/TP / C_linear
      TP       = 2 all-reduces of n*dim*e bytes: 2 * (tp_latency + 2*(TP-1)/TP*n*dim*e/tp_BW)
      fixed    = layer_overhead_s of the profile
    A hybrid's linear-attention layers take no ring and the strategy does not change them: each
    costs its gated delta rule and exchanges (`linear_attention_seconds`) + linear + TP + fixed,
    summed in linear_attention_s; windowed and chunked layers likewise in span_layers_s.
    Balanced sharding makes the steps' work about equal, so every step costs the same here.
    `max_cached_per_rank` (max_i P_i) defaults to ceil(P/N), the even split of a cache.
    Calibrated CPU profiles scale compute for N ranks sharing the host's cores (`hardware.ring`)
    and their linear FLOP/s is measured on whole decoder blocks, so it covers norms, RoPE and
    elementwise work too. The fixed costs (latencies, TP all-reduces, layer overhead) are what a
    short prompt on a long cache pays: its FLOPs are few, its steps and layers are not.
    """
    model = get_preset(model) if isinstance(model, str) else model
    hw = load_profile(hardware)
    validate_ring_inputs(new_tokens, cached_tokens, cp_size)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    dtype = canonical_dtype(dtype)
    weight_dtype = canonical_dtype(weight_dtype or dtype)
    heads, kv_heads = local_heads(model, tp_size)
    e, DH, N = element_bytes(dtype), model.head_dim, cp_size
    n = tokens_per_rank(new_tokens, N)
    max_p = cached_rows_per_rank(cached_tokens, N) if max_cached_per_rank is None else max_cached_per_rank
    ring = hw.ring(N)

    compute = attention_seconds_per_rank(new_tokens, cached_tokens, N, heads * DH, hw, dtype,
                                         ring.compute_scale / ring.attention_factor) / N
    linear = linear_flops(n, model, tp_size) / (hw.linear_flops(weight_dtype) * ring.compute_scale)
    if strategy == PASS_KV:
        message, a2a_bytes = pass_kv_message_bytes(max_p, new_tokens, N, kv_heads, DH, e), 0
    else:
        message = pass_q_message_bytes(new_tokens, N, heads, DH, e)
        a2a_bytes = all2all_bytes_per_rank(new_tokens, N, heads, DH, e)
    fixed = dict(tp_allreduce_s=TP_ALLREDUCES_PER_LAYER * tp_allreduce_seconds(n, model, tp_size, hw, e),
                 layer_overhead_s=hw.layer_overhead_s)
    # Full and dual chunk layers ring alike (DCA: pass-KV, the same keys); windows and chunks do not.
    # Layers with their own head shape count at their widths: the windowed ones each, the full ones
    # at their mean (compute and bytes grow linearly with the width, so the sum stays right).
    kinds: dict[tuple[Span, int, int], int] = {}
    for layer in model.attention_layers:  # linear-attention layers are priced below
        key = (model.attention(layer).span, *layer_widths(model, tp_size, layer))
        kinds[key] = kinds.get(key, 0) + 1
    full = {key: n for key, n in kinds.items() if key[0].sees_everything}
    full_layers = sum(full.values())
    if full_layers and any(w != (heads * DH, kv_heads * DH) for _, *w in full):
        attn_dim = sum(n * w for (_, w, _), n in full.items()) / full_layers
        kv_dim = sum(n * w for (_, _, w), n in full.items()) / full_layers
        compute = attention_seconds_per_rank(new_tokens, cached_tokens, N, attn_dim, hw, dtype,
                                             ring.compute_scale / ring.attention_factor) / N
        if strategy == PASS_KV:
            message = round(pass_kv_message_bytes(max_p, new_tokens, N, 1, kv_dim, e))
        else:
            message = round(pass_q_message_bytes(new_tokens, N, 1, attn_dim, e))
            a2a_bytes = round(all2all_bytes_per_rank(new_tokens, N, heads, attn_dim / heads, e))
    per_layer_rest = linear + fixed["tp_allreduce_s"] + fixed["layer_overhead_s"]
    spans = {key: n for key, n in kinds.items() if not key[0].sees_everything}
    fixed.update(span_layers=sum(spans.values()),
                 span_layers_s=sum(count * (span_layer_seconds(new_tokens, cached_tokens, N, attn, kv, span, hw, dtype,
                                                               ring) + per_layer_rest)
                                   for (span, attn, kv), count in spans.items()))
    exchange, linear_attention = None, 0.0
    for shape, count in linear_layer_shapes(model, tp_size).items():
        seconds, layer_exchange = linear_attention_seconds(new_tokens, N, shape, hw, dtype, ring)
        linear_attention += count * (seconds + per_layer_rest)
        exchange = exchange or layer_exchange
    fixed.update(linear_attention_layers=len(model.linear_layers), linear_attention_s=linear_attention,
                 state_exchange=exchange)
    if N == 1:  # no ring: nothing is sent
        return StrategyCost(strategy=strategy, sendrecv_bytes=0, sendrecv_s=0.0, compute_s=compute, all2all_bytes=0,
                            all2all_s=0.0, attention_s=compute, exposed_comm_s=0.0, linear_s=linear,
                            n_layers=full_layers, **fixed)
    sendrecv = transfer_seconds(message, ring.bandwidth_bytes_per_s, ring.latency_s)
    a2a = 0.0
    if strategy == PASS_Q:
        if ring.all2all_latency_s is None:  # one message per peer
            a2a = transfer_seconds(a2a_bytes, ring.bandwidth_bytes_per_s, ring.latency_s, messages=N - 1)
        else:  # two all_to_all calls: partial outputs, then their LSEs
            a2a = transfer_seconds(a2a_bytes, ring.all2all_bandwidth_bytes_per_s, ring.all2all_latency_s, messages=2)
    overhead = ring.overhead_s.get(strategy, 0.0)
    step = overlapped_seconds(compute, sendrecv, ring.comm_overlap)
    return StrategyCost(
        strategy=strategy, sendrecv_bytes=message, sendrecv_s=sendrecv, compute_s=compute,
        all2all_bytes=a2a_bytes, all2all_s=a2a,
        attention_s=overhead + ring_seconds(compute, sendrecv, N, ring.comm_overlap) + a2a,
        exposed_comm_s=(N - 1) * (step - compute) + a2a,
        linear_s=linear, n_layers=full_layers, overhead_s=overhead, **fixed,
    )


def span_layer_seconds(new_tokens: int, cached_tokens: int, cp_size: int, attn_dim: int, kv_dim: int, span: Span,
                       hw: HardwareProfile, dtype: str, ring) -> float:
    """Attention of one layer with a window or chunks, on one rank: the FLOPs of the keys its
    tokens see (`span_attention_flops` / N, at the profile's full-block rate for rows of the
    window's size), overlapped with its span exchange: each rank sends each of its two pieces'
    neighbours at most the W (or C) rows before it, K and V (ring_attention's span exchange)."""
    N = cp_size
    flops = span_attention_flops(new_tokens, cached_tokens, attn_dim, span) / N
    reach = min(x for x in (span.window, span.chunk) if x)
    rows = max(1, min(reach, -(-new_tokens // (2 * N))))
    compute = flops / (hw.attention_flops_per_s(dtype, rows) * ring.compute_scale / ring.attention_factor)
    compute += 3 * hw.attention_call_overhead_s
    if N == 1:
        return compute
    message = 2 * min(reach, new_tokens + cached_tokens) * 2 * kv_dim * element_bytes(dtype)
    comm = transfer_seconds(message, ring.bandwidth_bytes_per_s, ring.latency_s, messages=2)
    return overlapped_seconds(compute, comm, ring.comm_overlap)


def linear_attention_seconds(new_tokens: int, cp_size: int, shape: LinearShape, hw: HardwareProfile, dtype: str,
                             ring) -> tuple[float, SummaryExchange]:
    """One linear-attention layer (`shape`: one TP rank's share) on the fullest rank, its matmuls
    left out (they are in `linear_flops`): the gated delta rule over n = tokens_per_rank(T, N)
    tokens, n * delta_rule_flops_per_token (with the pieces' summaries when N > 1) at the float32
    FLOP/s of the profile's matmuls (the rule runs in float32 whatever the dtype), then its two
    exchanges (`summary_exchange`: conv tails, summaries the cheaper way), which the scan waits
    for. Returns (seconds, the exchange)."""
    rate = hw.linear_flops("float32" if "float32" in hw.peak_flops else dtype) * ring.compute_scale
    n = tokens_per_rank(new_tokens, cp_size)
    exchange = summary_exchange(shape, cp_size, ring, rate)
    return n * delta_rule_flops_per_token(shape, over_ranks=cp_size > 1) / rate + exchange.seconds, exchange


def choose_linear_exchange(model: ModelConfig, cp_size: int, hardware: "HardwareProfile | str", dtype: str = "bfloat16",
                           tp_size: int = 1) -> SummaryExchange:
    """How a prefill over `cp_size` ranks sends its linear layers' state summaries (all-gather or
    ring relay, `summary_exchange`), decided once for the prefill from the widest linear layer's
    shape (one TP rank's share) and the `hardware` profile; the same on every rank."""
    hw = load_profile(hardware)
    ring = hw.ring(cp_size)
    shape = max(linear_layer_shapes(model, tp_size), key=lambda s: s.recurrent_bytes)
    return linear_attention_seconds(1, cp_size, shape, hw, dtype, ring)[1]


def predict_costs(new_tokens: int, cached_tokens: int, model: ModelConfig, cp_size: int,
                  hardware: "HardwareProfile | str", **kwargs) -> dict[str, StrategyCost]:
    """`predict_strategy_cost` for both strategies: {"pass-kv": ..., "pass-q": ...}."""
    return {s: predict_strategy_cost(s, new_tokens, cached_tokens, model, cp_size, hardware, **kwargs)
            for s in STRATEGIES}


# ----------------------------------------------------------------------------- empirical rule fitting

FIT_MAX_TOKENS = 2**20
"""The fitting grid spans T and P up to 1M tokens, the context lengths ringctx plans for."""
FIT_POINTS_PER_OCTAVE = 4
"""Grid density: T and P take the values round(2**(k/4)), plus P = 0."""
FIT_L2 = 1e-2
"""Ridge penalty on a and b: keeps the logistic fit finite when the labels are almost separable."""


def alg5_prefers_pass_kv(new_tokens, cached_tokens, cp_size: int, flops: float, n_heads: int, n_kv_heads: int,
                         elem_bytes: int, bandwidth: float):
    """Algorithm 5 as a predicate (works elementwise on numpy arrays of T and P); see `_decide_alg5`."""
    T = np.asarray(new_tokens, dtype=np.float64)
    m = T / (T + np.asarray(cached_tokens, dtype=np.float64))
    t0 = pass_kv_compute_threshold(cp_size, flops, n_heads, n_kv_heads, elem_bytes, bandwidth)
    m5 = 2 * n_kv_heads / n_heads - 4 * T * bandwidth / (cp_size * flops * elem_bytes) * (1 - m / 2)
    return (T >= t0) | (m >= m5)


def fitting_grid(max_tokens: int = FIT_MAX_TOKENS, points_per_octave: int = FIT_POINTS_PER_OCTAVE):
    """(T, P) arrays of the grid: T, P in {round(2**(k/ppo))} up to max_tokens, and P = 0 too."""
    steps = int(round(math.log2(max_tokens) * points_per_octave))
    values = np.unique(np.round(2.0 ** (np.arange(steps + 1) / points_per_octave)).astype(np.int64))
    T, P = np.meshgrid(values, np.concatenate([[0], values]), indexing="ij")
    return T.ravel(), P.ravel()


def fit_empirical_rule(new_tokens, cached_tokens, prefers_pass_kv,
                       l2: float = FIT_L2) -> tuple[float, float, float, float]:
    """Fit h = a*ln T + b*ln(T/(T+P)) + c to labels (True = pass-KV) by logistic regression.

    Newton/IRLS on the mean log-loss plus l2*(a^2+b^2)/2 (the constant is not penalised).
    Returns (a, b, c, agreement), agreement = fraction of samples where (h > 0) == label.
    """
    T = np.asarray(new_tokens, dtype=np.float64)
    y = np.asarray(prefers_pass_kv, dtype=np.float64)
    X = np.stack([np.log(T), np.log(T / (T + np.asarray(cached_tokens, dtype=np.float64))), np.ones_like(T)], axis=1)
    ridge = np.diag([l2, l2, 0.0])
    w = np.zeros(3)
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-np.clip(X @ w, -500, 500)))
        grad = X.T @ (p - y) / len(y) + ridge @ w
        hess = (X * (p * (1 - p))[:, None]).T @ X / len(y) + ridge + 1e-12 * np.eye(3)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    agreement = float(np.mean((X @ w > 0) == (y > 0.5)))
    return float(w[0]), float(w[1]), float(w[2]), agreement


@functools.lru_cache(maxsize=256)
def _fit_alg5_cached(n_heads: int, n_kv_heads: int, cp_size: int, flops: float, elem_bytes: int,
                     bandwidth: float) -> tuple[float, float, float, float]:
    T, P = fitting_grid()
    labels = alg5_prefers_pass_kv(T, P, cp_size, flops, n_heads, n_kv_heads, elem_bytes, bandwidth)
    return fit_empirical_rule(T, P, labels)


def fit_empirical_rule_to_alg5(model: ModelConfig, cp_size: int, hardware: "HardwareProfile | str",
                               dtype: str = "bfloat16", *, tp_size: int = 1) -> EmpiricalRuleCoefficients:
    """Coefficients of h fitted to Algorithm 5's decisions on `fitting_grid()` for this setting.

    Algorithm 5 runs on the heads of one GPU under TP (`ring_heads`) and the thresholds' C
    (`threshold_flops`). This is how the built-in profiles' defaults were made (source
    "fit-to-alg5"); calibration replaces them with fits to measured winners (source "calibrated").
    """
    hw = load_profile(hardware)
    dtype = canonical_dtype(dtype)
    heads, kv_heads = ring_heads(model, tp_size)
    a, b, c, agreement = _fit_alg5_cached(heads, kv_heads, cp_size, threshold_flops(hw, dtype, cp_size),
                                          element_bytes(dtype), hw.ring(cp_size).bandwidth_bytes_per_s)
    return EmpiricalRuleCoefficients(a=a, b=b, c=c, cp_size=cp_size, n_heads=heads, n_kv_heads=kv_heads,
                                     dtype=dtype, source="fit-to-alg5", agreement=agreement)


def fit_default_rules(hardware: "HardwareProfile | str", models: "list[ModelConfig]", cp_sizes: "list[int]",
                      dtypes: "list[str]", decimals: int = 4) -> tuple[EmpiricalRuleCoefficients, ...]:
    """Alg5-fitted coefficients for every (model, N, dtype), rounded to `decimals` as stored in JSON.

    `agreement` is recomputed for the rounded coefficients. This produced the built-in defaults
    (h100-rdma/h100-tcp/h200: llama3-8b/70b/405b shapes, N in 2,4,8,16, bfloat16; cpu: tiny and
    smollm2-135m shapes, N in 2,3,4, float32 and bfloat16).
    """
    hw = load_profile(hardware)
    T, P = fitting_grid()
    rules = []
    for model in models:
        for N in cp_sizes:
            for dtype in dtypes:
                fit = fit_empirical_rule_to_alg5(model, N, hw, dtype)
                a, b, c = (round(x, decimals) for x in (fit.a, fit.b, fit.c))
                labels = alg5_prefers_pass_kv(T, P, N, threshold_flops(hw, dtype, N), model.n_heads,
                                              model.n_kv_heads, element_bytes(dtype), hw.ring(N).bandwidth_bytes_per_s)
                h = a * np.log(T) + b * np.log(T / (T + P)) + c
                agreement = round(float(np.mean((h > 0) == labels)), decimals)
                rules.append(dataclasses.replace(fit, a=a, b=b, c=c, agreement=agreement))
    return tuple(rules)
