"""Starting the ranks of an Engine: how many (`auto_nproc`, `serving_layout`, the decode ranks),
what each checks before any rank starts (the model loads, the mesh splits it), and what each rank
builds once its group is up (`build_rank_state`: mesh, model, the ranks' agreement, decode groups)."""

from __future__ import annotations

import os
import re

import torch

from ..model import load_model
from ..model.kvfile import share_weights_digest, weights_digest
from ..model.expert_parallel import NO_EP, ExpertParallel
from ..model.tensor_parallel import NO_TP, TensorParallel
from ..parallel.allreduce import make_all_reduce
from ..parallel.comm import agree_across_ranks
from ..parallel.mesh import Mesh, build_mesh, decode_groups, expert_group
from ..planning.prefill_plan import default_chunk_tokens
from ..runtime.rank_state import EngineSettings, RankState


def tensor_parallel(mesh: Mesh, device, timeout_s: float = 300.0) -> TensorParallel:
    """The model's TensorParallel over this rank's TP group of the mesh (NO_TP without TP), with
    the all-reduce chosen by size (parallel/allreduce.py; a collective of the TP group)."""
    if mesh.tp_size == 1:
        return NO_TP
    return TensorParallel(size=mesh.tp_size, rank=mesh.tp_rank, group=mesh.tp_group,
                          reducer=make_all_reduce(mesh.tp_group, device, timeout_s))


def expert_parallel(mesh: Mesh, ep_size: int, device, timeout_s: float = 300.0) -> ExpertParallel:
    """The model's ExpertParallel over this rank's EP group (ep_size consecutive CP ranks of its TP
    index; NO_EP for ep 1), with the all-reduce of its same-row (decode) steps chosen as TP's
    (parallel/allreduce.py; a collective of the EP group)."""
    if ep_size == 1:
        return NO_EP
    group = expert_group(mesh, ep_size)
    return ExpertParallel(size=ep_size, rank=mesh.cp_rank % ep_size, group=group,
                          reducer=make_all_reduce(group, device, timeout_s))


def build_rank_state(rank: int, world: int, settings: EngineSettings, device, mode: str = "worker") -> RankState:
    """Load this rank's model, check it against every other rank's and make the decode groups."""
    mesh = build_mesh(world, rank, settings.tp_size, torch.device(device).type)
    model = load_model(settings.model_name, dtype=settings.dtype, device=device,
                       tp=tensor_parallel(mesh, device, settings.timeout_s),
                       weights=settings.weights, rope_scaling=settings.rope_scaling,
                       ep=expert_parallel(mesh, settings.ep_size, device, settings.timeout_s))
    state = RankState(settings=settings, mode=mode, rank=rank, world_size=world, mesh=mesh, model=model,
                      chunk_tokens=settings.chunk_tokens or default_chunk_tokens(model, world))
    if world > 1:
        if settings.tp_size > 1:
            share_weights_digest(model)
        try:
            agree_across_ranks("engine start-up", None, _fingerprint(model))
        except ValueError as exc:
            raise ValueError(_explain_mismatch(str(exc))) from None
        state.decode_group, state.control_group = decode_groups(mesh, settings.decode_rank, settings.decode_ranks)
    return state


def runs_on_gpu(device=None) -> bool:
    """Whether ranks given `device` run on GPUs: "cuda" asked for, or none asked for and CUDA here."""
    return (device is None and torch.cuda.is_available()) or (device is not None and "cuda" in str(device))


