"""Filling a Transformer's parameters: from checkpoint tensors, or random for presets.

The model is first built on the meta device (no memory), then its parameters are allocated once
in the requested dtype and device, and every checkpoint tensor is copied into its place as soon as
it is read (converted on the way). Peak memory is the model plus one checkpoint tensor, never a
second full copy.

Checkpoint readers (weights_gguf.py, weights_hf.py) map each checkpoint tensor name to a
`WeightPiece`: a parameter name of ours and an optional row range (for the fused wqkv and w13
matrices). `WeightFiller` checks names and shapes, copies, and names whatever never arrived.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from ..config import ModelConfig
from .transformer import Transformer


class WeightPiece(NamedTuple):
    """One checkpoint tensor and where it goes."""

    param: str
    """Name of our parameter, e.g. 'layers.3.attention.wqkv.weight'."""
    rows: tuple[int, int] | None
    """Row range [start, stop) inside that parameter, or None for the whole parameter."""
    source_name: str
    """The tensor's name in the checkpoint (for error messages)."""


def qkv_rows(config: ModelConfig, which: str) -> tuple[int, int]:
    """Row range of 'q', 'k' or 'v' inside the fused wqkv weight (or bias)."""
    D, hq, hkv = config.head_dim, config.n_heads, config.n_kv_heads
    return {"q": (0, hq * D), "k": (hq * D, (hq + hkv) * D), "v": ((hq + hkv) * D, (hq + 2 * hkv) * D)}[which]


def mlp_rows(config: ModelConfig, which: str) -> tuple[int, int]:
    """Row range of 'gate' or 'up' inside the fused w13 weight."""
    return (0, config.ffn_dim) if which == "gate" else (config.ffn_dim, 2 * config.ffn_dim)


@contextlib.contextmanager
def _no_parameter_init():
    """Skip nn.Linear / nn.Embedding's random init while building: every value is overwritten.

    Their init on the meta device runs PyTorch's Python reference kernels, whose first use imports
    torch._dynamo, sympy and Triton: about 90 MiB resident in every rank, for values nobody reads.
    """
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def empty_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    """A Transformer with uninitialised parameters in `dtype` on `device` (no memory on 'meta')."""
    with torch.device("meta"), _no_parameter_init():
        model = Transformer(config)
    model = model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        model = model.to_empty(device=device)
    model.tie_weights()  # to_empty allocates tied parameters once, but re-tie to be explicit
    model.requires_grad_(False)
    return model


class WeightFiller:
    """Copies checkpoint tensors into a model's parameters, checking names, shapes and coverage.

    expected: every checkpoint tensor name the model needs -> its WeightPiece (from the reader's
    name mapping). `put` takes them in any order; `finish` names what never arrived.
    """

    def __init__(self, model: Transformer, source: str, expected: dict[str, WeightPiece]):
        self.model, self.source, self.expected = model, source, expected
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.seen: set[str] = set()

    def piece(self, source_name: str) -> WeightPiece:
        """The WeightPiece for a checkpoint tensor name; a clear error for a tensor we have no place for."""
        try:
            return self.expected[source_name]
        except KeyError:
            raise ValueError(f"{self.source}: unexpected tensor {source_name!r}: ringctx's Llama-family "
                             "decoder has no place for it, so the checkpoint is of an unsupported "
                             "architecture or variant") from None

    def expected_shape(self, piece: WeightPiece) -> tuple[int, ...]:
        """The shape a checkpoint tensor must have to fill `piece`."""
        shape = tuple(self.params[piece.param].shape)
        return shape if piece.rows is None else (piece.rows[1] - piece.rows[0], *shape[1:])

    def check_shape(self, piece: WeightPiece, shape: tuple[int, ...]) -> None:
        want = self.expected_shape(piece)
        if tuple(shape) != want:
            raise ValueError(f"{self.source}: tensor {piece.source_name!r} has shape {tuple(shape)}, but the "
                             f"model config needs {want}; the weights do not match the config")

    def put(self, piece: WeightPiece, tensor: torch.Tensor) -> None:
        """Copy `tensor` (any dtype, any device) into its place, converting to the model's dtype."""
        self.check_shape(piece, tuple(tensor.shape))
        param = self.params[piece.param]
        target = param if piece.rows is None else param[piece.rows[0]:piece.rows[1]]
        with torch.no_grad():
            target.copy_(tensor)
        self.seen.add(piece.source_name)

    def finish(self) -> None:
        """Raise a ValueError naming the checkpoint tensors that never arrived."""
        missing = [name for name in self.expected if name not in self.seen]
        if missing:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ValueError(f"{self.source}: {len(missing)} weight tensor(s) missing: {shown}; the checkpoint "
                             "is incomplete (truncated download?) or does not match its config")


def init_random(model: Transformer, seed: int = 0) -> None:
    """Deterministic random weights: N(0, 0.02) matrices and biases, unit norm weights.

    Each tensor is drawn from a CPU generator in float32 and copied into place, so the values do not
    depend on the device or dtype (beyond rounding) and only one tensor is ever duplicated.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=True):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
