"""Decoding over a KV cache split by token across the decode ranks of one host.

Every decode rank holds the weights and a slice of the cache (a balanced share of the tokens, in
any order). For each new token:

    leader (decode rank 0)   broadcast (token, go) to the decode ranks
    every decode rank        run the layers on the token (the same on every rank); at each layer
                             the owner of this step writes the token's K/V into its slice, every
                             rank attends the token's query to its own slice -> (out, lse), and one
                             all-gather of the partials lets every rank merge them exactly (Eq. 4)
    leader                   final norm, LM head, sampling (the other ranks skip the head)

The owner of a step is the decode rank with the fewest rows (ties: round-robin, offset by one each
step), so the slices stay level as the answer grows. Merging all-gathered partials rather than
running the paper's pass-Q ring (Algorithm 4) costs one collective of N * Hq * (D + 1) floats per
layer instead of N - 1 ring steps plus an all-to-all; for one token both are latency-bound, and
the all-gather is one round trip (scripts/bench_decode.py --merge: pass-Q took 5.7-17x longer at
2 ranks).
On CPUs the decode ranks, which always share a host, all-gather through shared memory
(runtime/shm_exchange.py) rather than gloo; on GPUs through the process group (NCCL).

On CPUs with the ringctx kernels the whole step runs in the fused decode kernel (8-bit slices
too), which calls back into `_merge` between each layer's attention and output projection;
elsewhere it runs as PyTorch ops layer by layer (`_layers`).

The question that precedes an answer is prefilled over the same ranks with `cp_prefill`, each
rank's slice serving as its cached tokens in place. One decode rank is the same with a group of
one (LOCAL): an answer alone then takes the steps a batch takes (runtime/batch.py: the same
prefill, the fused step's document the slice's rows before the answer, the same owner rule), so
`Engine.generate` and a batch give the same bits.

Under tensor parallelism every TP rank of the decode host runs this over its own KV heads: the
decode group is then the decode ranks of one TP index (they split the tokens), the leader's
(token, go) goes to the whole decode host (`control_group`), the layers all-reduce inside the TP
group, and every TP rank of the first decode rank takes part in the vocabulary-parallel head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention import PartialAccumulator
from ..model import KVCache
from ..model.decode_step import FusedStep, step_logits
from ..model.transformer import HybridAttend
from ..parallel.comm import all_gather_ints, rank_and_world
from .failures import maybe_die
from .prefill import PrefillConfig, cp_prefill
from .shm_exchange import ShmExchange, shm_supported


SAME_AS_GROUP = object()
"""ShardedDecoder's default control group: the decode group itself."""


