"""Hardware profiles: the numbers the strategy heuristic, the cost model and the planner run on.

A profile describes one CP rank (one GPU, or one CPU process): its compute (peak FLOP/s per dtype,
C in the paper's thresholds, and the fraction of it the kernels achieve, which the cost model
runs on), its inter-rank bandwidth (BW, achieved bytes/s per rank and direction), a per-message
latency, the intra-host link of tensor-parallel all-reduces, a fixed cost per decoder layer, its
memory, and optionally what calibration measured (attention throughput by block size,
linear-layer FLOP/s, empirical-rule coefficients).

Profiles are JSON data. Built-in ones live in ``ringctx/hardware/<name>.json``; any other file can
be passed by path. `load_profile` validates every field and raises a ValueError that names the file,
the field and what to do; `save_profile` writes the same format (calibration uses it).

    >>> hw = load_profile("h100-rdma")
    >>> hw.achieved_flops("bfloat16") == 800e12 * hw.achieved_fraction
    True
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from ringctx.parallel.ring import STRATEGIES

SCHEMA_VERSION = 1
"""Version of the profile JSON format; bumped when a field changes meaning."""

PROFILE_PATH_ENV = "RINGCTX_HARDWARE_PROFILE"
"""An environment variable naming the calibrated profile's path instead of the user's config directory."""


def calibrated_profile_path() -> Path:
    """Where `ringctx calibrate` writes this machine's profile unless --out says otherwise, and where
    every run that is given no --hardware looks for it: $RINGCTX_HARDWARE_PROFILE, else
    ringctx/hardware.json in the user's config directory ($XDG_CONFIG_HOME, else ~/.config).
    Never inside the installed package, which an upgrade replaces and a user may not write."""
    if os.environ.get(PROFILE_PATH_ENV):
        return Path(os.environ[PROFILE_PATH_ENV]).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config_home) / "ringctx" / "hardware.json"


def default_profile_name(on_gpu: bool) -> str:
    """The profile a run decides with when given none: this machine's calibrated profile when
    `ringctx calibrate` wrote one (calibrated_profile_path), else the built-in "h200" on GPUs or
    "cpu". `Engine`, `prefill`, `ingest`, `serve` and `plan` all start from this one rule."""
    path = calibrated_profile_path()
    if path.is_file():
        return str(path)
    return "h200" if on_gpu else "cpu"


MEASURED = "measured"
"""`hardware="measured"`: the engine's ranks measure this machine at start-up (runtime/measure.py)."""

AUTO = "auto"
"""`hardware="auto"` (the CLI's default): this machine's calibrated profile when there is one, else
measured at start-up on CPUs, else the built-in "h200"."""


def resolve_hardware(hardware, on_gpu: bool):
    """What a run decides with, before anything is measured: a HardwareProfile, a built-in name or
    path passes through; None becomes `default_profile_name` (calibrated, else built-in); "auto"
    becomes the calibrated profile's path, or MEASURED on CPUs (the built-in "h200" on GPUs);
    MEASURED stays (off a GPU; on GPUs the built-in "h200", whose numbers are the device's)."""
    if hardware is None:
        return default_profile_name(on_gpu)
    if hardware == AUTO:
        path = calibrated_profile_path()
        return str(path) if path.is_file() else ("h200" if on_gpu else MEASURED)
    if hardware == MEASURED and on_gpu:
        return "h200"
    return hardware


def measured_profile_path(cp_size: int) -> Path:
    """Where an engine that measured this machine on `cp_size` CP ranks keeps the profile it
    measured (beside the calibrated profile), so that `ringctx plan` plans with the same numbers."""
    return calibrated_profile_path().with_name(f"measured-cp{cp_size}.json")


def measured_profile(base: "HardwareProfile", flops: dict[str, float], *, bandwidth_bytes_per_s: float | None,
                     ranks: int, attention: dict[str, tuple[int, float]] | None = None) -> "HardwareProfile":
    """`base` with this machine's measured per-rank GEMM rate (`flops`, by dtype name) as its peak
    and its linear layers' rate, and its measured ring bandwidth (None: the base's, for one rank),
    named "measured": the per-chunk rule and the cost model then decide with what this machine
    does, not the built-in placeholders. `attention` (by dtype name: (block rows, FLOP/s) of one
    measured block) becomes the attention rate where the base has no calibrated table: attention
    kernels run well below the GEMM peak on a CPU (a third of it, measured), which the cost
    model would otherwise take for their rate."""
    flops = {canonical_dtype(name): rate for name, rate in flops.items()}
    tables = dict(base.attention_throughput)
    for name, (rows, rate) in (attention or {}).items():
        tables.setdefault(canonical_dtype(name), (ThroughputPoint(int(rows), float(rate)),))
    shown = ", ".join(f"{name} {rate / 1e12:.3g} TFLOP/s" for name, rate in sorted(flops.items()))
    ring = f", ring {bandwidth_bytes_per_s / 1e9:.3g} GB/s" if bandwidth_bytes_per_s else ""
    return dataclasses.replace(
        base, name=MEASURED, calibrated=False,
        description=f"measured at start-up on {ranks} rank{'s' if ranks > 1 else ''}: GEMM {shown}{ring}",
        peak_flops={**base.peak_flops, **flops}, linear_flops_per_s={**base.linear_flops_per_s, **flops},
        achieved_fraction=1.0, bandwidth_bytes_per_s=bandwidth_bytes_per_s or base.bandwidth_bytes_per_s,
        attention_throughput=tables, source_path=None)


