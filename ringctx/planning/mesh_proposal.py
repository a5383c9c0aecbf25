"""Choosing the mesh for a number of hosts: `propose_mesh` plans every (cp, tp) with TP inside a
host and proposes the smallest TP whose prefill GPU fits (the paper's TP inside, CP across hosts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringctx.model.config import ModelConfig
from ringctx.planning.decode_plan import max_decode_ranks
from ringctx.planning.hardware import HardwareProfile, load_profile
from ringctx.planning.memory import as_model_config, check_integers
from ringctx.planning.prefill_plan import Plan, plan_prefill
from ringctx.planning.strategy import local_heads
from ringctx.units import fmt_gb


@dataclass(frozen=True)
class MeshOption:
    """One way to split the job's GPUs: CP ranks of TP GPUs each, and the plan on that mesh."""

    cp_size: int
    """N: CP ranks, hosts * gpus_per_host / tp_size; the ring runs across them (and the hosts)."""
    tp_size: int
    """TP GPUs of one CP rank, all inside one host: a divisor of gpus_per_host valid for the heads."""
    plan: Plan
    """plan_prefill of the prompt on this mesh."""

    @property
    def fits(self) -> bool:
        """Whether weights + KV cache + activations fit one prefill GPU (plan.memory.fits)."""
        return self.plan.memory.fits

    @property
    def memory_bytes(self) -> int:
        """Peak memory of one prefill GPU: weights + KV-cache shard + one layer's activations."""
        return self.plan.memory.total_bytes

    @property
    def ttft_ms(self) -> float:
        """Predicted time to first token on this mesh (plan.ttft_ms)."""
        return self.plan.ttft_ms

    def to_dict(self) -> dict:
        m = self.plan.memory
        return {"cp_size": self.cp_size, "tp_size": self.tp_size, "memory_bytes": self.memory_bytes,
                "usable_bytes": m.usable_bytes, "fits": self.fits, "ttft_ms": self.ttft_ms,
                "tp_allreduce_ms": self.plan.tp_allreduce_ms, "decode_fits": self.plan.decode.fits}


@dataclass(frozen=True)
class MeshProposal:
    """The (cp, tp) proposed for `hosts` hosts of `gpus_per_host` GPUs, next to every alternative.

    The paper's rule: TP inside a host, CP across hosts, and no more TP than memory needs: TP adds
    two all-reduces a layer on the critical path, while CP's ring transfers hide under attention.
    """

    hosts: int
    """H: hosts of the job."""
    gpus_per_host: int
    """G: GPUs of one host; every TP group lies inside one, so TP divides G."""
    options: tuple[MeshOption, ...]
    """Every valid (cp, tp) of H x G GPUs, TP ascending (cp = H*G/TP)."""
    excluded: dict[int, str]
    """Divisors of G that cannot split the model, with local_heads' reason (e.g. 3 of 128 heads)."""
    chosen: MeshOption | None
    """The proposal: the smallest TP whose prefill GPU fits (or the forced TP); None when none fits."""
    forced: bool
    """True when the caller fixed TP; `chosen` is then that option, fitting or not."""

    @property
    def reason(self) -> str:
        """One line saying why `chosen` was picked (or that nothing fits)."""
        if self.chosen is None:
            return self.problem() or ""
        c = self.chosen
        if self.forced:
            return (f"TP {c.tp_size} forced: CP {c.cp_size} = {self.hosts} hosts x {self.gpus_per_host} GPUs "
                    f"/ TP {c.tp_size}")
        smaller = [o.tp_size for o in self.options if o.tp_size < c.tp_size]
        why = (f"TP {', '.join(map(str, smaller))} need{'s' if len(smaller) == 1 else ''} more memory than a GPU has; "
               if smaller else "")
        return (f"{why}TP {c.tp_size} is the smallest that fits "
                f"({fmt_gb(c.memory_bytes)} of {fmt_gb(c.plan.memory.usable_bytes)} usable per GPU), "
                f"so CP {c.cp_size} = {self.hosts} hosts x {self.gpus_per_host} GPUs / TP {c.tp_size}")

    def problem(self) -> str | None:
        """One line when no mesh fits: what the leanest needs and what to change; None otherwise."""
        if self.chosen is not None:
            return None
        lean = min(self.options, key=lambda o: o.memory_bytes)
        m, model = lean.plan.memory, lean.plan.model
        return (f"no mesh of {self.hosts} hosts x {self.gpus_per_host} GPUs fits {model.name} with "
                f"{lean.plan.cached + lean.plan.tokens:,} tokens: the leanest, CP {lean.cp_size} x TP {lean.tp_size}, "
                f"needs {fmt_gb(m.total_bytes)} per GPU (weights {fmt_gb(m.weights_bytes)} + KV {fmt_gb(m.kv_cache_bytes)} "
                f"+ activations {fmt_gb(m.activation_bytes)}) of {fmt_gb(m.usable_bytes)} usable; use 8-bit weights "
                f"(--weight-dtype float8), --kv-dtype fp8, smaller --chunk-tokens or more hosts")

    def to_dict(self) -> dict:
        chosen = self.chosen
        return {"hosts": self.hosts, "gpus_per_host": self.gpus_per_host, "forced": self.forced,
                "chosen": None if chosen is None else {"cp_size": chosen.cp_size, "tp_size": chosen.tp_size},
                "reason": self.reason, "options": [o.to_dict() for o in self.options],
                "excluded": {str(t): why for t, why in self.excluded.items()}}


