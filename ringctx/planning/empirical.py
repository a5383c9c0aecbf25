"""Judging strategy rules against measured pass-KV / pass-Q timings, and fitting the empirical rule to them.

A measurement is a dict {"new_tokens": T, "cached_tokens": P, "seconds": {"pass-kv": s, "pass-q": s},
"kv_over_q": r} (what `ringctx.planning.calibrate.ring_strategy_job` returns; r, the median over
paired rounds of time(pass-KV)/time(pass-Q), decides when present). For a rule's picks:

    regret   = time(pick) / time(faster) - 1        (0 when it picked the faster one)
    decisive = the two differ by more than `margin` (5%): only there is a wrong pick a real loss

`evaluate_picks` gives the share of decisive cases picked right and the mean and worst regret over
all cases; `fit_rule_to_measurements` fits h(T, P) = a*ln T + b*ln(T/(T+P)) + c to the measured
winners (source "calibrated"), and `leave_one_out_picks` judges that fit honestly (each case
predicted by a fit to the others).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ringctx.model.config import ModelConfig
from ringctx.planning.hardware import EmpiricalRuleCoefficients, canonical_dtype
from ringctx.planning.strategy import PASS_KV, PASS_Q, fit_empirical_rule

DECISIVE_MARGIN = 0.05
"""Cases whose two timings differ by more than this fraction count for the accuracy."""

FIT_MARGIN = 0.02
"""Cases closer than this are left out of the fit (their winner is noise) when enough remain."""


def kv_over_q(m: dict[str, Any]) -> float:
    """time(pass-KV) / time(pass-Q): the median of paired rounds when measured, else of the medians."""
    if m.get("kv_over_q") is not None:
        return m["kv_over_q"]
    s = m["seconds"]
    return s[PASS_KV] / s[PASS_Q]


def faster(m: dict[str, Any]) -> str:
    """The strategy measured faster."""
    return PASS_KV if kv_over_q(m) <= 1 else PASS_Q


def gap(m: dict[str, Any]) -> float:
    """time(slower) / time(faster) - 1."""
    r = kv_over_q(m)
    return max(r, 1 / r) - 1


def regret(m: dict[str, Any], pick: str) -> float:
    """time(pick) / time(faster) - 1 (0 for the faster one)."""
    return 0.0 if pick == faster(m) else gap(m)


def evaluate_picks(measurements: Sequence[dict[str, Any]], picks: Sequence[str],
                   margin: float = DECISIVE_MARGIN) -> dict[str, Any]:
    """Accuracy on decisive cases, mean and worst regret, for one pick per measurement."""
    if len(measurements) != len(picks):
        raise ValueError(f"{len(measurements)} measurements but {len(picks)} picks")
    regrets = [regret(m, p) for m, p in zip(measurements, picks)]
    decisive = [i for i, m in enumerate(measurements) if gap(m) > margin]
    right = [i for i in decisive if picks[i] == faster(measurements[i])]
    worst = int(np.argmax(regrets)) if regrets else None
    return {
        "cases": len(measurements), "decisive": len(decisive), "right_decisive": len(right),
        "accuracy_decisive": len(right) / len(decisive) if decisive else 1.0,
        "agreement_all": float(np.mean([p == faster(m) for m, p in zip(measurements, picks)])) if picks else 1.0,
        "mean_regret": float(np.mean(regrets)) if regrets else 0.0,
        "worst_regret": regrets[worst] if regrets else 0.0,
        "worst_case": ({"new_tokens": measurements[worst]["new_tokens"],
                        "cached_tokens": measurements[worst]["cached_tokens"], "pick": picks[worst]}
                       if regrets else None),
    }


def _fit_arrays(measurements: Sequence[dict[str, Any]]):
    chosen = [m for m in measurements if gap(m) > FIT_MARGIN]
    labels = [faster(m) == PASS_KV for m in chosen]
    if len(chosen) < 4 or len(set(labels)) < 2:  # too few clear cases: use them all
        chosen = list(measurements)
    T = np.array([m["new_tokens"] for m in chosen], dtype=np.float64)
    P = np.array([m["cached_tokens"] for m in chosen], dtype=np.float64)
    y = np.array([faster(m) == PASS_KV for m in chosen])
    return T, P, y


def fit_rule_to_measurements(measurements: Sequence[dict[str, Any]], model: ModelConfig, cp_size: int,
                             dtype: str, decimals: int = 4) -> EmpiricalRuleCoefficients:
    """h(T, P) fitted by logistic regression to the measured winners (source "calibrated").

    Cases closer than FIT_MARGIN are left out when at least 4 clear cases of both kinds remain.
    `agreement` is measured on all cases.
    """
    if not measurements:
        raise ValueError("no measurements to fit the empirical rule to")
    T, P, y = _fit_arrays(measurements)
    a, b, c, _ = fit_empirical_rule(T, P, y)
    a, b, c = (round(x, decimals) for x in (a, b, c))
    rule = EmpiricalRuleCoefficients(a=a, b=b, c=c, cp_size=cp_size, n_heads=model.n_heads,
                                     n_kv_heads=model.n_kv_heads, dtype=canonical_dtype(dtype), source="calibrated",
                                     agreement=0.0)
    picks = [PASS_KV if rule.score(m["new_tokens"], m["cached_tokens"]) > 0 else PASS_Q for m in measurements]
    agreement = float(np.mean([p == faster(m) for m, p in zip(measurements, picks)]))
    return EmpiricalRuleCoefficients(**{**rule.__dict__, "agreement": round(agreement, decimals)})


def leave_one_out_picks(measurements: Sequence[dict[str, Any]], model: ModelConfig, cp_size: int,
                        dtype: str) -> list[str]:
    """Each case's pick by the empirical rule fitted to all the other cases."""
    picks = []
    for i, m in enumerate(measurements):
        rest = [x for j, x in enumerate(measurements) if j != i]
        rule = fit_rule_to_measurements(rest, model, cp_size, dtype)
        picks.append(PASS_KV if rule.score(m["new_tokens"], m["cached_tokens"]) > 0 else PASS_Q)
    return picks


def rule_picks(measurements: Sequence[dict[str, Any]], choose: Callable[[int, int], str]) -> list[str]:
    """choose(T, P) for every measurement."""
    return [choose(m["new_tokens"], m["cached_tokens"]) for m in measurements]