def shown_source(profile: "HardwareProfile") -> str:
    """Where a profile came from, as a person reads it: "built-in" for the package's own files
    (their path lies inside the installed package), else the file's path."""
    if profile.name == MEASURED:
        return profile.description
    if profile.source_path is None:
        return "given in code"
    try:
        Path(profile.source_path).resolve().relative_to(BUILTIN_DIR)
        return "built-in"
    except ValueError:
        return profile.source_path

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "hardware"
"""Where the built-in profiles live (package data ``ringctx/hardware/*.json``)."""

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}
"""Bytes per element e of each canonical dtype name."""

DEFAULT_DEVICES_PER_HOST = 8
"""Devices of one host when a GPU profile does not say: an 8-GPU HGX/DGX board, as in the paper's
H100 hosts."""

DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
}
"""Other spellings accepted for the canonical dtype names (torch names included)."""


def canonical_dtype(dtype: str) -> str:
    """The canonical name of `dtype` ("bf16" -> "bfloat16", "torch.float32" -> "float32")."""
    name = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r}; use one of {known} (or bf16/fp16/fp32/fp8)")
    return name


def element_bytes(dtype: str) -> int:
    """Bytes per element e of `dtype`."""
    return DTYPE_BYTES[canonical_dtype(dtype)]


@dataclass(frozen=True)
class ThroughputPoint:
    """One measured point of attention throughput (filled by calibration)."""

    block_tokens: int
    """Query rows of one attention call. Ring attention calls the kernel once per pair of
    load-balanced chunks, so in a chunk of T tokens on N ranks a call has about T/(2N) query rows."""
    flops_per_s: float
    """Achieved attention FLOP/s of such calls, FLOPs counted as 4*Tq*Tk*D (halved if causal)."""


@dataclass(frozen=True)
class EmpiricalRuleCoefficients:
    """Coefficients of the empirical rule h(T, P) = a*ln T + b*ln(T/(T+P)) + c; pass-KV when h > 0.

    The rule's boundary depends on the GQA ratio NKV/NH, the ring size N and the dtype (Algorithm 5
    does), so every set is stored with the setting it was fitted for and only used there.
    """

    a: float
    """Weight of ln T (T = new tokens)."""
    b: float
    """Weight of ln(T/(T+P)), the log of the KV-cache miss rate."""
    c: float
    """Constant term."""
    cp_size: int
    """Ring size N the coefficients were fitted for."""
    n_heads: int
    """Query heads NH of the model fitted for (matched through the ratio NKV/NH)."""
    n_kv_heads: int
    """KV heads NKV of the model fitted for (matched through the ratio NKV/NH)."""
    dtype: str
    """Attention dtype the coefficients were fitted for."""
    source: str
    """How they were obtained: "fit-to-alg5" (logistic regression on Algorithm 5's decisions over
    a grid, the built-in defaults) or "calibrated" (fitted to measured pass-KV/pass-Q timings)."""
    agreement: float
    """Fraction of the fitting samples on which sign(h) matched the label (1.0 = all)."""

    def score(self, new_tokens: int, cached_tokens: int) -> float:
        """h(T, P) = a*ln T + b*ln(T/(T+P)) + c (natural logs)."""
        miss = new_tokens / (new_tokens + cached_tokens)
        return self.a * math.log(new_tokens) + self.b * math.log(miss) + self.c

    def matches(self, n_heads: int, n_kv_heads: int, cp_size: int, dtype: str) -> bool:
        """Whether these coefficients were fitted for this GQA ratio, ring size and dtype."""
        same_ratio = Fraction(self.n_kv_heads, self.n_heads) == Fraction(n_kv_heads, n_heads)
        return same_ratio and self.cp_size == cp_size and self.dtype == canonical_dtype(dtype)


