"""Expert parallelism against tensor parallelism for a mixture of experts: which one `plan` picks
for R ranks, and why (the one place this policy lives; `ringctx plan` shows it).

For R ranks, per rank (e = bytes per element of the activations, e_w of the weights):

    option     weights per rank                                    bytes each rank sends per token
    neither    n_params * e_w                                      0
    EP R       (n_params - experts * (R-1)/R) * e_w                sum over MoE layers of
               (the routed experts split, attention, routers,      2 * k * dim * e * (R-1)/R
               shared experts and embeddings whole)                (each of a token's k (token, expert)
                                                                   rows goes to its expert's rank and
                                                                   back; (R-1)/R of them leave, as
                                                                   model/expert_parallel.py counts)
    TP R       n_params * e_w / R                                  n_layers * 2 * 2(R-1)/R * dim * e
                                                                   (two ring all-reduces of the
                                                                   activations per layer: attention's
                                                                   and the MLP's, model/tensor_parallel.py)

"Fits": weights + the rest of the plan's memory per rank (KV shard and working set, counted alike
for every option: TP's is an upper bound, its KV heads split too) within MEMORY_USABLE_FRACTION of a rank's memory. TP also needs its R ranks on
one host (its all-reduces run every layer) and heads R divides; EP needs R to divide the experts.

The pick: neither when the whole model fits on every rank (both only add messages); else, of the
options that fit and can run, the one that sends fewer bytes per token (EP's grow with k, TP's
with the layer count: Qwen3-30B-A3B's 8 experts a token make EP send 4x TP's at R = 2, while a
top-1 or top-2 model with many layers can favour EP); none when neither fits (more ranks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..model.config import ModelConfig
from ..model.expert_parallel import ep_problem
from ..model.tensor_parallel import tp_problem
from .hardware import HardwareProfile, element_bytes
from ..units import fmt_gb
from .memory import MEMORY_USABLE_FRACTION, expert_params, rank_memory_bytes, weight_bytes_per_rank


@dataclass(frozen=True)
class ExpertOption:
    """One way to hold a mixture of experts on R ranks."""

    name: str
    """"neither", "EP R" or "TP R"."""
    ep_size: int
    tp_size: int
    weights_bytes: int
    """Weights one rank holds."""
    total_bytes: int
    """weights_bytes + the rest of the plan's memory per rank."""
    usable_bytes: float
    """MEMORY_USABLE_FRACTION of a rank's memory."""
    bytes_per_token: int
    """Bytes one rank sends per token over all layers (see the module docstring)."""
    problem: str | None
    """Why this option cannot run here (TP across hosts, a size that does not divide), or None."""

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes


@dataclass(frozen=True)
class ExpertChoice:
    """The options for R ranks and the one picked (None: none fits), with the reason in one line."""

    ranks: int
    options: tuple[ExpertOption, ...]
    chosen: ExpertOption | None
    reason: str

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "chosen": None if self.chosen is None else self.chosen.name,
                "reason": self.reason,
                "options": [{**asdict(o), "fits": o.fits} for o in self.options]}


def ep_bytes_per_token(model: ModelConfig, ep_size: int, dtype: str) -> int:
    """Bytes one EP rank sends per token: dispatch and combine of each MoE layer's k rows, (R-1)/R of them."""
    return sum(2 * e.experts_per_token * model.dim * element_bytes(dtype) * (ep_size - 1) // ep_size
               for e in model.layer_experts if e is not None)


def tp_bytes_per_token(model: ModelConfig, tp_size: int, dtype: str) -> int:
    """Bytes one TP rank sends per token: two ring all-reduces of dim per layer, 2(T-1)/T each."""
    return model.n_layers * 2 * 2 * (tp_size - 1) * model.dim * element_bytes(dtype) // tp_size


def compare_expert_parallelism(model: ModelConfig, hw: HardwareProfile, ranks: int, *, dtype: str,
                               weight_dtype: str, weights: str = "model", other_bytes: int = 0,
                               cp_size: int | None = None) -> ExpertChoice:
    """EP `ranks` against TP `ranks` (and neither) for `model` on `hw`. other_bytes: the plan's memory
    per rank besides the weights (KV shard, working set), counted alike for every option (TP would
    split the KV heads too, so its total is an upper bound). cp_size: the CP ranks EP would spread
    over (None: `ranks`)."""
    usable = rank_memory_bytes(hw, ranks) * MEMORY_USABLE_FRACTION

    def option(name, ep, tp, sent, problem=None):
        w = weight_bytes_per_rank(model, tp, weight_dtype, weights, hw, ep)
        return ExpertOption(name, ep, tp, w, w + other_bytes, usable, sent, problem)

    host = hw.host_devices()
    tp_why = tp_problem(model, ranks) or (f"needs {ranks} ranks on one host, which has {host}"
                                          if ranks > host else None)
    options = (option("neither", 1, 1, 0),
               option(f"EP {ranks}", ranks, 1, ep_bytes_per_token(model, ranks, dtype),
                      ep_problem(model, ranks, cp_size or ranks)),
               option(f"TP {ranks}", 1, ranks, tp_bytes_per_token(model, ranks, dtype), tp_why))
    neither, ep, tp = options
    share = expert_params(model) / max(model.n_params, 1)
    if neither.fits:
        return ExpertChoice(ranks, options, neither,
                            f"neither: the whole model ({_gb(neither.weights_bytes)}) fits on every rank: EP and TP would "
                            f"only add messages ({_kb(ep.bytes_per_token)} / {_kb(tp.bytes_per_token)} per token)")
    candidates = [o for o in (ep, tp) if o.fits and o.problem is None]
    if not candidates:
        return ExpertChoice(ranks, options, None,
                            f"neither fits on {ranks} ranks: EP {ranks} needs {_gb(ep.total_bytes)} and TP {ranks} "
                            f"{_gb(tp.total_bytes)} per rank of {_gb(usable)} usable; use more ranks")
    best = min(candidates, key=lambda o: (o.bytes_per_token, o.weights_bytes))
    other = tp if best is ep else ep
    why_other = (other.problem if other.problem else "does not fit" if not other.fits
                 else f"sends {_kb(other.bytes_per_token)} per token" if other.bytes_per_token != best.bytes_per_token
                 else f"sends as much and holds {_gb(other.weights_bytes)} per rank")
    return ExpertChoice(ranks, options, best,
                        f"{best.name}: {_gb(best.weights_bytes)} of weights per rank fit and it sends "
                        f"{_kb(best.bytes_per_token)} per token; {other.name} {why_other} (the experts are "
                        f"{share:.0%} of the weights)")


def _gb(n: float) -> str:
    return fmt_gb(n)


def _kb(n: float) -> str:
    return f"{n / 2 ** 10:,.0f} KiB"
