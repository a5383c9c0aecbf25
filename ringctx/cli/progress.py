"""The prefill's progress bar: progress and ETA in work (`planning.work.WorkProgress`), not chunks."""

from __future__ import annotations

import datetime
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..planning.work import WorkProgress, prefill_chunk_flops


class EtaColumn(ProgressColumn):
    """The bar's ETA: WorkProgress's seconds left (the cost model's work left at the rate the timed
    chunks ran), counting down between chunks."""

    def render(self, task):
        work = task.fields.get("work")
        eta = None if work is None else work.eta_s(time.monotonic() - task.fields["last"])
        shown = "-:--:--" if eta is None else str(datetime.timedelta(seconds=round(eta)))
        return Text(f"ETA {shown}", style="progress.remaining")


def prefill_progress(console: Console) -> Progress:
    """A transient bar: "prefill [bar] 2/3 chunks 0:00:12 ETA 0:00:20", moved by `work_bar`."""
    return Progress(TextColumn("[bold]prefill"), BarColumn(), TextColumn("{task.fields[chunks]} chunks"),
                    TimeElapsedColumn(), EtaColumn(), console=console, transient=True)


def work_bar(progress: Progress, model_config, chunk_tokens: int, tokens: int | None = None):
    """An on_chunk(done, total, chunk_stats) callback that moves `progress`'s bar by work.
    `tokens`: the prefill's length; None (an ingest, tokenized on the ranks) takes every chunk as
    full (the last one's work is then over-counted by at most one chunk's)."""
    task = progress.add_task("prefill", total=None, chunks="", work=None, last=time.monotonic())

    def on_chunk(done, total, record):
        fields = progress.tasks[task].fields
        if fields["work"] is None:  # the first chunk tells where the prefill starts and how many chunks it has
            first_cached = record.cached - record.index * chunk_tokens
            length = tokens if tokens is not None else total * chunk_tokens
            fields["work"] = WorkProgress(prefill_chunk_flops([length], chunk_tokens, model_config, first_cached))
        work = fields["work"]
        work.chunk_done(record.seconds)
        progress.update(task, total=work.total, completed=work.done, chunks=f"{done}/{total}", last=time.monotonic())

    return on_chunk
