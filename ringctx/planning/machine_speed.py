"""How fast this machine reads memory and decodes: the floor of a decode step, and `dtype="auto"`.

A decode step reads every weight and the whole KV cache once, so its floor is

    (bytes of weights read per token + bytes of KV cache) / read bandwidth

`read_bandwidth` measures the bandwidth (scripts/bench_model.py prints each row's floor beside it,
`ringctx prefill` its decode step's), `decode_bytes_per_token` counts the bytes.

`matmul_flops_per_s` times this machine's peak for a prefill: a short GEMM of the model's MLP
shapes, in float32 and, where bf16 matmuls are native, in bf16. `ringctx prefill` reports the
prefill's FLOP/s (the cost model's FLOPs over the chunks' seconds) as a share of it.

`auto_dtype` answers `dtype="auto"` on a CPU: the dtype that decodes fastest here among those
that meet ringctx's exactness rules, measured. The candidates are float32 and bfloat16 (bf16
passes the rule of docs/ARCHITECTURE.md: at most twice the error of the same computation done unsharded in
bf16 by PyTorch); float16 is not one, as neither ringctx's CPU kernels nor PyTorch's CPU ops
compute it natively. Which is faster depends on the CPU: with ringctx's CPU kernels a bf16 step
reads half the bytes of a float32 one on any x86-64 CPU; without them, PyTorch emulates bf16 on
CPUs without bf16 units and float32 can win. So it is measured: paired rounds of decode steps of
a random model of SmolLM2's widths, large enough that its weights do not fit in the caches,
alternating the two dtypes, while /proc/stat tells how much of the cores other processes took.
bfloat16 must take less than `BF16_MARGIN` of float32's time to be chosen (ties go to the more
exact float32). A measurement can be fooled: under load (a test suite beside it once made bf16
0.97x float32 where idle it is 0.4-0.6x), so the choice keeps its conditions and says how sure
it is. It is settled when it was measured on an idle machine and the ratio's confidence
interval over the paired rounds lies on one side of the margin; otherwise it is provisional and
the next engine starts measure again (at least `REMEASURE_AFTER_S` apart until
`MAX_MEASUREMENTS` are kept, then once a day), the new rounds joining the old (rounds under load
are set aside once idle ones exist), so the answer converges rather than flips. `ringctx info` shows the choice,
its numbers and conditions; `ringctx info --measure-dtype` measures afresh.
The answer is kept in the kernel cache directory, keyed by the CPU, the kernel variant, the torch
version and the thread count; a lock makes the ranks of one host measure once.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from ..files import write_json_atomically
from ..host_memory import host_tensors, huge_pages_enabled
from ..kernels.cpu_features import cpu_has_fast_bf16, cpu_model
from .linear_attention import decode_state_bytes

BF16_MARGIN = 0.9
"""bfloat16 is chosen when the median of its paired rounds' step over float32's is below this."""

_PROBE_BYTES = 512 * 2 ** 20


def read_bandwidth(*, threads: int | None = None, nbytes: int = _PROBE_BYTES, repeats: int = 7) -> float:
    """The read bandwidth of this machine in bytes/s, with `threads` threads (default: torch's):
    the best of `repeats` float32 sums over `nbytes` of memory, well past the caches, placed as
    ringctx places weights and KV caches (ringctx.host_memory)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        (x,) = host_tensors([((nbytes // 4,), torch.float32)])
        x.fill_(0.5)  # page the buffer in
        best = min(_seconds(lambda: x.sum()) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best


def matmul_flops_per_s(rows: int, dim: int, ffn_dim: int, dtype: torch.dtype = torch.float32, *,
                       threads: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of the MLP's two GEMM shapes of one prefill chunk on this CPU, with `threads`
    threads (default: torch's): [rows, dim] x [dim, ffn_dim] and [rows, ffn_dim] x [ffn_dim, dim],
    the best of `repeats` of each (after one warm-up), 2*rows*dim*ffn_dim FLOPs each."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        x, w_up = (torch.randn(shape, generator=generator).to(dtype) for shape in ((rows, dim), (dim, ffn_dim)))
        h, w_down = (torch.randn(shape, generator=generator).to(dtype) for shape in ((rows, ffn_dim), (ffn_dim, dim)))
        best = 0.0
        with torch.inference_mode():
            for a, b in ((x, w_up), (h, w_down)):
                a @ b  # warm-up: oneDNN picks and builds its kernel
                best += min(_seconds(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return 2 * (2 * rows * dim * ffn_dim) / best


def attention_flops_per_s(rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                          dtype: torch.dtype = torch.float32, *, repeats: int = 3) -> float:
    """FLOP/s of one full attention block of `rows` queries against `rows` keys through the
    kernel the ring calls (`attention_block`, the best of `repeats` after one warm-up), FLOPs
    counted as 4*rows*rows*D per query head, as the planner counts them."""
    from ..attention import attention_block

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, n_heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(rows, n_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    with torch.inference_mode():
        attention_block(q, k, v)  # warm-up: the kernel's first call builds or loads it
        best = min(_seconds(lambda: attention_block(q, k, v)) for _ in range(repeats))
    return 4 * rows * rows * head_dim * n_heads / best


def decode_bytes_per_token(model, context: float, kv_bytes_per_token: float | None = None) -> float:
    """Bytes a decode step reads once: every parameter but the embedding table (one row of it is
    read; a tied table is read whole as the output head, and counted once; int8 weights as their
    codes and exponents, which the decode reads instead; of a mixture of experts the router and the
    experts_per_token experts a token goes through), plus K and V of `context` cached tokens
    in every attention layer (`kv_bytes_per_token` each, the sum over the layers; default: in the
    weights' dtype, every layer's KV heads), plus, with a context, a hybrid's linear-attention
    states read and written (`linear_attention.decode_state_bytes`, in the weights' dtype)."""
    from ..kernels.selection import reads_int8_weights
    from ..model.int8_weights import int8_of

    codes_read = model.device.type == "cpu" and reads_int8_weights()

    def read(p) -> int:
        codes = int8_of(p) if codes_read else None
        return p.numel() * p.element_size() if codes is None else codes.codes.numel() + codes.exponents.numel()

    config = model.config
    weights = sum(read(p) for p in model.parameters())
    for i, block in enumerate(model.layers):  # a mixture of experts: a token reads its k experts only
        experts = config.experts(i)
        if experts is not None:
            unread = 1 - experts.experts_per_token / experts.n_experts
            weights -= unread * sum(read(p) for p in (block.feed_forward.w13, block.feed_forward.w2))
    if not config.tie_embeddings:
        weights -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    element = model.tok_embeddings.weight.element_size()
    if kv_bytes_per_token is None:
        kv_bytes_per_token = 2 * sum(h * d for h, d in config.kv_shapes) * element
    # windowed and chunked layers read only the rows they see: a share of the full layers' rows
    # (the mean over the attention layers: a linear layer keeps none, its state is read instead)
    seen = config.decode_kv_rows(int(context)) / len(config.attention_layers) if context else 0.0
    states = decode_state_bytes(config, element) if context else 0
    return weights + seen * kv_bytes_per_token + states


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- dtype="auto"

RATIO_CONFIDENCE = 0.75
"""The bf16/float32 ratio's interval holds the true median ratio of a paired round with at least
this chance (a sign-test interval over the paired rounds: it assumes nothing of the noise's shape).
7 rounds give the 2nd lowest to the 2nd highest ratio (87.5%), 28 the 10th to the 19th."""

BUSY_SHARE = 0.10
"""A measurement during which other processes (and the hypervisor: steal time) took more than this
share of the usable cores' time was made under load; an idle one takes 0-3% here."""

LOAD_PER_CPU = 0.5
"""Where /proc/stat cannot be read: under load when the 1-minute load average per usable core was
above this as the measurement began (a coarser sign: it lags a minute)."""

MAX_MEASUREMENTS = 4
"""A provisional choice keeps at most this many measurements: engine starts measure it again
until it has them, then once a day (RETRY_AFTER_S), each new one replacing the oldest."""

REMEASURE_AFTER_S = 300.0
"""A provisional choice is not measured again within this many seconds of its last measurement:
the ranks of one launch, which wait at the lock, use the measurement the first of them made."""

RETRY_AFTER_S = 86400.0
"""A provisional choice with MAX_MEASUREMENTS kept (say, of a machine busy whenever an engine
started) is measured again this long after its last measurement, not at every start."""

REMEASURE_COMMAND = "ringctx info --measure-dtype"

_OLD_FORMAT = "measured by an older ringctx that kept no conditions (load, spread)"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measuring session of the dtype probe, and the conditions it ran in."""

    at: str
    """When it ended: ISO 8601 in UTC ("2026-12-07T14:20:05Z")."""
    rounds_ms: dict[str, list[float]]
    """Per dtype, the median decode step of each round in milliseconds; round i of float32 and
    round i of bfloat16 ran back to back (a pair)."""
    others_cpu_share: float | None
    """The share of the usable cores' time that other processes and the hypervisor (steal) took
    while it ran, from /proc/stat; None where that cannot be read."""
    load_average: float | None
    """The 1-minute load average as it began (None where the OS keeps none)."""
    cpus: int
    """The cores this process may use."""
    threads: int
    """torch's threads."""
    cpu: str
    """The CPU's model name."""
    kernels: str
    """The CPU kernel variant it ran ("avx512", "avx2", "portable") or "no kernels"."""

    @property
    def loaded(self) -> bool:
        """Whether it ran under load (BUSY_SHARE, else LOAD_PER_CPU)."""
        if self.others_cpu_share is not None:
            return self.others_cpu_share > BUSY_SHARE
        return self.load_average is not None and self.load_average / self.cpus > LOAD_PER_CPU

    @property
    def ratios(self) -> list[float]:
        """bf16's step over float32's, one per paired round."""
        return [b / f for b, f in zip(self.rounds_ms["bfloat16"], self.rounds_ms["float32"])]

    def conditions(self) -> str:
        """One line: "2026-12-07 14:20 UTC, 7 rounds, others took 2% of 2 cores (idle), load
        average 0.31, avx512 kernels, 2 threads"."""
        busy = ("others' share of the cores unknown" if self.others_cpu_share is None else
                f"others took {self.others_cpu_share:.0%} of {self.cpus} cores")
        load = "none" if self.load_average is None else f"{self.load_average:.2f}"
        return (f"{self.at[:10]} {self.at[11:16]} UTC, {len(self.ratios)} rounds, {busy} "
                f"({'under load' if self.loaded else 'idle'}), load average {load}, {self.kernels} kernels, "
                f"{self.threads} threads")


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """What `auto_dtype` chose, the measurements it chose by and how sure they make it."""

    dtype: str
    """"bfloat16" or "float32"."""
    why: str
    """One sentence: the measured step times, or why nothing was measured (a GPU)."""
    step_ms: dict[str, float]
    """Median decode step of the probe model per dtype in milliseconds, over the rounds decided
    by (empty on a GPU)."""
    measured: str
    """When and where the latest of them ran: ISO date, CPU model, kernel variant, threads."""
    status: str = "settled"
    """"settled" (kept) or "provisional" (measured again at engine starts: see auto_dtype)."""
    status_why: str = ""
    """One sentence: what makes it settled or provisional."""
    ratio: float | None = None
    """bf16's step over float32's: the median over the paired rounds decided by."""
    ratio_interval: list[float] | None = None
    """[low, high]: the RATIO_CONFIDENCE interval of that median (None: too few rounds)."""
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    """Every measurement kept, oldest first."""

    @classmethod
    def from_json(cls, data: dict) -> "DtypeChoice":
        """Read back what `auto_dtype` wrote; a file of the format before conditions were kept
        (dtype, why, step_ms, measured) reads as provisional, so it is measured again."""
        if "status" not in data:
            return cls(**data, status="provisional", status_why=_OLD_FORMAT)
        return cls(**{**data, "measurements": [Measurement(**m) for m in data["measurements"]]})

    def decided_by(self) -> list[Measurement]:
        """The measurements the choice was decided by: the idle ones, or all when none was idle
        (rounds under load describe a busy machine, not this one's speed)."""
        return [m for m in self.measurements if not m.loaded] or self.measurements


def auto_dtype(device: str | None = None, *, measure: str = "when due") -> DtypeChoice:
    """The dtype `dtype="auto"` means on `device` (None: a GPU when there is one, else the CPU).

    On a CPU it comes from the cache file (`choice_path`), measured (`measure_dtype`) and decided
    (`decide_dtype`) when `measure` says so: "when due" (engine starts): when there is no file,
    or its choice is provisional and `next_measurement` says another is due; the new measurement
    joins the kept ones (the oldest dropped beyond MAX_MEASUREMENTS), so the answer converges
    rather than flips. "if missing" (`ringctx info`):
    only when there is no file. "now" (`ringctx info --measure-dtype`): afresh, the kept
    measurements dropped. A lock makes the ranks of one host measure once."""
    if measure not in ("when due", "if missing", "now"):
        raise ValueError(f"measure={measure!r}: use 'when due', 'if missing' or 'now'")
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if on_gpu:
        return DtypeChoice("bfloat16", "GPUs compute bf16 natively (tensor cores); float32 reads twice the bytes",
                           {}, "", "settled", "not measured: the same on every GPU")
    path = choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of this host wait, then read the answer
        cached = None if measure == "now" else read_dtype_choice(path)
        if cached is not None and (measure == "if missing" or not next_measurement(cached)[0]):
            return cached
        kept = [] if cached is None else cached.measurements[-(MAX_MEASUREMENTS - 1):]
        choice = decide_dtype([*kept, measure_dtype()])
        write_json_atomically(path, dataclasses.asdict(choice))
        return choice


def read_dtype_choice(path: Path | None = None) -> DtypeChoice | None:
    """The cached choice of this machine (None when there is none, or the file is damaged)."""
    try:
        return DtypeChoice.from_json(json.loads((path or choice_path()).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def next_measurement(choice: DtypeChoice, now: float | None = None) -> tuple[bool, str]:
    """(whether an engine start now measures again, one sentence saying when it will). A settled
    choice is kept; a provisional one is measured again by the first engine start at least
    REMEASURE_AFTER_S after its last measurement until MAX_MEASUREMENTS are kept, then at least
    RETRY_AFTER_S after it."""
    if choice.status == "settled":
        return False, f"kept: it is settled (`{REMEASURE_COMMAND}` measures afresh)"
    made = len(choice.measurements)
    if made < MAX_MEASUREMENTS:
        after, nth = REMEASURE_AFTER_S, f"measurement {made + 1} of {MAX_MEASUREMENTS} kept"
    else:
        after, nth = RETRY_AFTER_S, f"still provisional after {made}: the oldest dropped"
    if made:
        last = datetime.datetime.fromisoformat(choice.measurements[-1].at.replace("Z", "+00:00")).timestamp()
        if (time.time() if now is None else now) < last + after:
            at = datetime.datetime.fromtimestamp(last + after, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            return False, f"measured again by the first engine start from {at} ({nth})"
    return True, f"measured again by the next engine start ({nth})"


def decide_dtype(measurements: list[Measurement]) -> DtypeChoice:
    """The choice `measurements` (oldest first) make. Decided by the idle ones (all, when none
    was idle): bfloat16 when the median of the paired rounds' bf16/float32 ratios is below
    BF16_MARGIN (ties go to the more exact float32, and ranks measuring on like machines do not
    flip between the two). Settled when some were idle and the ratio's RATIO_CONFIDENCE interval
    lies on one side of BF16_MARGIN; else provisional (under load, too few rounds, or within the
    noise)."""
    choice = DtypeChoice("float32", "", {}, "", measurements=list(measurements))
    used = choice.decided_by()
    ratios = [r for m in used for r in m.ratios]
    ms = {name: round(statistics.median(t for m in used for t in m.rounds_ms[name]), 3)
          for name in ("float32", "bfloat16")}
    ratio = statistics.median(ratios)
    interval = median_interval(ratios)
    dtype = "bfloat16" if ratio < BF16_MARGIN else "float32"
    rounds = f"{len(ratios)} paired rounds"
    if used[-1].loaded:
        status, status_why = "provisional", f"measured under load only; the latest: {used[-1].conditions()}"
    elif interval is None:
        status, status_why = "provisional", f"{rounds}: too few for a {RATIO_CONFIDENCE:.0%} interval of the ratio"
    else:
        words = f"the ratio's {RATIO_CONFIDENCE:.0%} interval {interval[0]:.2f}-{interval[1]:.2f} over {rounds}"
        if interval[0] < BF16_MARGIN <= interval[1]:
            status, status_why = "provisional", f"within the noise: {words} straddles the margin {BF16_MARGIN}"
        else:
            side = "below" if interval[1] < BF16_MARGIN else "at or above"
            status, status_why = "settled", f"{words} on an idle machine lies {side} the margin {BF16_MARGIN}"
    latest = used[-1]
    path = f"ringctx's {latest.kernels} CPU kernels" if latest.kernels != "no kernels" else \
        "PyTorch's ops (no CPU kernels)"
    why = (f"a decode step took {ms['bfloat16']:.2f} ms in bf16 and {ms['float32']:.2f} ms in float32 "
           f"({ratio:.2f}x) through {path}; bf16 is chosen below {BF16_MARGIN}x")
    measured = f"{latest.at[:10]}, {latest.cpu}, {latest.kernels}, {latest.threads} threads"
    return dataclasses.replace(choice, dtype=dtype, why=why, step_ms=ms, measured=measured, status=status,
                               status_why=status_why, ratio=round(ratio, 4),
                               ratio_interval=None if interval is None else [round(x, 4) for x in interval])


def median_interval(values: list[float], confidence: float = RATIO_CONFIDENCE) -> tuple[float, float] | None:
    """The narrowest interval [k-th lowest, k-th highest] of `values` that holds their
    distribution's median with at least `confidence` (the sign test: the median lies below the
    k-th lowest of n values with chance P(Binomial(n, 1/2) < k)); None when even [min, max] holds
    it with less (n < 3 at 75%)."""
    xs, n = sorted(values), len(values)
    found = None
    for k in range(1, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if 1 - 2 * tail < confidence:
            break
        found = (xs[k - 1], xs[n - k])
    return found


def measure_dtype(rounds: int = 7, steps: int = 6) -> Measurement:
    """Decode steps of the probe model in float32 and bfloat16: `rounds` paired rounds of
    `steps` steps of each (which goes first alternates, so a drift weighs on both alike), with
    the CPU time other processes took meanwhile."""
    from ..kernels import build

    probes = {name: _probe_step(dtype) for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    rounds_ms: dict[str, list[float]] = {name: [] for name in probes}
    cpus = _usable_cpus()
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = None
    with torch.inference_mode():
        for step in probes.values():  # warm-up: builds the kernels, touches the weights
            step(1)
        busy, own, wall = _busy_seconds(cpus), time.process_time(), time.perf_counter()
        for r in range(rounds):
            for name, step in (list(probes.items()) if r % 2 == 0 else list(probes.items())[::-1]):
                ts = [_seconds(lambda t=t: step(t)) for t in range(2, 2 + steps)]
                rounds_ms[name].append(round(1e3 * statistics.median(ts), 4))
        wall = time.perf_counter() - wall
        own = time.process_time() - own
        busy_after = _busy_seconds(cpus)
    others = None if busy is None or busy_after is None else \
        round(min(1.0, max(0.0, (busy_after - busy - own) / (wall * len(cpus)))), 4)
    variant = build.active_variant()
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Measurement(at, rounds_ms, others, None if load is None else round(load, 2), len(cpus),
                       torch.get_num_threads(), cpu_model(), variant.name if variant else "no kernels")


def _usable_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _busy_seconds(cpus: set[int]) -> float | None:
    """Seconds these cores spent on anything but idling since boot (user, nice, system, irq,
    softirq, and steal: time the hypervisor gave to other machines), from /proc/stat; None where
    it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def _probe_step(dtype: torch.dtype):
    """A decode step over a random model of SmolLM2's head and MLP widths (6 layers, 52M
    parameters: 208 MB in float32, 104 MB in bf16) and a 1K-token cache."""
    from ..model.presets import get_preset
    from ..model import KVCache
    from ..model.decode_step import DecodeStep
    from ..model.weights import empty_model

    config = dataclasses.replace(get_preset("tiny"), name="dtype-probe", vocab_size=1024, dim=768, n_layers=6,
                                 n_heads=12, n_kv_heads=4, head_dim=64, ffn_dim=3072)
    model = empty_model(config, dtype=dtype, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)
    cache = KVCache(config.n_layers, 1024 + 64, config.n_kv_heads, config.head_dim, dtype=dtype, device="cpu")
    for k, v in zip(cache.k, cache.v):
        k.fill_(0.01)
        v.fill_(0.01)
    cache.length = 1024
    step = DecodeStep(model, cache)

    def one(token: int):
        cache.length = 1024  # every step attends to the same 1K rows
        return step(token)

    return one


def preferred_dtype(device: str | None = None) -> str:
    """What dtype="auto" means here: bfloat16 on GPUs; on a CPU the dtype that decodes fastest,
    measured (see auto_dtype above: again at engine starts while the choice is provisional)."""
    return auto_dtype(device).dtype


def choice_path() -> Path:
    """The file of this machine's cached choice: one per CPU, kernel build, torch version, thread
    count and page size, in the kernel cache directory ($RINGCTX_CACHE_DIR, else ~/.cache/ringctx)."""
    from ..kernels import build, cpu_features

    lib = build.library()  # its file name carries the hash of the kernel sources and flags
    key = "|".join((cpu_model(), ",".join(sorted(cpu_features.cpu_flags())), getattr(lib, "_name", "no kernels"),
                    torch.__version__, torch.backends.cpu.get_cpu_capability(), f"bf16 units {cpu_has_fast_bf16()}",
                    str(torch.get_num_threads()), f"huge pages {huge_pages_enabled()}"))
    return build.cache_dir() / f"dtype-choice-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