@dataclass(frozen=True)
class RingCalibration:
    """What `ringctx calibrate` measured on a live group of `cp_size` ranks.

    The communication numbers are per rank and direction, measured with every rank of the ring
    sending at once (as ring attention does). On a CPU host the ranks share its cores, so they
    depend on the ring size; a profile keeps one set per measured size (`HardwareProfile.ring_sizes`).
    """

    cp_size: int
    """Ranks of the live group measured (N)."""
    threads_per_rank: int
    """Compute threads each rank ran with (the engine's choice for N ranks: max(1, cores // N))."""
    compute_scale: float
    """Compute of one rank of this ring relative to the profile's compute tables (one thread, the
    other ranks idle): 1 thread alone = 1; about 2 for 2 threads; about 0.5 for 4 ranks taking
    turns on 2 cores. Multiplies attention_throughput, attention_causal_throughput and
    linear_flops_per_s."""
    latency_s: float
    """Fixed cost of one ring SendRecv (Ring.start_shift + wait), fitted with bandwidth_bytes_per_s."""
    bandwidth_bytes_per_s: float
    """Bytes/s of one ring SendRecv: time = latency_s + message bytes / bandwidth."""
    all2all_latency_s: float
    """Fixed cost of one all_to_all call (all peers), fitted with all2all_bandwidth_bytes_per_s."""
    all2all_bandwidth_bytes_per_s: float
    """Bytes/s of an all_to_all: time = all2all_latency_s + bytes one rank sends / bandwidth."""
    comm_overlap: float
    """Share (0..1) of a SendRecv that hides under attention compute running at the same time:
    1 = fully hidden (the paper's assumption), 0 = the transfer adds to compute (e.g. gloo's copy
    threads competing with compute for the same cores)."""
    overhead_s: dict[str, float]
    """Fixed cost of one ring_attention call per strategy beyond the modelled transfers and
    attention (cross-rank input check, buffers, merges, Python), fitted to timed calls."""
    attention_factor: float = 1.0
    """How many times slower attention runs inside ring_attention than the compute tables x
    compute_scale say (fitted to timed calls; 1 = as the tables say)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RingNumbers:
    """The numbers the cost model uses for a ring of `cp_size` ranks (`HardwareProfile.ring`)."""

    cp_size: int
    compute_scale: float
    """Multiplies the profile's compute (1 where it already describes one rank, e.g. a GPU)."""
    latency_s: float
    bandwidth_bytes_per_s: float
    all2all_latency_s: float | None
    """One all_to_all call's fixed cost; None: (N-1) * latency_s (one message per peer)."""
    all2all_bandwidth_bytes_per_s: float
    comm_overlap: float
    overhead_s: dict[str, float]
    source: str
    """Where they come from: "profile" (top-level numbers), "measured at N=..." or "scaled from N=..."."""
    attention_factor: float = 1.0
    """Attention inside the ring runs this many times slower than compute_scale says."""


