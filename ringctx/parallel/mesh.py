"""The 2-D mesh of ranks: context parallelism (cp) across, tensor parallelism (tp) inside a host.

    global rank = cp_rank * tp_size + tp_rank          (TP ranks are consecutive: one host)

    tp = 2, cp = 2 (two hosts of two devices):     host 0: ranks 0 1      host 1: ranks 2 3
        TP groups (all-reduce every layer)             {0, 1}                 {2, 3}
        CP groups (the ring, one per TP rank)          {0, 2} over TP rank 0's heads, {1, 3} over TP rank 1's

Every TP rank runs the prefill's ring inside its own CP group over its own heads, so ring
messages are 1/tp of the CP-only size, and all-reduces stay on the fast links of one host.
The groups come from PyTorch's `init_device_mesh` (dimension names "cp" and "tp"). The mesh
hands out process groups only; the engine wraps the TP group in the model's `TensorParallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist



@dataclass
class Mesh:
    """This rank's place in the (cp, tp) mesh and the process groups of its row and column."""

    cp_size: int
    """CP ranks: world / tp_size."""
    tp_size: int
    """TP ranks per CP rank (one model copy is split over them)."""
    cp_rank: int
    """This rank's index along CP (its place in the ring)."""
    tp_rank: int
    """This rank's index inside its TP group."""
    cp_group: object
    """The ring's group: "local" when cp_size is 1, None (the world) without TP, else the mesh's."""
    tp_group: object | None = None
    """This rank's TP group (a ProcessGroup), None when tp_size is 1."""
    device_mesh: object | None = None
    """PyTorch's DeviceMesh, when TP made one."""

    def global_rank(self, cp_rank: int, tp_rank: int = 0) -> int:
        """The global rank at (cp_rank, tp_rank)."""
        return cp_rank * self.tp_size + tp_rank


def mesh_problem(world: int, tp_size: int, ranks_per_host: int) -> str | None:
    """Why `world` ranks, `ranks_per_host` to a host, cannot form a mesh with TP `tp_size`, or None."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        return f"--tp must be a positive integer, got {tp_size!r}"
    if world % tp_size:
        return (f"tp={tp_size} does not divide the {world} ranks: run a multiple of {tp_size} ranks "
                f"(tp x CP ranks), or pick a tp that divides {world}")
    if tp_size > ranks_per_host:
        return (f"tp={tp_size} is larger than the {ranks_per_host} ranks of a host: tensor parallelism stays inside "
                f"one host (its all-reduces run every layer); use tp <= {ranks_per_host} and more CP ranks")
    if ranks_per_host % tp_size:
        return (f"tp={tp_size} does not divide the {ranks_per_host} ranks of each host, so a TP group would span two "
                f"hosts; launch a multiple of {tp_size} ranks per host (--nproc-per-node)")
    return None


def build_mesh(world: int, rank: int, tp_size: int, device_type: str = "cpu") -> Mesh:
    """This rank's Mesh; every rank of the job calls it (it creates the groups when tp_size > 1).

    Without TP no group is made: the ring runs over the world (None), or this process alone
    ("local") in a single-process job.
    """
    if tp_size == 1:
        group = "local" if world == 1 else None
        return Mesh(cp_size=world, tp_size=1, cp_rank=rank, tp_rank=0, cp_group=group)
    from torch.distributed.device_mesh import init_device_mesh

    cp_size = world // tp_size
    mesh = init_device_mesh(device_type, (cp_size, tp_size), mesh_dim_names=("cp", "tp"))
    cp_rank, tp_rank = divmod(rank, tp_size)
    cp_group = "local" if cp_size == 1 else mesh["cp"].get_group()
    return Mesh(cp_size=cp_size, tp_size=tp_size, cp_rank=cp_rank, tp_rank=tp_rank, cp_group=cp_group,
                tp_group=mesh["tp"].get_group(), device_mesh=mesh)


def decode_groups(mesh: Mesh, decode_rank: int, decode_ranks: int):
    """(this rank's decode group, the decode host's control group); every rank calls it.

    The decode group holds the CP ranks decode_rank .. decode_rank + decode_ranks - 1 of this
    rank's TP index: they split the tokens of the cache and merge attention partials. The control
    group holds every TP rank of those CP ranks: the leader's token reaches all of them. A group
    is None when it is the whole world and "local" when it is one rank (no messages at all).
    """
    world = mesh.cp_size * mesh.tp_size
    cp_ranks = range(decode_rank, decode_rank + decode_ranks)
    mine = None
    for t in range(mesh.tp_size):  # every rank makes every group, in the same order
        group = _group([mesh.global_rank(c, t) for c in cp_ranks], world)
        if t == mesh.tp_rank:
            mine = group
    control = _group([mesh.global_rank(c, t) for c in cp_ranks for t in range(mesh.tp_size)], world)
    return mine, control


def expert_group(mesh: Mesh, ep_size: int):
    """This rank's expert-parallel group: the `ep_size` consecutive CP ranks of its block (CP ranks
    b*ep .. (b+1)*ep - 1, b = cp_rank // ep) at its TP index (ringctx.model.expert_parallel says why
    those); every rank calls it (it makes every block's group, in the same order). None when it is
    the whole world, "local" for ep 1."""
    world = mesh.cp_size * mesh.tp_size
    mine = "local"
    if ep_size == 1:
        return mine
    for t in range(mesh.tp_size):
        for first in range(0, mesh.cp_size, ep_size):
            group = _group([mesh.global_rank(c, t) for c in range(first, first + ep_size)], world)
            if t == mesh.tp_rank and first <= mesh.cp_rank < first + ep_size:
                mine = group
    return mine


def _group(ranks: list[int], world: int):
    """A group of `ranks`: None when it is the world, "local" for one rank, else a new group
    (every rank of the job calls it, members or not)."""
    if len(ranks) == world:
        return None
    if len(ranks) == 1:
        return "local"
    return dist.new_group(ranks)
