"""Expert parallelism: the experts of every mixture-of-experts layer spread over E ranks, and the
two-shot all-to-all that brings each (token, expert) pair to the rank holding its expert.

Which ranks form an EP group: E consecutive CP ranks of one TP index (the ring's ranks),

    global rank = cp_rank * tp_size + tp_rank       EP group of (cp block b, tp index t):
                                                    {(c, t) : b*E <= c < (b+1)*E}

so EP needs no mesh dimension of its own, only a subgroup of each TP index's CP ranks. Why those:
the CP ranks of one TP index are the ranks that run the same layer at the same time (a prefill
chunk runs every layer on every CP rank in lockstep: the ring attention is a collective per
layer), each on different tokens, so spreading the experts over them divides the expert weights
without adding a step anyone waits for; the TP ranks of a CP rank already hold the same tokens and
split every expert's width (model/tensor_parallel.py), which composes: experts over EP, each
expert's width over TP. The decode ranks (a run of CP ranks of one host) decode together on the
same token, so they must be whole EP groups: `ep_problem` asks that E divide the decode ranks and
the first decode rank. EP rank r holds experts [r*n/E, (r+1)*n/E) of every MoE layer (n experts;
E divides n) and loads only those (weights.py).

A layer's forward on EP rank r, T tokens x [T, dim] routed to k experts each (model/moe.py):

    prefill (different tokens per rank)    `run_experts`: the two-shot all-to-all FBGEMM's MoE
        layers run: (1) all_to_all_single of the counts [E, n/E] (how many rows this rank sends
        to each expert of each rank), (2) all_to_all_single of the T*k rows, sorted by expert, to
        the ranks owning their experts (uneven splits; a rank with no tokens sends and receives
        empty tensors but takes part), each rank runs its grouped experts over what it received
        (one GEMM pair per expert over every source's rows), (3) the reverse all_to_all_single
        brings each pair's output back to where its row came from. The caller then adds the
        outputs times their routing weights expert by expert, exactly as with E = 1, so the sum
        of every token runs in the same order: EP 1's bits wherever the experts' products are.
    decode (the same rows on every rank)   `same_rows`: every decode rank runs the whole model on
        the same new token(s), so nothing needs dispatching: each rank adds its own experts'
        share of every row in float32 and one all-reduce of the [B, dim] float32 partials (the
        engine hands in the TP reducer, parallel/allreduce.py: shared memory on one host) sums
        them; one collective of dim floats a row instead of three round trips of k rows. The
        float32 sum then runs over ranks (each rank's experts in order, then the ranks in order)
        rather than over experts: within float32 rounding of EP 1, rounded once to the model dtype.

Bytes (what `CommStats` records): "ep-counts" the counts, "ep-dispatch" the rows sent to other
ranks, "ep-combine" the outputs sent back, "ep-all-reduce" the decode partials.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .config import ModelConfig

RunExpert = Callable[[int, torch.Tensor], torch.Tensor]
"""run(local expert j, rows [n, dim]) -> [n, dim]: this rank's j-th expert on n rows."""


