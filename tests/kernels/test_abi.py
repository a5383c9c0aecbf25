"""kernels/abi.py: the ctypes copies of csrc/cpu_decode.c's structs and of the C limits against the
layout the library reports, once per kernel variant; a wrong copy is named by struct and field,
and a library that disagrees with Python is not used (PyTorch runs instead)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ringctx.kernels import abi, build, cpu, report
from tests.kernels.test_cpu_kernels import needs_kernels

pytestmark = [needs_kernels, pytest.mark.usefixtures("kernel_variant")]


class ShapeWithDoubleEps(ctypes.Structure):
    """ringctx_decoder_shape with `norm_eps` declared double: it and the fields after it are off."""

    _fields_ = [(name, ctypes.c_double if name == "norm_eps" else kind) for name, kind in abi.DecoderShape._fields_]


class SourceWithoutLast(ctypes.Structure):
    """ringctx_attention_source without its last field, `stored_from`."""

    _fields_ = abi.AttentionSource._fields_[:-1]


def test_the_library_reports_the_layout_python_declares():
    lib = build.library()
    assert lib is not None, build.kernel_error()
    assert abi.layout_problems(lib) == []
    fields, limits = abi.c_layout(lib)
    for c_name, structure in abi.STRUCTS.items():
        assert fields[c_name] == (0, ctypes.sizeof(structure))
        declared = [name for name, _ in structure._fields_]
        assert [key.split(".", 1)[1] for key in fields if key.startswith(c_name + ".")] == declared
    assert limits == abi.LIMITS


def test_a_wrong_structure_is_named_by_struct_and_field():
    lib = build.library()
    here = f"{__name__}.ShapeWithDoubleEps"
    assert abi.layout_problems(lib, {"ringctx_decoder_shape": ShapeWithDoubleEps}, {}) == [
        f"ringctx_decoder_shape.norm_eps: offset 40, 4 bytes in C; offset 40, 8 bytes in {here}",
        f"ringctx_decoder_shape.softmax_scale: offset 44, 4 bytes in C; offset 48, 4 bytes in {here}",
        f"ringctx_decoder_shape.bf16: offset 48, 4 bytes in C; offset 52, 4 bytes in {here}"]

    problems = abi.layout_problems(lib, {"ringctx_attention_source": SourceWithoutLast}, {})
    here = f"{__name__}.SourceWithoutLast"
    assert problems == [f"struct ringctx_attention_source is 112 bytes in C, 104 in {here}",
                        f"ringctx_attention_source.stored_from: a field of the C struct that {here} does not have"]

    assert abi.layout_problems(lib, {}, {"MAX_R": 32}) == ["MAX_R is 64 in C, 32 in ringctx/kernels/abi.py"]
    assert abi.layout_problems(lib, {"ringctx_no_such_struct": abi.DecoderShape}, {}) == [
        "struct ringctx_no_such_struct (ringctx.kernels.abi.DecoderShape) is not in the library's layout"]


def test_a_library_whose_layout_differs_is_not_used(monkeypatch):
    monkeypatch.setattr(abi, "STRUCTS", {**abi.STRUCTS, "ringctx_decoder_shape": ShapeWithDoubleEps})
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(build, "_errors", {})
    assert build.library() is None
    assert "ringctx_decoder_shape.norm_eps: offset 40, 4 bytes in C" in build.kernel_error()
    assert cpu.small_linear(torch.randn(1, 32), torch.randn(8, 32)) is None  # PyTorch runs instead
    info = report.cpu_kernels_report()
    assert info["variant"] is None and "ringctx_decoder_shape" in info["why"]
