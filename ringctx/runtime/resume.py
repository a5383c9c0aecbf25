"""A prefill that keeps a checkpoint, and starts from one: what every rank runs to open it.

    open_checkpointed_prefill(...)         on every rank (cp x tp), before the first chunk
        leader   decide_resume: fresh, exact or reslice (runtime/checkpoint.py), from the files
                 alone; makes the files the plan needs; sends the plan to every rank
        fresh    every rank: a new journal; a PrefillRun over every token
        exact    every rank: its journal cut to the records every rank wrote; its base rows (when
                 the run has them) as its split cache; a PrefillRun over the tokens after them
                 with the run's own hardware profile (the same strategy per chunk), then
                 `restore` of the chunks done: the shards the stopped run held, bit for bit
        reslice  every rank: its share of the tokens done, read from the old run's records as
                 documents load (runtime/documents.py), written as its base record of a new run;
                 once every rank's is on disk the old runs go; a PrefillRun on top of the shares

A problem (a checkpoint made for other tokens or another model, a record that fails its checksum)
is a ValueError on every rank, before any rank communicates in the prefill.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..parallel.comm import agree_across_ranks, all_gather_bytes
from .checkpoint import (ChunkWriter, ResumePlan, base_record, cache_from_record, chunk_records, decide_resume,
                         drop_other_runs, ingest_header, rank_name, read_journal, read_record, rows_record,
                         run_settings, source_manifest, start_checkpoint)
from .documents import load_document_slices
from .prefill import PrefillRun


def open_checkpointed_prefill(model, token_ids: torch.Tensor, config, *, directory: str, restart: bool,
                              extra: dict, drop_unseen: bool, cp_group, cp_rank: int, cp_size: int,
                              tp_rank: int, world_group, global_rank: int, world_size: int,
                              on_chunk=None) -> tuple[PrefillRun, ResumePlan]:
    """This rank's PrefillRun of `token_ids` (the whole prompt) writing the checkpoint at
    `directory`, resumed from it where it has chunks of the same ingest; and the plan (for the
    line that says so). Every rank of the engine calls it (world_group: all of them)."""
    directory = os.path.abspath(directory)
    header = ingest_header(model, token_ids, config.kv_dtype, drop_unseen, extra)
    settings = run_settings(model, config, cp_size)
    plan, problem = None, None
    # every rank has run the commands before this one (a cancelled ingest's writer closes there, on
    # each rank in its own time) before the leader reads their journals
    _agree(None, world_group, world_size)
    if global_rank == 0:
        plan, problem = decide_resume(directory, header, settings, restart)
        if problem is None:
            try:
                start_checkpoint(directory, plan, header, token_ids, settings)
            except OSError as exc:
                problem = f"cannot write the checkpoint {directory!r}: {exc}"
    _agree(problem, world_group, world_size)  # the leader's problem, raised on every rank
    plan = ResumePlan.from_json(all_gather_bytes(plan.to_json() if global_rank == 0 else b"", world_group,
                                                 world_size)[0])

    name = rank_name(cp_rank, tp_rank)
    common = dict(group=cp_group, on_chunk=on_chunk, drop_unseen=drop_unseen)
    if plan.mode == "fresh":
        writer = ChunkWriter(plan.run, name, global_rank, keep=[])
        return PrefillRun(model, token_ids, config, checkpoint=writer, **common), plan

    if plan.mode == "exact":
        journal = read_journal(os.path.join(plan.run, name + ".jsonl"))
        base, chunks = base_record(journal), chunk_records(journal)[:plan.chunks]
        shard, problem = None, None
        if plan.base_tokens:
            try:
                shard = cache_from_record(read_record(plan.run, name, base), model, config.kv_dtype,
                                          sliced=cp_size > 1, room=0)
            except (ValueError, OSError, KeyError, TypeError) as exc:
                problem = f"the checkpoint does not resume: {exc}; start over with --restart (restart=True)"
        _agree(problem, world_group, world_size)
        from ..planning.hardware import HardwareProfile

        # the strategies the stopped run would have chosen: the profile it decided with
        config = dataclasses.replace(config, hardware=HardwareProfile.from_dict(plan.source_settings["hardware"]))
        writer = ChunkWriter(plan.run, name, global_rank, keep=([base] if base else []) + chunks)
        b = plan.base_tokens
        run = PrefillRun(model, token_ids[b:], config, shard=shard, cache_token_ids=token_ids[:b] if b else None,
                         own_cached=b > 0, checkpoint=writer, **common)
        run.restore(chunks, lambda record: read_record(plan.run, name, record))
        return run, plan

    # reslice: the tokens done, read over this mesh as a document loads, become each rank's base
    manifest = source_manifest(directory, plan, header, model)
    shard, _, _ = load_document_slices(directory, model, group=cp_group, rank=cp_rank, world=cp_size, room=0,
                                       manifest=manifest)
    writer = ChunkWriter(plan.run, name, global_rank, keep=[])
    base = rows_record(shard, 0, shard.length, shard.row_positions(), states=cp_rank == 0 and model.config.has_linear)
    writer.append({"kind": "base", "rows": shard.length}, base)
    writer.wait()
    written = all_gather_bytes(b"" if writer.problem else b"1", world_group, world_size)
    if global_rank == 0 and all(written):  # the new run stands alone now: the old ones go
        drop_other_runs(directory, plan.run)
    b = plan.base_tokens
    run = PrefillRun(model, token_ids[b:], config, shard=shard, cache_token_ids=token_ids[:b], own_cached=True,
                     checkpoint=writer, **common)
    return run, plan


def _agree(problem: str | None, group, world: int) -> None:
    if world > 1:
        agree_across_ranks("ingest checkpoint", problem, "checkpoint", group)
    elif problem:
        raise ValueError(problem)