def ep_problem(config: ModelConfig, ep: int, cp_size: int | None = None, decode_rank: int = 0,
               decode_ranks: int | None = None) -> str | None:
    """Why `config` cannot spread its experts over `ep` ranks of a job with `cp_size` CP ranks whose
    decode ranks are decode_rank .. decode_rank + decode_ranks - 1 (one line naming what to use), or None."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return f"ep must be a positive integer, got {ep!r}"
    if ep == 1:
        return None
    counts = sorted({e.n_experts for e in config.layer_experts if e is not None})
    if not counts:
        return (f"ep={ep} spreads the experts of a mixture of experts over ranks, but {config.name} is a dense "
                f"model (no experts); use ep=1 (--ep 1)")
    for n in counts:
        if n % ep:
            divisors = [d for d in range(1, n + 1) if all(c % d == 0 for c in counts)]
            return (f"ep={ep} does not divide the {n} experts of {config.name}; "
                    f"use one of {', '.join(map(str, divisors))}")
    if cp_size is not None and cp_size % ep:
        return (f"ep={ep} does not divide the {cp_size} CP ranks (ranks / tp): the experts are spread over "
                f"{ep} consecutive CP ranks; run a multiple of {ep} CP ranks or pick an ep that divides {cp_size}")
    if decode_ranks is not None and (decode_ranks % ep or decode_rank % ep):
        return (f"ep={ep} needs the decode ranks to be whole EP groups (they decode the same token together), but "
                f"they are CP ranks {decode_rank}..{decode_rank + decode_ranks - 1}; use decode_ranks a multiple of "
                f"{ep} starting at a multiple of {ep} (--decode-ranks {ep})")
    return None


@dataclass
class ExpertParallel:
    """This rank's place in its expert-parallel group and the group's collectives.

    The default (size 1) is "no expert parallelism": this rank holds every expert.
    """

    size: int = 1
    """E: ranks over which every MoE layer's experts are spread."""
    rank: int = 0
    """This rank's index in the EP group, 0 .. E-1: it holds experts [rank*n/E, (rank+1)*n/E)."""
    group: object | None = None
    """The EP group's torch.distributed ProcessGroup (None: the world)."""
    reducer: object | None = None
    """The all-reduce of the group for same-row steps (parallel/allreduce.py's `make_all_reduce`, a
    callable x -> bytes sent), or None: the group's all_reduce."""
    stats: object | None = None
    """A CommStats that records each collective's bytes while set."""
    same_rows: bool = False
    """True while every rank of the group runs the layers on the same rows (a decode step)."""

    def experts(self, n_experts: int) -> tuple[int, int]:
        """[start, stop) of the experts this rank holds out of `n_experts`."""
        per = n_experts // self.size
        return self.rank * per, (self.rank + 1) * per

    def local_expert(self, n_experts: int, expert: int) -> int | None:
        """Expert `expert`'s index among this rank's experts, or None when another rank holds it."""
        first, last = self.experts(n_experts)
        return expert - first if first <= expert < last else None

    @contextlib.contextmanager
    def replicated_rows(self):
        """Within this block every rank of the group runs the layers on the same rows (decode steps).
        Without EP nothing changes (NO_EP, which every such model shares, is never written)."""
        if self.size == 1:
            yield
            return
        before, self.same_rows = self.same_rows, True
        try:
            yield
        finally:
            self.same_rows = before

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the EP group in place; returns x."""
        if self.reducer is not None:
            sent = self.reducer(x)
        else:
            dist.all_reduce(x, group=self.group)
            sent = 2 * (self.size - 1) * x.numel() * x.element_size() // self.size
        self._record("ep-all-reduce", sent)
        return x

    def _record(self, kind: str, nbytes: int) -> None:
        if self.stats is not None:
            self.stats.record(kind, 0, nbytes)


NO_EP = ExpertParallel()
"""No expert parallelism (the default of every model)."""


def run_experts(rows: torch.Tensor, counts: list[int], run: RunExpert, ep: ExpertParallel) -> torch.Tensor:
    """Each row through its expert, wherever that expert lives: the two-shot all-to-all.

    rows [n, dim]: the (token, expert) pairs of this rank, sorted by expert; counts: how many of
    them each of the layer's experts got (len = n_experts, sum = n). Returns [n, dim_out] in the
    order of `rows`: row i through its expert. Collective over ep.group: every rank calls it for
    the same layer, with n = 0 where it has no tokens."""
    world, n_experts = ep.size, len(counts)
    per = n_experts // world
    device = rows.device
    # NCCL moves GPU tensors only; gloo CPU ones
    where = device if dist.get_backend(ep.group) == "nccl" else torch.device("cpu")
    send_counts = torch.tensor(counts, dtype=torch.long).view(world, per)  # [destination, its expert]
    recv_counts = torch.empty_like(send_counts, device=where)
    # (1) the counts: recv_counts[s, j] = rows source s sends to this rank's expert j
    dist.all_to_all_single(recv_counts, send_counts.to(where), group=ep.group)
    recv_counts = recv_counts.cpu()
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    ep._record("ep-counts", (world - 1) * per * send_counts.element_size())
    # (2) the rows, to the ranks holding their experts (rows sorted by expert: one run per rank)
    received = rows.new_empty(sum(recv_splits), rows.shape[1])
    dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=ep.group)
    ep._record("ep-dispatch", (rows.shape[0] - send_splits[ep.rank]) * rows.shape[1] * rows.element_size())
    # each local expert over every source's rows: received is [source][expert j] runs
    starts = torch.cat([torch.zeros(1, dtype=torch.long), recv_counts.reshape(-1).cumsum(0)[:-1]]).view(world, per)
    outputs = None
    for j in range(per):
        taken = [torch.arange(int(starts[s, j]), int(starts[s, j] + recv_counts[s, j])) for s in range(world)]
        index = torch.cat(taken).to(device)
        if index.numel() == 0:
            continue  # an expert no row chose: its weights are not read
        y = run(j, received[index])
        if outputs is None:
            outputs = y.new_empty(received.shape[0], y.shape[1])
        outputs[index] = y
    if outputs is None:  # nothing for this rank's experts (it still takes part in the combine)
        outputs = rows.new_empty(0, rows.shape[1])
    # (3) the outputs back to the ranks their rows came from, in the order they were sent
    back = outputs.new_empty(rows.shape[0], outputs.shape[1])
    dist.all_to_all_single(back, outputs.contiguous(), send_splits, recv_splits, group=ep.group)
    ep._record("ep-combine", (outputs.shape[0] - recv_splits[ep.rank]) * outputs.shape[1] * outputs.element_size())
    return back

