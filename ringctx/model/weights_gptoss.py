"""gpt-oss's expert tensors in Hugging Face checkpoints: fused over the experts, transposed, gate and
up interleaved, and in openai's checkpoints MXFP4 (4-bit values with a power of two per 32).
weights_hf.py's loader hands each such tensor to `GptOssExperts`, which cuts it into the per-expert
pieces `expected_hf_tensors` lists (EXPERT_NAMES["gpt_oss"]: ringctx's own per-expert names)."""

from __future__ import annotations

import re

import torch

from .config import ModelConfig
from .weights import WeightFiller

GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$")
"""A gpt-oss layer's expert tensors (E experts, F = intermediate_size, D = hidden_size), as
transformers 5.25's save_pretrained writes them (GptOssExperts' parameters) and as openai's
checkpoints ship them:

    gate_up_proj [E, D, 2F]        x @ gate_up_proj[e]: columns 2j are gate unit j, 2j+1 up unit j
    gate_up_proj_bias [E, 2F]      interleaved alike
    down_proj [E, F, D]            h @ down_proj[e]
    down_proj_bias [E, D]
    gate_up_proj_blocks [E, 2F, D/32, 16] uint8, gate_up_proj_scales [E, 2F, D/32] uint8    MXFP4 (openai)
    down_proj_blocks [E, D, F/32, 16] uint8, down_proj_scales [E, D, F/32] uint8

MXFP4 (`dequantize_mxfp4`) is dequantized at load into the model's dtype (exactly: every value is
a 4-bit float times a power of two, which bf16 and float32 hold; there is no 4-bit kernel), so a
bf16 gpt-oss-20b takes 2 bytes per expert weight in memory, not 4.25 bits."""

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an FP4 (E2M1) code, by code (transformers' integrations/mxfp4.py FP4_VALUES)."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> values: blocks [..., G, 16] uint8 (two FP4 codes a byte, the low nibble first),
    scales [..., G] uint8 (each group of 32 values' power of two, biased by 127) -> [..., G * 32] in
    dtype, value = FP4_VALUES[code] * 2^(scale - 127), as transformers' convert_moe_packed_tensors
    (before its transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of `dequantize_mxfp4` for values it can produce: values [..., G * 32], each an
    FP4 value times 2^(scale - 127) of its group's scales [..., G] uint8 -> blocks [..., G, 16] uint8
    (for tests and tools writing MXFP4 checkpoints)."""
    *lead, width = values.shape
    groups = values.float().reshape(*lead, width // 32, 32)
    units = torch.ldexp(groups, (127 - scales.to(torch.int32)).unsqueeze(-1))  # the FP4 values themselves
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (units.abs().unsqueeze(-1) == lut).float().argmax(-1) + 8 * torch.signbit(units)  # -0.0 has its own code (8)
    if not torch.equal(lut[codes % 8] * torch.where(codes >= 8, -1.0, 1.0), units):
        raise ValueError("quantize_mxfp4: a value is not an FP4 value times its group's power of two")
    codes = codes.to(torch.uint8).reshape(*lead, width // 32, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4)


class GptOssExperts:
    """Reads one gpt-oss checkpoint's expert tensors into their per-expert pieces (`GPT_OSS_EXPERTS`:
    the fused tensors, or MXFP4 blocks and scales, which may sit in different files of a sharded
    checkpoint: each pair is dequantized once both are seen)."""

    def __init__(self, config: ModelConfig, directory: str):
        self.config, self.directory = config, directory
        self.mxfp4: dict[tuple[int, str], dict[str, str]] = {}  # (layer, proj) -> {"_blocks": path, "_scales": path}

    def take(self, handle, path: str, name: str, shape: tuple[int, ...], filler: WeightFiller) -> bool:
        """Fill the pieces of tensor `name` (shape `shape`) of the open file `path`; False: not an
        expert tensor of gpt-oss."""
        match = GPT_OSS_EXPERTS.match(name)
        if match is None:
            return False
        layer, proj, suffix = int(match.group(1)), match.group(2), match.group(3)
        if suffix in ("_blocks", "_scales"):
            seen = self.mxfp4.setdefault((layer, proj), {})
            seen[suffix] = path
            if len(seen) == 2:
                self._fill_mxfp4(layer, proj, seen, filler)
            return True
        E, F, D = self._shape(layer)
        needed = {("gate_up_proj", ""): (E, D, 2 * F), ("gate_up_proj", "_bias"): (E, 2 * F),
                  ("down_proj", ""): (E, F, D), ("down_proj", "_bias"): (E, D)}[proj, suffix]
        if shape != needed:
            raise ValueError(f"{self.directory}: tensor {name!r} has shape {shape}, but the model config needs "
                             f"{needed} (experts, the model width, 2 x intermediate_size); the weights do not "
                             "match the config")
        for e in range(E):
            try:
                value = handle.get_slice(name)[e]
            except Exception as err:
                raise ValueError(f"{path}: cannot read tensor {name!r} ({type(err).__name__}: {err}); the file is "
                                 "truncated or corrupt, re-download it") from None
            kind = "bias" if suffix else "weight"
            value = value.T if kind == "weight" else value  # [out, in], as ringctx's linear takes it
            self._put(layer, e, proj, kind, value, filler)
        return True

    def finish(self) -> None:
        """A ValueError for MXFP4 blocks without their scales, or scales without their blocks."""
        for (layer, proj), seen in self.mxfp4.items():
            if len(seen) == 1:
                have, lacking = next(iter(seen)), "_scales" if "_blocks" in seen else "_blocks"
                raise ValueError(f"{self.directory}: model.layers.{layer}.mlp.experts.{proj}{have} has no "
                                 f"{proj}{lacking} in the checkpoint; the MXFP4 experts are incomplete (truncated "
                                 "download?)")

    def _shape(self, layer: int) -> tuple[int, int, int]:
        experts = self.config.experts(layer)
        return experts.n_experts, experts.expert_ffn_dim, self.config.dim

    def _put(self, layer: int, e: int, proj: str, kind: str, value: torch.Tensor, filler: WeightFiller) -> None:
        """Expert e's gate_up (interleaved rows [2F, ...]: gate units even, up odd) or down tensor
        `value`, in [out, in] orientation (or a bias), into its pieces, each cut to this TP rank's share."""
        stem = f"model.layers.{layer}.mlp.experts.{e}"
        parts = [("down", value)] if proj == "down_proj" else [("gate", value[0::2]), ("up", value[1::2])]
        for which, part in parts:
            piece = filler.piece(f"{stem}.{which}.{kind}")
            filler.check_shape(piece, tuple(part.shape))
            filler.put(piece, part if piece.take is None else part[piece.take.index()])

    def _fill_mxfp4(self, layer: int, proj: str, paths: dict[str, str], filler: WeightFiller) -> None:
        """Dequantize layer `layer`'s MXFP4 `proj` (its _blocks and _scales, in the files `paths`
        name) one expert at a time, after checking their shapes against the config."""
        from safetensors import safe_open

        E, F, D = self._shape(layer)
        rows, width = (2 * F, D) if proj == "gate_up_proj" else (D, F)
        stem = f"model.layers.{layer}.mlp.experts.{proj}"
        with safe_open(paths["_blocks"], framework="pt", device="cpu") as blocks, \
                safe_open(paths["_scales"], framework="pt", device="cpu") as scales:
            b_shape = tuple(blocks.get_slice(stem + "_blocks").get_shape())
            s_shape = tuple(scales.get_slice(stem + "_scales").get_shape())
            if width % 32 or b_shape != (E, rows, width // 32, 16) or s_shape != (E, rows, width // 32):
                raise ValueError(f"{self.directory}: MXFP4 blocks of the wrong size: {stem}_blocks {b_shape} and "
                                 f"_scales {s_shape}, but the config's {E} experts of {F} units over a width of {D} "
                                 f"need {(E, rows, width // 32, 16)} and {(E, rows, width // 32)}; the weights do "
                                 "not match the config")
            dtype = filler.params[f"layers.{layer}.feed_forward.w13"].dtype
            for e in range(E):
                value = dequantize_mxfp4(blocks.get_slice(stem + "_blocks")[e], scales.get_slice(stem + "_scales")[e],
                                         dtype)
                self._put(layer, e, proj, "weight", value, filler)