def mesh_tp_sizes(model: ModelConfig, gpus_per_host: int) -> tuple[list[int], dict[int, str]]:
    """(valid TP sizes, {excluded TP: why}) among the divisors of gpus_per_host, ascending.

    Valid means `local_heads` accepts it: it divides the query heads and ffn_dim, and divides or is
    a multiple of the KV heads.
    """
    valid, excluded = [], {}
    for tp in (t for t in range(1, gpus_per_host + 1) if gpus_per_host % t == 0):
        try:
            local_heads(model, tp)
        except ValueError as err:
            excluded[tp] = str(err)
            continue
        valid.append(tp)
    return valid, excluded


def propose_mesh(model: "ModelConfig | str", hosts: int, gpus_per_host: int, hardware: "HardwareProfile | str",
                 tokens: int, cached: int = 0, chunk_tokens: int | None = None, dtype: str = "bfloat16",
                 rule: str = "alg5", *, tp_size: int | None = None, weight_dtype: str | None = None,
                 kv_dtype: str = "model", handoff: bool = True, decode_ranks: int | None = None,
                 weights: str = "model") -> MeshProposal:
    """Propose (cp, tp) for a prompt on `hosts` hosts of `gpus_per_host` GPUs, with the alternatives.

    Every TP that divides gpus_per_host and splits the model (`mesh_tp_sizes`) is planned with
    `plan_prefill` at cp = hosts * gpus_per_host / TP; the proposal is the smallest TP whose prefill
    GPU fits (weights + KV cache + activations, `MemoryEstimate`). `tp_size` forces a TP instead
    (it must divide gpus_per_host). The hardware profile's devices_per_host is taken to be
    gpus_per_host. `decode_ranks` is the decode ranks of every option, at most its host's GPUs / TP
    (None: all of them). The other arguments are plan_prefill's.
    """
    model = as_model_config(model)
    check_integers((("hosts", hosts, 1), ("gpus_per_host", gpus_per_host, 1)))
    hw = dataclasses.replace(load_profile(hardware), devices_per_host=gpus_per_host)
    if tp_size is not None:
        check_integers((("tp_size", tp_size, 1),))
        if gpus_per_host % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the {gpus_per_host} GPUs of a host: a TP group "
                             f"lies inside one host; use a divisor of {gpus_per_host}")
        local_heads(model, tp_size)  # raises when it cannot split the model
    valid, excluded = mesh_tp_sizes(model, gpus_per_host)
    options = []
    for tp in valid:
        ranks = None if decode_ranks is None else min(decode_ranks, max_decode_ranks(hw, tp))
        plan = plan_prefill(model, hosts * gpus_per_host // tp, hw, tokens, cached=cached, chunk_tokens=chunk_tokens,
                            tp_size=tp, dtype=dtype, rule=rule, weight_dtype=weight_dtype, handoff=handoff,
                            decode_ranks=ranks, kv_dtype=kv_dtype, weights=weights)
        options.append(MeshOption(cp_size=plan.cp_size, tp_size=tp, plan=plan))
    if tp_size is not None:
        chosen = next(o for o in options if o.tp_size == tp_size)
    else:
        chosen = next((o for o in options if o.fits), None)
    return MeshProposal(hosts=hosts, gpus_per_host=gpus_per_host, options=tuple(options), excluded=excluded,
                        chosen=chosen, forced=tp_size is not None)
