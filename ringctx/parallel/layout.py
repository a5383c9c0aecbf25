"""ShardLayout: which rank holds which tokens, and which blocks each rank must compute.

Load-balanced sharding (paper, "Load-balanced sharding"). The new tokens of every sequence are
cut into 2N equal chunks (the last ones padded when the length is not a multiple of 2N); rank i
holds chunks i and 2N-1-i, so every rank gets the same amount of causal work:

    N = 2, one sequence of 10 new tokens, chunk = ceil(10 / 4) = 3 tokens:

    new tokens   0 1 2 | 3 4 5 | 6 7 8 | 9 . .        (. = padding, never materialized)
    chunk          C0      C1      C2      C3
    rank 0         C0                      C3   -> rows 0 1 2 9
    rank 1                 C1      C2           -> rows 3 4 5 6 7 8

Several sequences ("fused varseq") are sharded one by one and each rank's pieces concatenated in
sequence order. Cached tokens (an earlier prompt whose K/V is already on the ranks) need no
balancing since every new token sees all of them: by default each sequence's cached tokens are
split contiguously and evenly, but any split (`cached_counts`) is allowed, e.g. the one the
chunked prefill engine leaves behind.

Local row order on rank r: for each sequence, chunk r then chunk 2N-1-r (new tokens), and for the
cache, each sequence's cached rows in order. In a KV ring message the rows of a sequence are
[its cached rows, chunk r, chunk 2N-1-r], sequence after sequence, so the keys a query block needs
are always one contiguous range.

Padding rows are never materialized in tensors the caller sees; the ring pads its messages to the
largest rank's size so that every message in a step has the same size (paper, Algorithm 2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..attention.spans import FULL, Run, Span, band_blocks, runs_of


@dataclass(frozen=True)
class BlockTask:
    """One attention call: local query rows against a contiguous range of a KV message."""

    q_start: int
    """First local query row (in the query rank's row order)."""
    q_end: int
    """One past the last query row."""
    k_start: int
    """First row of the KV message (in the KV rank's message order)."""
    k_end: int
    """One past the last KV row."""
    causal: bool
    """False for a full block; True for a band (`attention_block`): with q_offset 0 and no window
    a square diagonal block (a chunk against itself)."""
    q_offset: int = 0
    """The band's offset: query row i sees key rows up to i + q_offset (windowed and chunked layers)."""
    window: int = 0
    """The band's sliding window (0: none)."""
    query: int = 0
    """Which rotated version of the queries the block uses (dual chunk layers: 0 intra, 1 succ,
    2 inter; see attention/dual_chunk.py); 0 elsewhere."""


@dataclass(frozen=True)
class _SeqPiece:
    """Where one sequence's tokens sit on one rank."""

    a: tuple[int, int]
    """[start, end) of chunk r within the sequence's new tokens."""
    b: tuple[int, int]
    """[start, end) of chunk 2N-1-r within the sequence's new tokens."""
    cached: int
    """Cached tokens of this sequence held by this rank."""
    cached_start: int
    """Index of the first of them within the sequence's cached tokens."""


@dataclass(frozen=True)
class ShardLayout:
    """Placement of new and cached tokens of one or several sequences over N ranks.

    Build it with `ShardLayout.balanced`. Every rank must hold an identical layout; ring_attention
    checks that across ranks before communicating.
    """

    world_size: int
    """Number of context-parallel ranks N."""
    new_lens: tuple[int, ...]
    """New (not yet cached) tokens per sequence."""
    cached_counts: tuple[tuple[int, ...], ...]
    """cached_counts[rank][seq]: cached tokens of sequence seq held by rank."""
    cached_runs: tuple[tuple[tuple[tuple[int, int], ...], ...], ...] | None = None
    """cached_runs[rank][seq]: the positions of those cached rows, in row order, as (first position,
    rows) runs of consecutive positions; None: each sequence's cached tokens lie in position order,
    split contiguously over the ranks (rank 0 the first). Only windowed and chunked layers read
    positions of cached rows (`block_tasks` with a span); full attention sees them all."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    """Per-instance cache of derived index tensors and task lists (layouts are immutable)."""

    def _cached(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # ------------------------------------------------------------------ construction
    @classmethod
    def balanced(
        cls,
        new_lens: int | Sequence[int],
        world_size: int,
        cached_lens: int | Sequence[int] | None = None,
        *,
        cached_counts: Sequence[Sequence[int]] | None = None,
        cached_positions: Sequence[Sequence[torch.Tensor]] | None = None,
        cached_runs: Sequence[Sequence[Sequence[tuple[int, int]]]] | None = None,
    ) -> "ShardLayout":
        """Balanced layout of `new_lens` new tokens per sequence over `world_size` ranks.

        Args:
            new_lens: new tokens of each sequence (an int for a single sequence).
            world_size: number of ranks N >= 1.
            cached_lens: cached tokens of each sequence, split contiguously and as evenly as
                possible (rank r gets [floor(r*P/N), floor((r+1)*P/N))).
            cached_counts: instead of cached_lens, the exact split: cached_counts[rank][seq].
            cached_positions: with cached_counts, the positions of each rank's cached rows of each
                sequence, [rank][seq] -> LongTensor [cached_counts[rank][seq]] (rows in any order);
                None: in order, as cached_lens splits them.
            cached_runs: the same as (position, rows) runs of consecutive positions in row order
                (what a long prefill keeps: two runs per chunk, not a position per row).

        Example:
            >>> layout = ShardLayout.balanced([10], 2)
            >>> layout.new_token_index(0).tolist(), layout.new_token_index(1).tolist()
            ([0, 1, 2, 9], [3, 4, 5, 6, 7, 8])
        """
        if isinstance(new_lens, int):
            new_lens = [new_lens]
        new_lens = tuple(int(n) for n in new_lens)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not new_lens:
            raise ValueError("new_lens is empty: give the new token count of at least one sequence")
        if any(n < 0 for n in new_lens):
            raise ValueError(f"new_lens must be >= 0, got {list(new_lens)}")
        if cached_lens is not None and cached_counts is not None:
            raise ValueError("give cached_lens or cached_counts, not both")
        if cached_counts is None:
            if cached_lens is None:
                cached_lens = [0] * len(new_lens)
            elif isinstance(cached_lens, int):
                cached_lens = [cached_lens]
            cached_lens = [int(p) for p in cached_lens]
            if len(cached_lens) != len(new_lens):
                raise ValueError(f"cached_lens has {len(cached_lens)} entries but new_lens has {len(new_lens)}")
            if any(p < 0 for p in cached_lens):
                raise ValueError(f"cached_lens must be >= 0, got {cached_lens}")
            cached_counts = [
                [(r + 1) * p // world_size - r * p // world_size for p in cached_lens] for r in range(world_size)
            ]
        counts = tuple(tuple(int(c) for c in row) for row in cached_counts)
        if len(counts) != world_size or any(len(row) != len(new_lens) for row in counts):
            raise ValueError(f"cached_counts must be [world_size={world_size}][num_seqs={len(new_lens)}]")
        if any(c < 0 for row in counts for c in row):
            raise ValueError("cached_counts must be >= 0")
        runs = None
        if cached_positions is not None:
            cached_runs = [[[(r.position, r.length) for r in _runs(p)] for p in ranks] for ranks in cached_positions]
        if cached_runs is not None:
            runs = tuple(tuple(tuple((int(p), int(n)) for p, n in seq if n) for seq in ranks) for ranks in cached_runs)
            got = [[sum(n for _, n in seq) for seq in ranks] for ranks in runs]
            if got != [list(row) for row in counts]:
                raise ValueError(f"cached_positions give {got} rows per rank and sequence, cached_counts {counts}")
        return cls(world_size=world_size, new_lens=new_lens, cached_counts=counts, cached_runs=runs)

    # ------------------------------------------------------------------ sizes
    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    @property
    def cached_lens(self) -> tuple[int, ...]:
        """Cached tokens per sequence (over all ranks)."""
        return tuple(sum(self.cached_counts[r][s] for r in range(self.world_size)) for s in range(self.num_seqs))

    @property
    def total_new(self) -> int:
        return sum(self.new_lens)

    @property
    def total_cached(self) -> int:
        return sum(self.cached_lens)

    def chunk_len(self, seq: int) -> int:
        """Tokens per chunk of sequence `seq` (ceil(T / 2N)); the last chunks may be short or empty."""
        return -(-self.new_lens[seq] // (2 * self.world_size))

    def num_new(self, rank: int) -> int:
        """New-token rows held by `rank`."""
        return sum(p.a[1] - p.a[0] + p.b[1] - p.b[0] for p in self._pieces(rank))

    def num_cached(self, rank: int) -> int:
        """Cached-token rows held by `rank`."""
        return sum(self.cached_counts[rank])

    @property
    def q_message_rows(self) -> int:
        """Rows of a pass-Q message: the largest rank's new tokens (all messages equal-sized)."""
        return max(self.num_new(r) for r in range(self.world_size))

    @property
    def kv_message_rows(self) -> int:
        """Rows of a pass-KV message: max over ranks of cached + new tokens (paper: max P_i + ceil(T/N))."""
        return max(self.num_new(r) + self.num_cached(r) for r in range(self.world_size))

    # ------------------------------------------------------------------ placement
    def piece_lengths(self, rank: int) -> tuple[int, int]:
        """New tokens of this rank's two pieces (chunk r, then chunk 2N-1-r) of a one-sequence layout:
        its local rows are those of the first, then those of the second."""
        if self.num_seqs != 1:
            raise ValueError(f"piece_lengths is for a layout of one sequence; this one has {self.num_seqs}")
        piece = self._pieces(rank)[0]
        return piece.a[1] - piece.a[0], piece.b[1] - piece.b[0]

    def _pieces(self, rank: int) -> tuple[_SeqPiece, ...]:
        return self._cached(("pieces", rank), lambda: self._compute_pieces(rank))

    def _compute_pieces(self, rank: int) -> tuple[_SeqPiece, ...]:
        self._check_rank(rank)
        n2 = 2 * self.world_size
        pieces = []
        for s, t in enumerate(self.new_lens):
            c = self.chunk_len(s)

            def chunk(i: int) -> tuple[int, int]:
                return min(i * c, t), min((i + 1) * c, t)

            cached_start = sum(self.cached_counts[r][s] for r in range(rank))
            pieces.append(_SeqPiece(chunk(rank), chunk(n2 - 1 - rank), self.cached_counts[rank][s], cached_start))
        return tuple(pieces)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the layout's world of {self.world_size} ranks")

    def _ranges(self, rank: int, what: str) -> torch.Tensor:
        """Concatenated aranges describing `rank`'s rows (see the public methods below)."""
        parts, new_start, cached_start = [], 0, 0
        for s, piece in enumerate(self._pieces(rank)):
            if what == "cached_index":
                lo = cached_start + piece.cached_start
                parts.append(torch.arange(lo, lo + piece.cached))
            else:
                offset = {"new_index": new_start, "positions": self.cached_lens[s], "seq_ids": None}[what]
                for lo, hi in (piece.a, piece.b):
                    if offset is None:
                        parts.append(torch.full((hi - lo,), s, dtype=torch.long))
                    else:
                        parts.append(torch.arange(offset + lo, offset + hi))
            new_start += self.new_lens[s]
            cached_start += self.cached_lens[s]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def new_token_index(self, rank: int) -> torch.Tensor:
        """Indices (into all sequences' new tokens, concatenated) of `rank`'s rows, in local order."""
        return self._cached(("new_index", rank), lambda: self._ranges(rank, "new_index"))

    def cached_token_index(self, rank: int) -> torch.Tensor:
        """Indices (into all sequences' cached tokens, concatenated) of `rank`'s cached rows."""
        return self._cached(("cached_index", rank), lambda: self._ranges(rank, "cached_index"))

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions (within their sequence; cached tokens come first) of `rank`'s new rows."""
        return self._cached(("positions", rank), lambda: self._ranges(rank, "positions"))

    def seq_ids(self, rank: int) -> torch.Tensor:
        """Sequence id of each of `rank`'s new rows."""
        return self._cached(("seq_ids", rank), lambda: self._ranges(rank, "seq_ids"))

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s rows of x, whose dim 0 is all sequences' new tokens concatenated in order."""
        if x.shape[0] != self.total_new:
            raise ValueError(f"shard: x has {x.shape[0]} rows but the layout has {self.total_new} new tokens")
        return x.index_select(0, self.new_token_index(rank).to(x.device))

    def shard_cached(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s rows of x, whose dim 0 is all sequences' cached tokens concatenated in order."""
        if x.shape[0] != self.total_cached:
            raise ValueError(f"shard_cached: x has {x.shape[0]} rows but the layout has "
                             f"{self.total_cached} cached tokens")
        return x.index_select(0, self.cached_token_index(rank).to(x.device))

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: the W ranks' parts back into sequence order along dim 0."""
        return self._unshard(parts, self.new_token_index, self.total_new, self.num_new)

    def unshard_cached(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard_cached`."""
        return self._unshard(parts, self.cached_token_index, self.total_cached, self.num_cached)

    def _unshard(self, parts, index_of, total, rows_of) -> torch.Tensor:
        if len(parts) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} parts, got {len(parts)}")
        for r, part in enumerate(parts):
            if part.shape[0] != rows_of(r):
                raise ValueError(f"unshard: part {r} has {part.shape[0]} rows, the layout gives rank {r} {rows_of(r)}")
        out = parts[0].new_empty((total, *parts[0].shape[1:]))
        for r, part in enumerate(parts):
            out[index_of(r).to(out.device)] = part
        return out

    # ------------------------------------------------------------------ ring messages
    def kv_message_segments(self, rank: int) -> tuple[tuple[str, int, int, int], ...]:
        """How `rank`'s KV message is assembled: (source, src_start, dst_start, rows) copies.

        source is "cached" (rows of the local cached_k/v) or "new" (rows of the local k/v).
        """
        return self._cached(("segments", rank), lambda: self._compute_segments(rank))

    def _compute_segments(self, rank: int) -> tuple[tuple[str, int, int, int], ...]:
        segs, src_new, src_cached, dst = [], 0, 0, 0
        for piece in self._pieces(rank):
            n_new = piece.a[1] - piece.a[0] + piece.b[1] - piece.b[0]
            if piece.cached:
                segs.append(("cached", src_cached, dst, piece.cached))
            dst += piece.cached
            src_cached += piece.cached
            if n_new:
                segs.append(("new", src_new, dst, n_new))
            dst += n_new
            src_new += n_new
        return tuple(segs)

    def block_tasks(self, q_rank: int, kv_rank: int, span: Span = FULL) -> tuple[BlockTask, ...]:
        """The attention calls that q_rank's new tokens need against kv_rank's KV message.

        Fully masked blocks produce no task (they are skipped, not computed). A layer with a span
        (sliding window, chunks) gets blocks cut by global positions (`_span_tasks`): only keys its
        queries see, banded where needed. Plain causal layers: With a = chunk
        q_rank, b = chunk 2N-1-q_rank of the queries and a', b' those of the keys:
            kv_rank <  q_rank: [a, b] x [cached, a']            (b' is in the future of both)
            kv_rank >  q_rank: b x [cached, a', b'];  a x cached (a', b' are after a)
            kv_rank == q_rank: [a, b] x cached, and [a, b] x [a', b'] as one diagonal block (rows
                               and keys are the same tokens in increasing position order)
        """
        if not span.is_full:
            return self._cached(("tasks", q_rank, kv_rank, span), lambda: self._span_tasks(q_rank, kv_rank, span))
        return self._cached(("tasks", q_rank, kv_rank), lambda: self._compute_tasks(q_rank, kv_rank))

    def new_runs(self, rank: int) -> list[tuple[int, int]]:
        """(position, rows) runs of `rank`'s new rows of a one-sequence layout, in row order (the
        runs its cached rows gain once this layout's tokens are prefilled)."""
        if self.num_seqs != 1:
            raise ValueError("new_runs describes one sequence's rows")
        piece, base = self._pieces(rank)[0], self.cached_lens[0]
        return [(base + lo, hi - lo) for lo, hi in (piece.a, piece.b) if hi > lo]

    def _span_tasks(self, q_rank: int, kv_rank: int, span: Span) -> tuple[BlockTask, ...]:
        """block_tasks for a span: each sequence's query runs (chunks a and b of q_rank) against
        the runs of kv_rank's message (its cached rows' positions, then chunks a' and b')."""
        tasks: list[BlockTask] = []
        q_row, k_row = 0, 0
        for s, (qp, kp) in enumerate(zip(self._pieces(q_rank), self._pieces(kv_rank))):
            base = self.cached_lens[s]  # new tokens follow the sequence's cached ones
            q_runs = []
            for lo, hi in (qp.a, qp.b):
                if hi > lo:
                    q_runs.append(Run(q_row, base + lo, hi - lo))
                    q_row += hi - lo
            k_runs = []
            for position, n in self._cached_runs(kv_rank, s):
                k_runs.append(Run(k_row, position, n))
                k_row += n
            for lo, hi in (kp.a, kp.b):
                if hi > lo:
                    k_runs.append(Run(k_row, base + lo, hi - lo))
                    k_row += hi - lo
            tasks.extend(BlockTask(*band) for band in band_blocks(span, q_runs, k_runs))
        return tuple(tasks)

    def _cached_runs(self, rank: int, seq: int) -> tuple[tuple[int, int], ...]:
        """(position, rows) runs of `rank`'s cached rows of sequence `seq`, in row order."""
        if self.cached_runs is not None:
            return self.cached_runs[rank][seq]
        count = self.cached_counts[rank][seq]
        return ((sum(self.cached_counts[r][seq] for r in range(rank)), count),) if count else ()

    def needed_rows(self, q_rank: int, kv_rank: int, span: Span) -> tuple[int, int]:
        """[first, last + 1) of kv_rank's message rows that q_rank's queries need under `span`
        ((0, 0): none)."""
        tasks = self.block_tasks(q_rank, kv_rank, span)
        if not tasks:
            return 0, 0
        return min(t.k_start for t in tasks), max(t.k_end for t in tasks)

    def _compute_tasks(self, q_rank: int, kv_rank: int) -> tuple[BlockTask, ...]:
        tasks: list[BlockTask] = []
        q_row, k_row = 0, 0
        for qp, kp in zip(self._pieces(q_rank), self._pieces(kv_rank)):
            qa = (q_row, q_row + qp.a[1] - qp.a[0])
            qb = (qa[1], qa[1] + qp.b[1] - qp.b[0])
            kc = (k_row, k_row + kp.cached)
            ka = (kc[1], kc[1] + kp.a[1] - kp.a[0])
            kb = (ka[1], ka[1] + kp.b[1] - kp.b[0])
            q_row, k_row = qb[1], kb[1]
            if kv_rank < q_rank:
                wanted = [((qa[0], qb[1]), (kc[0], ka[1]), False)]
            elif kv_rank > q_rank:
                wanted = [(qb, (kc[0], kb[1]), False), (qa, kc, False)]
            else:
                # The rank's own rows [a, b] are in increasing position order, as are its keys
                # [a', b'] (the same tokens): one square causal block is exactly the mask.
                wanted = [((qa[0], qb[1]), kc, False), ((qa[0], qb[1]), (ka[0], kb[1]), True)]
            for (q0, q1), (k0, k1), causal in wanted:
                if q1 > q0 and k1 > k0:
                    tasks.append(BlockTask(q0, q1, k0, k1, causal))
        return tuple(tasks)

    def fingerprint(self) -> str:
        """A hash of the whole layout, compared across ranks before communicating."""
        text = f"{self.world_size}|{self.new_lens}|{self.cached_counts}"
        if self.cached_runs is not None:
            text += f"|{hashlib.sha256(repr(self.cached_runs).encode()).hexdigest()}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return (f"ShardLayout(world_size={self.world_size}, new_lens={list(self.new_lens)}, "
                f"cached_lens={list(self.cached_lens)})")


def _runs(positions) -> list[Run]:
    """Runs of consecutive positions of a LongTensor or a list of ints."""
    return runs_of(torch.as_tensor(positions, dtype=torch.long).view(-1))
