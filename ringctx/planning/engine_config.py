"""`EngineConfig`: everything an engine runs with, in one dataclass, each default written once.

`Engine(config=EngineConfig(...))` and `Engine(model, **fields)` build the same engine; the CLI's
options take their defaults and help from the fields below (`COMMAND_LINE` holds the two defaults
a command differs in: every local rank, the fastest dtype); `ringctx plan` plans what an engine
with the same config would run; `ringctx serve` hands its engine fields through; a saved document
records the config it was made with (`to_dict`). It lives in planning/ because `plan` reads it
too, and engine/ builds on planning/.

Each field's docstring is its documentation everywhere (`field_help`, `describe`): the Python API,
`--help` of every command that builds an engine, and `EngineConfig.describe()`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from dataclasses import dataclass

from ..attention.kernels import BACKENDS
from ..attention.quant import check_kv_dtype
from ..model.context import parse_rope_scaling
from ..model.int8_weights import check_weights
from ..model.loader import DEFAULT_MODEL
from ..parallel.ring import STRATEGIES
from .strategy import RULES

STRATEGY_CHOICES = ("auto", *STRATEGIES)
"""What `strategy` accepts: the per-chunk rule, or one strategy for every chunk."""
LINEAR_EXCHANGES = ("auto", "all-gather", "ring")
"""What `linear_exchange` accepts (parallel/linear_state.py's two ways, or the planner's pick)."""

ATTN_BACKENDS = ("auto", "torch", "triton", "flash-attn")
"""The `attn_backend`s the command line offers; the Python API takes any of attention.kernels.BACKENDS."""


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs: the model, its ranks, how a prefill is cut and decided, how the KV cache is kept."""

    model: str = DEFAULT_MODEL
    """Preset name, GGUF file, Hugging Face directory, or ORG/NAME from the local Hugging Face cache."""
    nproc: int | str = 1
    """Local ranks to spawn (this process is rank 0), or "auto": one per GPU, 2 on a CPU with 2+ cores.
    Ignored under torchrun, which sets the world."""
    tp: int = 1
    """Tensor-parallel ranks per model copy (consecutive ranks of one host, the weights split over them);
    the ranks form a (ranks / tp) CP x tp TP mesh."""
    dtype: str | None = None
    """Weights and activations: "auto" (bfloat16 on GPUs and CPUs that compute it fast, else float32),
    "bfloat16", "float16" or "float32"; unset: the model's own."""
    device: str | None = None
    """"cpu" or "cuda"; unset: one GPU per rank when CUDA is available, else the CPU."""
    chunk_tokens: int | None = None
    """Tokens per prefill chunk; unset: the engine's default for the model and ranks (4,096 on CPUs, up to
    65,536 on GPUs: default_chunk_tokens)."""
    strategy: str = "auto"
    """"auto" (the decision rule picks pass-KV or pass-Q per chunk), "pass-kv" or "pass-q" for every chunk."""
    hardware: object = None
    """Hardware profile the "auto" strategy decides with: a built-in name (cpu, h100-rdma, h100-tcp, h200),
    a JSON path (or a HardwareProfile), "measured" (the ranks measure this CPU's GEMM rate and ring
    bandwidth at start-up, about a second) or "auto" (this machine's calibrated profile, else measured
    on CPUs, else h200); unset: the calibrated profile, else the built-in "cpu" (or "h200" with CUDA)."""
    rule: str = "alg5"
    """Decision rule of "auto": paper Algorithm 1 or 5, the fitted h(T,P), or the cost model."""
    linear_exchange: str = "auto"
    """How a hybrid's linear-attention layers send their state summaries between the CP ranks:
    "auto" (the cheaper for the hardware profile: `ringctx plan` shows both), "all-gather" or
    "ring" (the state relayed out along the ranks and back)."""
    decode_rank: int = 0
    """The first decode CP rank: it receives the logits, samples and streams the text."""
    decode_ranks: int | None = None
    """CP ranks of the decode host that keep the KV cache (split by token) and decode together; unset:
    every rank of the decode host from the first decode rank on; 1: the whole cache on one rank."""
    kv_dtype: str = "model"
    """KV cache storage: the model's dtype, another float dtype, or 8 bits per value with a float32 scale
    per token and KV head ("fp8" = float8 e4m3, "int8")."""
    weights: str = "model"
    """"model" (the checkpoint's values in dtype) or "int8": every block matrix rounded to int8 with a
    power-of-two scale per 64 inputs, which CPU decode steps read instead of bf16."""
    timeout_s: float = 300.0
    """Seconds a collective may wait: a dead or stuck rank then ends the job with an error."""
    startup_timeout_s: float | None = None
    """Seconds start-up may take (spawning ranks, loading the model, their agreement check); unset: the
    larger of the timeout and 600."""
    attn_backend: str = "auto"
    """Local attention kernels: "auto" (flash-attn on CUDA when installed, else torch), "torch", "triton",
    "flash-attn"."""
    prefix_cache: bool = True
    """Keep each prompt's KV (and its answer's) on the decode ranks after the request, found again by its
    tokens, so that a later prompt that begins alike prefills only the rest (ringctx serve, Engine.chat)."""
    prefix_cache_min_tokens: int = 256
    """The shortest prompt kept, and the shortest shared start a later prompt reuses: below it a prefill
    costs about as much as a few decode steps, less than keeping it (prompts are found by 64-token
    blocks, so a shared start shorter than one block is never found)."""
    prefix_cache_share: float = 0.5
    """Of the KV budget (serve's --kv-budget), the share the kept prompts may take in memory; beyond it the
    least recently used move to disk (serve) or are dropped. Registered documents come first."""
    rope_scaling: str | None = None
    """Stretch the model's RoPE at load: "yarn:FACTOR" (YaRN, transformers' formula, over the checkpoint's
    max_position_embeddings) or "linear:FACTOR"; the trained context becomes FACTOR times longer. Unset
    or "none": the checkpoint's own; refused for a model that scales RoPE already."""
    allow_long_context: bool = False
    """Run a prompt past the model's trained context (its tokens, cached ones and max_new_tokens) with a
    one-time warning instead of refusing it; answers past that length are unreliable."""
    ep: int = 1
    """Expert-parallel ranks: every mixture-of-experts layer's experts spread over ep consecutive CP ranks
    of one TP index (n_experts / ep each, loaded only there; tokens reach them by a two-shot all-to-all).
    ep must divide the experts, the CP ranks, the decode ranks and the first decode rank; 1: every rank
    holds every expert."""

    # ------------------------------------------------------------------ building and checking
    def replace(self, **changes) -> "EngineConfig":
        """This config with `changes`; a name that is no field is a TypeError naming the fields."""
        unknown = sorted(set(changes) - set(field_names()))
        if unknown:
            raise TypeError(f"unknown engine setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"the settings are: {', '.join(field_names())}")
        return dataclasses.replace(self, **changes)

    def check(self) -> "EngineConfig":
        """Raise ValueError naming the first bad value and what to use instead (before any rank starts)."""
        check_kv_dtype(self.kv_dtype)
        check_weights(self.weights, self.dtype)
        if self.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGY_CHOICES)}")
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; use one of {', '.join(RULES)}")
        if self.linear_exchange not in LINEAR_EXCHANGES:
            raise ValueError(f"unknown linear_exchange {self.linear_exchange!r}; use one of {', '.join(LINEAR_EXCHANGES)}")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"unknown attn_backend {self.attn_backend!r}; use one of {', '.join(BACKENDS)}")
        if self.nproc != "auto" and (not isinstance(self.nproc, int) or isinstance(self.nproc, bool) or self.nproc < 1):
            raise ValueError(f"nproc must be a positive integer or 'auto', got {self.nproc!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a positive integer, got {self.tp!r}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive integer, got {self.ep!r}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if not self.timeout_s or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if not isinstance(self.prefix_cache_min_tokens, int) or self.prefix_cache_min_tokens < 1:
            raise ValueError(f"prefix_cache_min_tokens must be a positive number of tokens, got "
                             f"{self.prefix_cache_min_tokens!r}")
        if not 0 < self.prefix_cache_share <= 1:
            raise ValueError(f"prefix_cache_share must be in (0, 1], got {self.prefix_cache_share!r}")
        parse_rope_scaling(self.rope_scaling)
        if self.startup_timeout_s is not None and self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0 seconds, got {self.startup_timeout_s!r}")
        return self

    # ------------------------------------------------------------------ printing and saving
    def to_dict(self) -> dict:
        """JSON-ready fields (a HardwareProfile by its name, a torch dtype by its name)."""
        data = {}
        for name in field_names():
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, int, float, bool)):
                value = getattr(value, "name", None) or str(value).removeprefix("torch.")
            data[name] = value
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        """The config `to_dict` wrote; unknown names are a ValueError (a file of another version)."""
        try:
            return cls().replace(**data)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    def describe(self) -> str:
        """One line per setting, `name = value`, the settings that differ from the defaults marked *."""
        default = EngineConfig()
        width = max(map(len, field_names()))
        rows = []
        for name, value in self.to_dict().items():
            mark = "*" if getattr(self, name) != getattr(default, name) else " "
            rows.append(f"{mark} {name:<{width}} = {value!r}")
        return "\n".join(rows)


COMMAND_LINE = EngineConfig(nproc="auto", dtype="auto", hardware="auto")
"""What `ringctx prefill`, `ingest` and `plan` run when given no options: every local rank that helps
(`auto_nproc`), the dtype this machine computes fastest, and the per-chunk rule with this machine's
own numbers (its calibrated profile, else measured at start-up), where the Python API starts one
process in the model's dtype with the calibrated or built-in profile (the least surprising, and
cheapest, for a library call)."""


SERVING = EngineConfig(nproc="auto", dtype="auto")
"""What `ringctx serve` (and `ringctx.serve.serve`) runs when given no options: "auto" ranks mean the
layout that serves fastest here (one rank per GPU, one rank with every core on a CPU:
engine.startup.serving_nproc) and the dtype this machine computes fastest."""


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(EngineConfig))


@functools.cache
def field_help() -> dict[str, str]:
    """Each field's docstring, one line, read from the source (the CLI's help and `describe`)."""
    tree = ast.parse(inspect.getsource(EngineConfig))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