class ShardedDecoder:
    """Prefill and decode steps of one sequence whose KV cache is split over `group`'s ranks.

    Call every method on every rank of the group, in the same order; `step` on the leader,
    `follow` on the others (it returns when the leader calls `close`).

    Args:
        model: the Transformer (the same weights on every rank).
        cache: this rank's slice (KVCache with positions, or any KVCache: rows in any order).
        length: tokens of the whole sequence so far (the next token's position).
        group: the decode ranks' process group; leader is group rank 0.
        prefill_config: chunking and strategy of question prefills (its decode_ranks must be the
            group's size and decode_rank 0).
        timeout_s: how long a merge waits for a rank that stops answering.
        control_group: the ranks the leader's tokens go to (default: `group`); under tensor
            parallelism every TP rank of the decode ranks. None: the world; "local": this rank alone.
        leader: the global rank that samples (default: rank 0 of `group`).
    """

    def __init__(self, model, cache: KVCache, length: int, group, prefill_config: PrefillConfig,
                 timeout_s: float = 300.0, control_group=SAME_AS_GROUP, leader: int | None = None):
        self.model, self.cache, self.length, self.group = model, cache, length, group
        # this rank's document rows: the fused steps attend them apart from the answer's own rows,
        # as a batch does (model/decode_step.py), so an answer alone and in a batch are the same bits
        self.shared_rows = cache.length
        self.config = prefill_config
        self.rank, self.world = rank_and_world(group)
        self.control_group = group if control_group is SAME_AS_GROUP else control_group
        if leader is None:
            leader = dist.get_global_rank(group, 0) if isinstance(group, dist.ProcessGroup) else 0
        self.leader = leader
        self.is_leader = rank_and_world(None)[0] == leader
        self._broadcasts = rank_and_world(self.control_group)[1] > 1
        self.steps = 0
        # every rank's slice length, then tracked without messages
        self.rows = [r[0] for r in all_gather_ints([cache.length], group, self.world)]
        # (token, go): on the GPU under NCCL, which moves device tensors only
        self._control = torch.zeros(2, dtype=torch.long, device=model.device if model.device.type == "cuda" else "cpu")
        self._closed = self._prefilled = False
        self._fused: FusedStep | None = None  # the fused CPU step over this slice, where it applies
        self._fused_cache: KVCache | None = None
        cfg = model.config
        self._shm = ShmExchange.create(cfg.n_heads * (cfg.widest_head_dim + 1), group, timeout_s) \
            if self.world > 1 and shm_supported(model.device) else None

    # -- prompt -------------------------------------------------------------------------------
    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Prefill token_ids [T] on top of the slices; float32 logits [1, vocab] of the last one."""
        self._check_not_closed()
        self._prefilled = True
        result = cp_prefill(self.model, token_ids, self.config, group=self.group, shard=self.cache)
        self.cache = result.cache
        self.rows = list(result.stats.decode_slice_rows_per_rank)
        self.length += int(token_ids.numel())
        return result.logits[None]

    # -- steps --------------------------------------------------------------------------------
    def step(self, token: int) -> torch.Tensor:
        """Leader: feed `token`, get float32 logits [1, vocab] of the next position."""
        self._check_not_closed()
        self._control[0], self._control[1] = token, 1
        self._send_control()
        return self._forward(token)

    def follow(self) -> None:
        """Other ranks: run the steps the leader asks for, until it closes the decode."""
        while self.follow_step():
            pass

    def follow_step(self) -> bool:
        """Other ranks: take part in the leader's next `step` (True) or `close` (False). A rank
        driven by commands calls this once per step the leader announces, so that it can run
        other work between two steps."""
        self._send_control()
        if int(self._control[1]) == 0:
            self._closed = True
            return False
        self._forward(int(self._control[0]))
        return True

    def close(self, prompt_ids: torch.Tensor | None = None) -> None:
        """Leader: release the other ranks from `follow` (idempotent). An answer never started
        still runs its prompt's prefill (`prompt_ids`) first: the other ranks are waiting in it."""
        if not self._closed and self.is_leader:
            if not self._prefilled and prompt_ids is not None:
                self.prefill(prompt_ids)
            self._control.zero_()
            self._send_control()
        self._closed = True

    def _send_control(self) -> None:
        """(token, go) from the leader to every rank of the control group."""
        if self._broadcasts:
            dist.broadcast(self._control, src=self.leader, group=self.control_group)

    def _check_not_closed(self) -> None:
        if self._closed:  # the other ranks have left this answer: a newer question ended it
            raise ValueError("this answer was ended by a newer question on the same engine; read an answer to "
                             "its end before asking the next")

    def full(self) -> bool:
        """Never: slices grow as needed (each by one row every N steps)."""
        return False

    def owner(self) -> int:
        """The rank that stores this step's K/V (see `step_owner`)."""
        return step_owner(self.rows, self.steps)

    def _forward(self, token: int) -> torch.Tensor | None:
        maybe_die(rank_and_world(None)[0], f"decode{self.steps + 1}")  # RINGCTX_TEST_KILL: tests only
        cache = self.cache
        owner = self.owner()
        mine = owner == self.rank
        if mine and cache.length >= cache.max_tokens:
            self.cache = cache = cache.grown(cache.max_tokens + max(64, cache.max_tokens // 8))
        row = cache.length
        if mine and cache.positions is not None:  # set first: windowed layers read rows by position
            cache.positions[row] = self.length
        with torch.inference_mode():
            fused = self._fused_step()
            if fused is not None:  # every layer in one C call; it calls back for each merge
                logits = fused.split(token, self.length, row if mine else None, row + int(mine),
                                     self._merge if self.world > 1 else None, logits=self.rank == 0)
            else:
                logits = self._layers(token, row, mine)
        if mine:
            if cache.positions is not None:
                cache.positions[row] = self.length
            cache.length = row + 1
        self.rows[owner] += 1
        self.length += 1
        self.steps += 1
        return logits

    def _layers(self, token: int, row: int, mine: bool) -> torch.Tensor | None:
        """The step as PyTorch ops, layer by layer (GPUs, CPUs without the kernels)."""
        model, cache = self.model, self.cache

        def attend(layer: int, q, k, v):
            if mine:
                cache.update(layer, row, k, v)
            softmax = model.layer_softmax(layer)
            out, lse = cache.attend_rows(layer, q, row + int(mine), softmax=softmax, q_positions=[self.length])
            return softmax.finish(*merge_across_ranks(out, lse, self.world, self.group, self._shm, with_lse=True)
                                  ).to(q.dtype)

        def mix_linear(layer: int, module, x):
            # the state is replicated on every decode rank, each advancing it alike by the same token
            y, cache.linear_states[layer] = module.forward(x, cache.linear_states[layer])
            return y

        x = model.embed(torch.tensor([token], device=model.device))
        rope = model.rope(torch.tensor([self.length], device=model.device))
        layers_attend = HybridAttend(attend, mix_linear) if model.config.has_linear else attend
        with model.ep.replicated_rows():  # every decode rank runs the same token (model/expert_parallel.py)
            for i, block in enumerate(model.layers):
                x = block.forward(x, rope, layers_attend, i)
        return step_logits(model, x) if self.rank == 0 else None

    def _fused_step(self) -> FusedStep | None:
        """The fused step over the current slice buffers (rebuilt when the slice has grown)."""
        if self._fused_cache is not self.cache:
            self._fused, self._fused_cache = FusedStep.build(self.model, self.cache, self.shared_rows), self.cache
        return self._fused

    def _merge(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's partial (out [1, Hq, D], lse [Hq, 1]) merged exactly, in float32, with the
        merged lse (a layer with sink logits applies them to the merged result)."""
        return merge_across_ranks(out, lse, self.world, self.group, self._shm, with_lse=True)


def step_owner(rows: list[int], steps: int) -> int:
    """The decode rank that stores a sequence's next K/V row, given every rank's rows of it and the
    steps decoded so far: the fewest rows, ties broken round-robin (offset by one each step), so the
    slices stay level as the answer grows."""
    world = len(rows)
    return min(range(world), key=lambda r: (rows[r], (r - steps) % world))


def merge_across_ranks(out: torch.Tensor, lse: torch.Tensor, world: int, group, shm: ShmExchange | None,
                       *, with_lse: bool = False):
    """Every decode rank's partial (out [T, Hq, D], lse [Hq, T]) merged exactly, in float32 [T, Hq, D]:
    one exchange (shared memory, or the group's all-gather), then the LSE merge in rank order (the
    same bits on every rank). T: the step's tokens (1 for one sequence, B for a batch).
    with_lse: return (out, lse [Hq, T]) (a layer with sinks needs the merged lse)."""
    T, H, D = out.shape
    if world == 1:  # the whole cache is here: the partial is the answer
        return (out.float(), lse) if with_lse else out.float()
    packed = torch.cat([out.float().reshape(-1), lse.reshape(-1)])
    if shm is not None:
        everyone = shm.exchange(packed)
    else:
        everyone = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(everyone, packed, group=group)
    acc = PartialAccumulator(T, H, D, device=out.device)
    for part in everyone:
        acc.add(part[:T * H * D].view(T, H, D), part[T * H * D:].view(H, T))
    return (acc.out, acc.lse) if with_lse else acc.out