def auto_nproc(device=None, tp: int = 1) -> int:
    """Local ranks for nproc="auto": one per GPU; on a CPU with 2 or more cores, 2 ranks, each with
    half of the cores' threads (a CPU host gains little from more ranks than threads would give it,
    and every rank holds a copy of the weights); 1 on a single core. A mesh needs a multiple of
    `tp`: GPUs round down to one (never more ranks than GPUs, at least tp), CPU ranks round up."""
    if runs_on_gpu(device):
        return max(tp, torch.cuda.device_count() // tp * tp)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return -(-(2 if cores >= 2 else 1) // tp) * tp


def serving_nproc(device=None, tp: int = 1) -> tuple[int, str]:
    """(local ranks, why) of the layout that serves fastest here: one rank per GPU, and on a CPU one
    rank with every core. The ranks of a CPU host share its cores and its memory bandwidth, so a
    second rank brings no compute or bandwidth, only messages: on a 2-core AMD EPYC a decode step of
    SmolLM2 took 43-47 ms on one rank against 80-92 ms on two, and a first question over an
    8K-token document 36.8 s against 42.5 s (docs/BENCHMARKS.md). GPUs each bring their own."""
    if runs_on_gpu(device):
        n = max(tp, torch.cuda.device_count() // tp * tp)
        return n, f"one rank per GPU ({n}): each brings its own compute and memory"
    return tp, ("one rank with every core: CPU ranks of one host share its cores and memory bandwidth, so more "
                "ranks add messages, not speed" + (f" (tp={tp} needs {tp})" if tp > 1 else ""))


def serving_layout(nproc, device=None, tp: int = 1) -> tuple:
    """(ranks, note) for nproc="auto" of what serves questions (ingest, ask, serve): serving_nproc's
    layout and a line saying which and why; a number, or any nproc under torchrun (which sets the
    world), is taken as it is, with note None."""
    if nproc != "auto" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return nproc, None
    n, why = serving_nproc(device, tp)
    return n, f"--nproc auto: {n} rank(s): {why}"


def resolve_decode_ranks(decode_ranks: int | None, decode_rank: int, world: int, ranks_per_host: int) -> int:
    """How many decode ranks: None -> the decode host's ranks from decode_rank on; checked to lie
    on one host and within the job. A ValueError names what to change."""
    if not 0 <= decode_rank < world:
        raise ValueError(f"decode_rank {decode_rank} is not a rank of this {world}-rank job")
    host_end = min(world, (decode_rank // ranks_per_host + 1) * ranks_per_host)
    if decode_ranks is None:
        return host_end - decode_rank
    if not isinstance(decode_ranks, int) or decode_ranks < 1:
        raise ValueError(f"decode_ranks must be a positive number of ranks, got {decode_ranks!r}")
    if decode_ranks > world - decode_rank:
        raise ValueError(f"decode_ranks={decode_ranks} asks for more ranks than this {world}-rank job has from decode "
                         f"rank {decode_rank}; use at most {world - decode_rank} (--decode-ranks)")
    if decode_rank + decode_ranks > host_end:
        raise ValueError(f"decode_ranks={decode_ranks} would reach past the decode host (ranks {host_end - ranks_per_host}"
                         f"-{host_end - 1}); the decode ranks share one host's memory: use at most "
                         f"{host_end - decode_rank}")
    return decode_ranks


def peek_config(model_name: str, dtype, rope_scaling: str | None = None):
    """The whole model's config, read from the file's header (no weights loaded), stretched by rope_scaling."""
    return load_model(model_name, dtype=dtype, device="meta", rope_scaling=rope_scaling).full_config


def load_hardware(hardware, device=None):
    """(profile, measure): the profile the "auto" strategy decides with, loaded once
    (planning.hardware.resolve_hardware: None is this machine's calibrated profile, else the
    built-in "cpu" or "h200" on GPUs), and whether the ranks must measure this machine at start-up
    ("measured", or "auto" without a calibrated profile on a CPU); the profile is then the built-in
    "cpu" until they have."""
    from ..planning.hardware import MEASURED, HardwareProfile, load_profile, resolve_hardware

    if isinstance(hardware, HardwareProfile):
        return hardware, False
    resolved = resolve_hardware(hardware, runs_on_gpu(device))
    if resolved == MEASURED:
        return load_profile("cpu"), True
    return load_profile(resolved), False


def check_loadable(model_name: str, dtype) -> None:
    """Raise the loader's ValueError / FileNotFoundError now for an unknown model or dtype (cheap)."""
    from ..model.presets import PRESETS
    from ..model.loader import DEFAULT_MODEL, _classify_path, resolve_dtype

    resolve_dtype(dtype)
    if model_name != DEFAULT_MODEL and model_name not in PRESETS:
        _classify_path(model_name)


def _fingerprint(model) -> str:
    """What every rank must agree on: model (name, shapes, weights), dtype and ringctx version."""
    from ..version import __version__

    config = model.full_config  # TP ranks hold different shards of the same model
    return (f"model={config.name} config={config.fingerprint()} weights={weights_digest(model)} "
            f"format={model.weights_format} dtype={str(model.dtype).removeprefix('torch.')} ringctx={__version__}")


def _explain_mismatch(message: str) -> str:
    """agree_across_ranks' "ranks disagree" message, rewritten to show only what differs."""
    m = re.search(r"rank 0 has \[(.*)\] but rank (\d+) has \[(.*)\]", message)
    if not m:
        return message
    first, other = (dict(f.split("=", 1) for f in side.split() if "=" in f) for side in (m.group(1), m.group(3)))
    rank = m.group(2)
    diff = [k for k in first if first.get(k) != other.get(k)]
    if not diff:
        return message
    what = "; ".join(f"{k}={other.get(k)} on rank {rank} but {k}={first[k]} on rank 0" for k in diff)
    return (f"engine start-up: rank {rank} does not match rank 0: {what}. Every rank must load the same model "
            f"(--model), dtype (--dtype) and ringctx version; this job is refused rather than computing garbage")