@dataclass(frozen=True)
class HardwareProfile:
    """Per-rank compute, bandwidth, latency and memory of one kind of machine."""

    name: str
    """Short name: the built-in name or whatever the file says."""
    description: str
    """One line saying what machine and network this is and where the numbers come from."""
    calibrated: bool
    """True once `ringctx calibrate` measured the numbers on the machine; False for data-sheet or
    placeholder numbers (plans on an uncalibrated profile say so)."""
    peak_flops: dict[str, float]
    """Peak dense FLOP/s of one rank, by canonical dtype name."""
    achieved_fraction: float
    """Fraction of peak the kernels achieve (0 < f <= 1): the cost model's compute is
    peak * achieved_fraction (`achieved_flops`); the paper's thresholds use the peak itself."""
    bandwidth_bytes_per_s: float
    """Achieved inter-rank bandwidth BW of one rank, one direction, in bytes/s."""
    latency_s: float
    """Fixed cost of one message (SendRecv or one All2All peer) in seconds; matters for small
    messages, e.g. on CPU/gloo."""
    memory_bytes: float
    """Memory of one rank in bytes (GPU HBM; on CPU the host RAM share of one rank)."""
    link_bandwidth_bytes_per_s: float | None = None
    """Nominal line rate of the rank's network link, informational (BW above is what counts)."""
    memory_bandwidth_bytes_per_s: float | None = None
    """Memory (HBM/DRAM) bandwidth of one rank, informational (decode is bound by it)."""
    attention_throughput: dict[str, tuple[ThroughputPoint, ...]] = field(default_factory=dict)
    """Calibrated attention FLOP/s by block size, per dtype; overrides peak*fraction for attention."""
    linear_flops_per_s: dict[str, float] = field(default_factory=dict)
    """Calibrated FLOP/s of the linear layers' GEMMs per dtype; overrides peak*fraction for them."""
    empirical_rules: tuple[EmpiricalRuleCoefficients, ...] = ()
    """Coefficients of the empirical rule h(T, P), one set per (GQA ratio, N, dtype)."""
    attention_causal_throughput: dict[str, tuple[ThroughputPoint, ...]] = field(default_factory=dict)
    """Calibrated FLOP/s of square causal (diagonal) blocks by block size, per dtype (FLOPs halved
    by the mask); without it causal blocks run at the attention_throughput of full ones."""
    attention_call_overhead_s: float = 0.0
    """Fixed cost of one attention kernel call (launch, Python); ring attention makes one call per
    pair of chunks, so it matters for short chunks on many ranks."""
    comm_overlap: float = 1.0
    """Share (0..1) of a ring SendRecv that hides under compute, used where `ring_sizes` has no
    measurement; 1 = the paper's assumption of full overlap."""
    host_cores: int | None = None
    """CPU profiles: cores of the host that all local ranks share; the compute tables then describe
    one thread with the other ranks idle, and `ring(N)` scales them (and the transfers) for N ranks
    taking turns on the cores. None: one rank per device (GPUs), nothing shared."""
    devices_per_host: int | None = None
    """Ranks one host holds (its GPUs; on CPU, the rank processes its RAM is planned for). The
    decode runs on one host, so this bounds its decode ranks. None: see `host_devices`."""
    ring_sizes: dict[int, RingCalibration] = field(default_factory=dict)
    """Live-group measurements by ring size N (`ringctx calibrate --nproc N`); see `ring`."""
    tp_bandwidth_bytes_per_s: float | None = None
    """Bus bandwidth of the intra-host link that tensor-parallel all-reduces run over (NVLink on GPU
    hosts, shared memory between local ranks on a CPU host), bytes/s per device: an all-reduce of
    B bytes over TP devices moves 2*(TP-1)/TP*B bytes at this rate. None: the inter-rank
    `bandwidth_bytes_per_s` (see `tp_link`)."""
    tp_latency_s: float | None = None
    """Fixed cost of one tensor-parallel all-reduce in seconds. None: `latency_s` (see `tp_link`)."""
    layer_overhead_s: float = 0.0
    """Fixed cost of one decoder layer on one device beyond its FLOPs and transfers: kernel launches
    on GPUs (tens of microseconds a layer), Python and weight reads on CPUs. It dominates short
    prompts on a long cache (a follow-up question). Taken as is for every ring size (not scaled by
    `ring(N).compute_scale`). 0 in profiles written before the field."""
    notes: str = ""
    """Free text: caveats, how to recalibrate."""
    source_path: str | None = field(default=None, compare=False)
    """File the profile was read from (not written to JSON)."""

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one rank for `dtype`; a clear error if the profile lacks it."""
        name = canonical_dtype(dtype)
        if name not in self.peak_flops:
            raise ValueError(
                f"hardware profile {self.name!r} has no peak_flops for dtype {name!r}; "
                f"it has {', '.join(sorted(self.peak_flops))}; pick one of those or add it to the profile"
            )
        return self.peak_flops[name]

    def achieved_flops(self, dtype: str) -> float:
        """C: achieved FLOP/s of one rank = peak_flops[dtype] * achieved_fraction."""
        return self.peak(dtype) * self.achieved_fraction

    def attention_flops_per_s(self, dtype: str, block_tokens: int) -> float:
        """Attention FLOP/s for blocks of `block_tokens` query rows.

        From the calibrated table when there is one for `dtype` (linear in log2(block_tokens)
        between points, clamped to the end points), else C = peak * achieved_fraction.
        """
        points = self.attention_throughput.get(canonical_dtype(dtype))
        if not points:
            return self.achieved_flops(dtype)
        return interpolate_throughput(points, block_tokens)

    def attention_causal_flops_per_s(self, dtype: str, block_tokens: int) -> float:
        """FLOP/s of square causal blocks of `block_tokens` rows (mask-halved FLOPs counted).

        The calibrated causal table when there is one for `dtype`, else `attention_flops_per_s`.
        """
        points = self.attention_causal_throughput.get(canonical_dtype(dtype))
        if not points:
            return self.attention_flops_per_s(dtype, block_tokens)
        return interpolate_throughput(points, block_tokens)

    def ring(self, cp_size: int) -> RingNumbers:
        """Compute scale and communication numbers for a ring of `cp_size` ranks.

        - measured: `ring_sizes[cp_size]` as calibrated on a live group of that size;
        - CPU host (`host_cores` set) with other sizes measured: the nearest measured size, with
          compute scaled by the ideal share s(N) = max(1, cores // N) * min(1, cores / N) (the
          engine gives N ranks max(1, cores // N) threads each; beyond one rank per core they take
          turns) and transfers slowed by max(1, N / cores) (copies compete for the same cores);
        - CPU host, nothing measured: s(N) on the top-level numbers;
        - otherwise (one rank per GPU): the top-level latency, bandwidth and comm_overlap.
        """
        if cp_size in self.ring_sizes:
            r = self.ring_sizes[cp_size]
            return RingNumbers(cp_size, r.compute_scale, r.latency_s, r.bandwidth_bytes_per_s, r.all2all_latency_s,
                               r.all2all_bandwidth_bytes_per_s, r.comm_overlap, dict(r.overhead_s),
                               f"measured at N={cp_size}", r.attention_factor)
        zero = {s: 0.0 for s in STRATEGIES}
        if self.host_cores is None:
            return RingNumbers(cp_size, 1.0, self.latency_s, self.bandwidth_bytes_per_s, None,
                               self.bandwidth_bytes_per_s, self.comm_overlap, zero, "profile")
        cores = self.host_cores

        def share(n: int) -> float:
            return max(1, cores // n) * min(1.0, cores / n)

        def slowdown(n: int) -> float:
            return max(1.0, n / cores)

        rings = [n for n in self.ring_sizes if n > 1]
        if not rings or cp_size == 1:
            base = self.ring_sizes.get(1)
            scale = share(cp_size) if base is None or cp_size != 1 else base.compute_scale
            f = slowdown(cp_size)
            return RingNumbers(cp_size, scale, self.latency_s * f, self.bandwidth_bytes_per_s / f, None,
                               self.bandwidth_bytes_per_s / f, self.comm_overlap, zero,
                               "profile, scaled for the host's cores")
        near = min(rings, key=lambda n: (abs(math.log(n / cp_size)), -n))
        r = self.ring_sizes[near]
        f = slowdown(cp_size) / slowdown(near)
        return RingNumbers(
            cp_size, r.compute_scale * share(cp_size) / share(near), r.latency_s * f, r.bandwidth_bytes_per_s / f,
            r.all2all_latency_s * f, r.all2all_bandwidth_bytes_per_s / f, r.comm_overlap,
            {s: v * f for s, v in r.overhead_s.items()}, f"scaled from N={near}", r.attention_factor)

    def tp_link(self) -> tuple[float, float]:
        """(latency_s, bandwidth_bytes_per_s) of one tensor-parallel all-reduce.

        The profile's tp_* numbers; a profile without them prices the all-reduce at its inter-rank
        latency and bandwidth, the slower link as far as the profile knows (never optimistic).
        """
        latency, bandwidth = self.tp_latency_s, self.tp_bandwidth_bytes_per_s
        return (self.latency_s if latency is None else latency,
                self.bandwidth_bytes_per_s if bandwidth is None else bandwidth)

    @property
    def cpu_host(self) -> bool:
        """A CPU host's profile: calibrated on one (`host_cores` set) or the built-in "cpu"."""
        return self.host_cores is not None or self.name == "cpu"

    def host_devices(self) -> int:
        """Ranks of one host: `devices_per_host`, else `host_cores` (at most one rank per core),
        else DEFAULT_DEVICES_PER_HOST (profiles written before the field existed)."""
        return self.devices_per_host or self.host_cores or DEFAULT_DEVICES_PER_HOST

    def linear_flops(self, dtype: str) -> float:
        """FLOP/s of the linear layers: the calibrated value, else peak * achieved_fraction."""
        name = canonical_dtype(dtype)
        return self.linear_flops_per_s.get(name) or self.achieved_flops(name)

    def empirical_rule_for(self, n_heads: int, n_kv_heads: int, cp_size: int, dtype: str):
        """The stored empirical-rule coefficients for this setting, or None."""
        for rule in self.empirical_rules:
            if rule.matches(n_heads, n_kv_heads, cp_size, dtype):
                return rule
        return None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see `load_profile` for the schema)."""
        d = dataclasses.asdict(self)
        d.pop("source_path")
        d["attention_throughput"] = {
            dtype: [dataclasses.asdict(p) for p in points] for dtype, points in self.attention_throughput.items()
        }
        d["empirical_rules"] = [dataclasses.asdict(r) for r in self.empirical_rules]
        d["attention_causal_throughput"] = {
            dtype: [dataclasses.asdict(p) for p in points] for dtype, points in self.attention_causal_throughput.items()
        }
        d["ring_sizes"] = {str(n): r.to_dict() for n, r in sorted(self.ring_sizes.items())}
        return {"schema_version": SCHEMA_VERSION, **d}

    @classmethod
    def from_dict(cls, data: Any, where: str = "<dict>") -> "HardwareProfile":
        """Validate and build a profile; `where` names the file in error messages."""
        return _parse_profile(data, where)


def interpolate_throughput(points: tuple[ThroughputPoint, ...], block_tokens: int) -> float:
    """FLOP/s at `block_tokens`: piecewise linear in log2(block size), clamped outside the table."""
    pts = sorted(points, key=lambda p: p.block_tokens)
    sizes = [p.block_tokens for p in pts]
    if block_tokens <= sizes[0]:
        return pts[0].flops_per_s
    if block_tokens >= sizes[-1]:
        return pts[-1].flops_per_s
    hi = bisect.bisect_left(sizes, block_tokens)
    lo = hi - 1
    x0, x1 = math.log2(sizes[lo]), math.log2(sizes[hi])
    w = (math.log2(block_tokens) - x0) / (x1 - x0)
    return pts[lo].flops_per_s * (1 - w) + pts[hi].flops_per_s * w


# ----------------------------------------------------------------------------- loading and saving


def builtin_profiles() -> list[str]:
    """Names of the built-in profiles."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_profile(name_or_path: "str | os.PathLike | HardwareProfile") -> HardwareProfile:
    """A profile by built-in name (``h100-rdma``, ``h100-tcp``, ``h200``, ``cpu``) or JSON path.

    A HardwareProfile passes through. Unknown names, missing files and malformed files raise a
    ValueError naming the file (and field) and what to do.
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    text = os.fspath(name_or_path)
    builtin = BUILTIN_DIR / f"{text}.json"
    if os.sep not in text and "/" not in text and builtin.is_file():
        return _load_file(builtin)
    path = Path(text)
    if path.is_file():
        return _load_file(path)
    raise ValueError(
        f"unknown hardware profile {text!r}: not a built-in profile ({', '.join(builtin_profiles())}) "
        f"and no such file; pass a built-in name or the path to a JSON profile "
        f"(copy one of {BUILTIN_DIR}/*.json as a template)"
    )


def save_profile(profile: HardwareProfile, path: "str | os.PathLike") -> Path:
    """Write `profile` as JSON to `path` (validated by reading it back); returns the path."""
    path = Path(path)
    data = profile.to_dict()
    _parse_profile(json.loads(json.dumps(data)), str(path))  # never write what load would refuse
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # atomic: a reader sees old or new
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)
    return path


def _load_file(path: Path) -> HardwareProfile:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"hardware profile {path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            f"fix the file or regenerate it with `ringctx calibrate`"
        ) from None
    profile = _parse_profile(data, str(path))
    return dataclasses.replace(profile, source_path=str(path))


# ----------------------------------------------------------------------------- validation

_REQUIRED = ("name", "description", "calibrated", "peak_flops", "achieved_fraction",
             "bandwidth_bytes_per_s", "latency_s", "memory_bytes")
_OPTIONAL = ("schema_version", "link_bandwidth_bytes_per_s", "memory_bandwidth_bytes_per_s",
             "attention_throughput", "linear_flops_per_s", "empirical_rules", "attention_causal_throughput",
             "attention_call_overhead_s", "comm_overlap", "host_cores", "devices_per_host", "ring_sizes",
             "tp_bandwidth_bytes_per_s", "tp_latency_s", "layer_overhead_s", "notes")
_RING_FIELDS = tuple(f.name for f in dataclasses.fields(RingCalibration))
_RING_REQUIRED = tuple(name for name in _RING_FIELDS if name != "attention_factor")
_RULE_FIELDS = tuple(f.name for f in dataclasses.fields(EmpiricalRuleCoefficients))


def _fail(where: str, field_name: str, problem: str) -> ValueError:
    return ValueError(f"hardware profile {where}: field {field_name!r} {problem}; fix the file "
                      f"(see {BUILTIN_DIR}/h100-rdma.json for the format) or rerun `ringctx calibrate`")


def _number(d: dict, key: str, where: str, *, lo: float = 0.0, lo_inclusive: bool = False,
            hi: float = math.inf, label: str | None = None) -> float:
    """A finite number in (lo, hi] (or [lo, hi] when lo_inclusive) from d[key]."""
    label = label or key
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(where, label, f"must be a finite number, got {value!r}")
    too_low = value < lo if lo_inclusive else value <= lo
    if too_low or value > hi:
        bound = f"{'>=' if lo_inclusive else '>'} {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else "")
        raise _fail(where, label, f"must be {bound}, got {value!r}")
    return float(value)


def _string(d: dict, key: str, where: str, label: str | None = None) -> str:
    if not isinstance(d[key], str):
        raise _fail(where, label or key, f"must be a string, got {d[key]!r}")
    return d[key]


def _dtype_key(key: str, where: str, label: str) -> str:
    try:
        return canonical_dtype(key)
    except ValueError as err:
        raise _fail(where, label, f"has an unknown dtype key {key!r} ({err})") from None


def _dtype_numbers(d: dict, key: str, where: str, *, required: bool) -> dict[str, float]:
    table = d.get(key, {})
    if not isinstance(table, dict) or (required and not table):
        raise _fail(where, key, f"must be a non-empty object {{dtype: FLOP/s}}, got {table!r}")
    return {_dtype_key(k, where, key): _number(table, k, where, label=f"{key}.{k}") for k in table}


def _throughput_table(d: dict, where: str, key: str = "attention_throughput") -> dict[str, tuple[ThroughputPoint, ...]]:
    table = d.get(key, {})
    if not isinstance(table, dict):
        raise _fail(where, key, f"must be an object {{dtype: [points]}}, got {table!r}")
    out: dict[str, tuple[ThroughputPoint, ...]] = {}
    for dtype, points in table.items():
        label = f"{key}.{dtype}"
        if not isinstance(points, list) or not points:
            raise _fail(where, label, "must be a non-empty list of {block_tokens, flops_per_s}")
        parsed = []
        for i, p in enumerate(points):
            if not isinstance(p, dict) or set(p) != {"block_tokens", "flops_per_s"}:
                raise _fail(where, f"{label}[{i}]", f"must be {{'block_tokens': int, 'flops_per_s': number}}, got {p!r}")
            size = p["block_tokens"]
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise _fail(where, f"{label}[{i}].block_tokens", f"must be a positive integer, got {size!r}")
            flops = _number(p, "flops_per_s", where, label=f"{label}[{i}].flops_per_s")
            parsed.append(ThroughputPoint(size, flops))
        out[_dtype_key(dtype, where, label)] = tuple(sorted(parsed, key=lambda q: q.block_tokens))
    return out


def _empirical_rules(d: dict, where: str) -> tuple[EmpiricalRuleCoefficients, ...]:
    rules = d.get("empirical_rules", [])
    if not isinstance(rules, list):
        raise _fail(where, "empirical_rules", f"must be a list, got {rules!r}")
    out = []
    for i, r in enumerate(rules):
        label = f"empirical_rules[{i}]"
        if not isinstance(r, dict) or set(r) != set(_RULE_FIELDS):
            have = sorted(r) if isinstance(r, dict) else r
            raise _fail(where, label, f"must have exactly the fields {list(_RULE_FIELDS)}, got {have!r}")
        for key in ("cp_size", "n_heads", "n_kv_heads"):
            if not isinstance(r[key], int) or isinstance(r[key], bool) or r[key] <= 0:
                raise _fail(where, f"{label}.{key}", f"must be a positive integer, got {r[key]!r}")
        if r["n_heads"] % r["n_kv_heads"]:
            raise _fail(where, f"{label}.n_heads", "must be a multiple of n_kv_heads")
        coeffs = {k: _number(r, k, where, lo=-math.inf, label=f"{label}.{k}") for k in ("a", "b", "c")}
        out.append(EmpiricalRuleCoefficients(
            **coeffs, cp_size=r["cp_size"], n_heads=r["n_heads"], n_kv_heads=r["n_kv_heads"],
            dtype=_dtype_key(_string(r, "dtype", where, f"{label}.dtype"), where, f"{label}.dtype"),
            source=_string(r, "source", where, f"{label}.source"),
            agreement=_number(r, "agreement", where, lo_inclusive=True, hi=1.0, label=f"{label}.agreement"),
        ))
    return tuple(out)


def _positive_int(value: Any, where: str, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(where, label, f"must be a positive integer, got {value!r}")
    return value


def _ring_sizes(d: dict, where: str) -> dict[int, RingCalibration]:
    table = d.get("ring_sizes", {})
    if not isinstance(table, dict):
        raise _fail(where, "ring_sizes", f"must be an object {{N: measurements}}, got {table!r}")
    out: dict[int, RingCalibration] = {}
    for key, r in table.items():
        label = f"ring_sizes.{key}"
        if not isinstance(r, dict) or not set(_RING_REQUIRED) <= set(r) or not set(r) <= set(_RING_FIELDS):
            have = sorted(r) if isinstance(r, dict) else r
            raise _fail(where, label, f"must have the fields {list(_RING_REQUIRED)} (and optionally "
                                      f"attention_factor), got {have!r}")
        n = _positive_int(r["cp_size"], where, f"{label}.cp_size")
        if str(key) != str(n):
            raise _fail(where, label, f"is keyed {key!r} but its cp_size is {n}")
        overhead = r["overhead_s"]
        if not isinstance(overhead, dict) or set(overhead) != set(STRATEGIES):
            raise _fail(where, f"{label}.overhead_s", f"must be {{'pass-kv': s, 'pass-q': s}}, got {overhead!r}")
        out[n] = RingCalibration(
            cp_size=n, threads_per_rank=_positive_int(r["threads_per_rank"], where, f"{label}.threads_per_rank"),
            compute_scale=_number(r, "compute_scale", where, label=f"{label}.compute_scale"),
            latency_s=_number(r, "latency_s", where, lo_inclusive=True, label=f"{label}.latency_s"),
            bandwidth_bytes_per_s=_number(r, "bandwidth_bytes_per_s", where, label=f"{label}.bandwidth_bytes_per_s"),
            all2all_latency_s=_number(r, "all2all_latency_s", where, lo_inclusive=True,
                                      label=f"{label}.all2all_latency_s"),
            all2all_bandwidth_bytes_per_s=_number(r, "all2all_bandwidth_bytes_per_s", where,
                                                  label=f"{label}.all2all_bandwidth_bytes_per_s"),
            comm_overlap=_number(r, "comm_overlap", where, lo_inclusive=True, hi=1.0, label=f"{label}.comm_overlap"),
            overhead_s={s: _number(overhead, s, where, lo_inclusive=True, label=f"{label}.overhead_s.{s}")
                        for s in STRATEGIES},
            attention_factor=(_number(r, "attention_factor", where, label=f"{label}.attention_factor")
                              if "attention_factor" in r else 1.0),
        )
    return out


def _optional_positive(d: dict, key: str, where: str) -> float | None:
    return None if d.get(key) is None else _number(d, key, where)


def _optional_nonnegative(d: dict, key: str, where: str) -> float | None:
    return None if d.get(key) is None else _number(d, key, where, lo_inclusive=True)


def _parse_profile(data: Any, where: str) -> HardwareProfile:
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {where}: must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise _fail(where, unknown[0], f"is not a profile field (known: {', '.join(_REQUIRED + _OPTIONAL)})")
    for key in _REQUIRED:
        if key not in data:
            raise _fail(where, key, "is missing")
    if data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise _fail(where, "schema_version",
                    f"is {data['schema_version']!r}; this ringctx reads version {SCHEMA_VERSION}")
    if not isinstance(data["calibrated"], bool):
        raise _fail(where, "calibrated", f"must be true or false, got {data['calibrated']!r}")
    return HardwareProfile(
        name=_string(data, "name", where),
        description=_string(data, "description", where),
        calibrated=data["calibrated"],
        peak_flops=_dtype_numbers(data, "peak_flops", where, required=True),
        achieved_fraction=_number(data, "achieved_fraction", where, hi=1.0),
        bandwidth_bytes_per_s=_number(data, "bandwidth_bytes_per_s", where),
        latency_s=_number(data, "latency_s", where, lo_inclusive=True),
        memory_bytes=_number(data, "memory_bytes", where),
        link_bandwidth_bytes_per_s=_optional_positive(data, "link_bandwidth_bytes_per_s", where),
        memory_bandwidth_bytes_per_s=_optional_positive(data, "memory_bandwidth_bytes_per_s", where),
        attention_throughput=_throughput_table(data, where),
        linear_flops_per_s=_dtype_numbers(data, "linear_flops_per_s", where, required=False),
        empirical_rules=_empirical_rules(data, where),
        attention_causal_throughput=_throughput_table(data, where, "attention_causal_throughput"),
        attention_call_overhead_s=(_number(data, "attention_call_overhead_s", where, lo_inclusive=True)
                                   if "attention_call_overhead_s" in data else 0.0),
        comm_overlap=_number(data, "comm_overlap", where, lo_inclusive=True, hi=1.0) if "comm_overlap" in data else 1.0,
        host_cores=(None if data.get("host_cores") is None
                    else _positive_int(data["host_cores"], where, "host_cores")),
        devices_per_host=(None if data.get("devices_per_host") is None
                          else _positive_int(data["devices_per_host"], where, "devices_per_host")),
        ring_sizes=_ring_sizes(data, where),
        tp_bandwidth_bytes_per_s=_optional_positive(data, "tp_bandwidth_bytes_per_s", where),
        tp_latency_s=_optional_nonnegative(data, "tp_latency_s", where),
        layer_overhead_s=_optional_nonnegative(data, "layer_overhead_s", where) or 0.0,
        notes=_string(data, "notes", where) if "notes" in data else "",
    )
