"""The formats as objects (docs/formats.md): each Format's declared stored tensors are what its
quantize writes, the facts verify reads of it hold, and the registry is the only place a format's
name is looked up: no module outside qstream/formats/ compares a format's name, and no module
inside it imports the registry back."""

import ast
from pathlib import Path

import pytest
import torch

from qstream import QStreamError
from qstream.checkpoint.layout import stored_tensors
from qstream.checkpoint.safetensors_io import DTYPE_NAMES, TensorInfo
from qstream.formats import FORMATS, get_format

PACKAGE = Path(__file__).resolve().parent.parent / "qstream"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 64), (1, 32), (17, 160)])
def test_declared_stored_tensors_are_what_quantize_writes(fmt, dtype, shape):
    spec = FORMATS[fmt]
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    written = spec.quantize(w)
    info = TensorInfo("m.weight", DTYPE_NAMES[dtype], shape, 0, 0)
    planned = [(t.name, t.dtype, tuple(t.shape)) for t in stored_tensors(spec, "m", info)]
    assert planned == [(f"m.{s}", DTYPE_NAMES[t.dtype], tuple(t.shape)) for s, t in written.items()]
    for suffix, t in written.items():
        assert DTYPE_NAMES[t.dtype] in spec.accepted_dtypes(suffix)
    codes = written[spec.stored[0]]
    assert codes.shape[1] * spec.codes_per_byte == shape[1]
    assert spec.marks_quantized(spec.stored[0], DTYPE_NAMES[codes.dtype])
    assert spec.scales == tuple(s for s in written if s != spec.stored[0])
    assert (spec.global_scale is not None) == (fmt == "nvfp4")


def test_an_unquantized_weight_does_not_mark_its_module_quantized():
    fp8, mxfp4 = get_format("fp8"), get_format("mxfp4")
    assert not fp8.marks_quantized("weight", "BF16")
    assert fp8.marks_quantized("weight", "F8_E4M3")
    assert not fp8.marks_quantized("weight_scale", "BF16")
    # a packed tensor of the wrong dtype still marks its module: verify then names the dtype
    assert mxfp4.marks_quantized("weight_packed", "F32")
    assert not mxfp4.marks_quantized("weight", "BF16")


def test_bad_scales_are_what_each_format_cannot_decode():
    mx = torch.tensor([0, 127, 0xFF], dtype=torch.uint8)
    _, bad, what = get_format("mxfp4").bad_scales(mx)
    assert bad.tolist() == [False, False, True] and what == "E8M0 0xFF (NaN)"
    fp = torch.tensor([1.0, 0.0, -1.0, float("inf")], dtype=torch.bfloat16)
    for fmt in ("fp8", "nvfp4"):
        value, bad, what = get_format(fmt).bad_scales(fp)
        assert bad.tolist() == [False, True, True, True] and what == "non-finite or not positive"
        assert value.dtype == torch.float32


def test_an_unknown_format_names_the_choices():
    with pytest.raises(
        QStreamError, match=r"unknown format 'int4'; choose one of fp8, mxfp4, nvfp4"
    ):
        get_format("int4")


def registry_imports_inside_formats(root: Path) -> list[str]:
    """Modules of ``root/formats`` (the registry itself aside) that import the registry,
    ``qstream.formats``: an import circle."""
    found = []
    for path in sorted((root / "formats").glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "qstream.formats":
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_format_modules_do_not_import_the_registry():
    assert registry_imports_inside_formats(PACKAGE) == []
