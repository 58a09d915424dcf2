"""A variant is a serving configuration (qstream/serving.py): its weights named by kind, its
compute dtype a property, and activations / KV cache / target refused when unknown."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qstream.errors import QStreamError
from qstream.serving import FLOOR_VARIANT, REFERENCE_VARIANT, Variant


def test_what_each_variant_is():
    nvfp4, shipped = Variant.of_format("nvfp4"), Variant.of_checkpoint("shipped", "dir")
    assert REFERENCE_VARIANT.reference and REFERENCE_VARIANT.stored
    assert REFERENCE_VARIANT.dtype == torch.float32
    assert FLOOR_VARIANT.stored and not FLOOR_VARIANT.reference
    assert (nvfp4.kind, nvfp4.source, nvfp4.simulated, nvfp4.dtype) == (
        "simulated", "nvfp4", True, torch.bfloat16,
    )  # fmt: skip
    assert shipped.checkpoint and shipped.weights.making == "loading"
    assert (nvfp4.activations, nvfp4.kv_cache, nvfp4.target) == ("none", "auto", "unquantized")


@pytest.mark.parametrize(
    "field, value",
    [("kind", "int8"), ("activations", "fp8"), ("kv_cache", "fp8_e4m3"), ("target", "nvfp4")],
)
def test_an_unknown_value_is_refused_naming_the_field_and_value(field, value):
    with pytest.raises(QStreamError, match=f"variant x: {field} '{value}': choose one of"):
        Variant("x", **{"kind": "bf16", "source": "bf16", field: value})


def test_no_torch_at_import():
    code = "import sys, qstream.serving; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
