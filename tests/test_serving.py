"""A variant is a serving configuration (qstream/serving.py): its weights named by kind, its
compute dtype a property, and activations / KV cache / target refused when unknown."""

from __future__ import annotations

import re
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
    [
        ("kind", "int8"),
        ("activations", "fp8"),
        ("kv_cache", "fp16"),
        ("target", "int4"),
        ("head", "mxfp4"),
    ],
)
def test_an_unknown_value_is_refused_naming_the_field_and_value(field, value):
    with pytest.raises(QStreamError, match=f"variant x: {field} '{value}': choose one of"):
        Variant("x", **{"kind": "bf16", "source": "bf16", field: value})


def test_no_torch_at_import():
    code = "import sys, qstream.serving; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "token, kv, name, served",
    [
        ("nvfp4", None, "nvfp4", ("none", "auto", "1.0", "unquantized", "stored")),
        (
            "fp8+a=fp8-dynamic",
            None,
            "fp8+a=fp8-dynamic",
            ("fp8-dynamic", "auto", "1.0", "unquantized", "stored"),
        ),
        # fields in any order, named canonically
        (
            "nvfp4+kv=fp8_e5m2+a=nvfp4",
            None,
            "nvfp4+a=nvfp4+kv=fp8_e5m2",
            ("nvfp4", "fp8_e5m2", "1.0", "unquantized", "stored"),
        ),
        (
            "bf16+kv=fp8+kvscale=calibrated",
            None,
            "bf16+kv=fp8+kvscale=calibrated",
            ("none", "fp8", "calibrated", "unquantized", "stored"),
        ),
        ("bf16+target=fp8", None, "bf16+target=fp8", ("none", "auto", "1.0", "fp8", "stored")),
        # the drafting head quantized at load (vLLM 0.33.0's draft_lm_head_quantization)
        (
            "bf16+head=nvfp4+kv=fp8",
            None,
            "bf16+kv=fp8+head=nvfp4",
            ("none", "fp8", "1.0", "unquantized", "nvfp4"),
        ),
        # --kv-cache-dtype: every variant but the reference, unless the token names one
        (
            "mxfp4",
            "fp8_e4m3",
            "mxfp4+kv=fp8_e4m3",
            ("none", "fp8_e4m3", "1.0", "unquantized", "stored"),
        ),
        (
            "bf16+kv=bfloat16",
            "fp8",
            "bf16+kv=bfloat16",
            ("none", "bfloat16", "1.0", "unquantized", "stored"),
        ),
        ("fp32", "fp8", "fp32", ("none", "auto", "1.0", "unquantized", "stored")),
    ],
)
def test_a_token_names_a_configuration(token, kv, name, served):
    variant = Variant.parse(token, kv_cache=kv)
    assert variant.name == name
    assert tuple(variant.configuration().values()) == served
    assert Variant.parse(name, kv_cache=kv) == variant  # the name parses back to itself


@pytest.mark.parametrize(
    "token, message",
    [
        ("int8", "unknown weights 'int8'"),
        ("nvfp4+kv", "'kv' is not KEY=VALUE"),
        ("nvfp4+x=1", "'x=1' is not KEY=VALUE"),
        ("nvfp4+kv=fp8+kv=auto", "kv given twice"),
        ("nvfp4+kv=fp16", "kv_cache 'fp16': choose one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"),
        (
            "nvfp4+a=fp8-dynamic",
            "activations 'fp8-dynamic' are served with fp8 weights, not 'nvfp4'",
        ),
        ("bf16+a=nvfp4", "activations 'nvfp4' are served with nvfp4 weights, not 'bf16'"),
        ("fp32+kv=fp8", "the fp32 reference is served as stored"),
        ("fp32+head=fp8", "the fp32 reference is served as stored"),
        ("bf16+head=int8", "head 'int8': choose one of stored, fp8, nvfp4"),
        ("bf16+kvscale=calibrated", "kvscale 'calibrated' needs an fp8 e4m3 KV cache"),
        ("bf16+kv=fp8_e5m2+kvscale=calibrated", "vLLM 0.32.0 refuses fp8_e5m2 with a checkpoint"),
        ("bf16+kv=fp8+kvscale=checkpoint", "kvscale 'checkpoint' needs a checkpoint"),
    ],
)
def test_a_bad_token_is_refused_naming_it(token, message):
    with pytest.raises(QStreamError, match=re.escape(message)):
        Variant.parse(token)


def test_what_a_configuration_asks_of_vllm():
    assert Variant.parse("fp8+kv=fp8").kv.quantized and not FLOOR_VARIANT.kv.quantized
    assert Variant.parse("bf16+kv=bfloat16").kv.dtype == "bfloat16"
    assert Variant.parse("fp8+a=fp8-static").activation.vllm_scheme == "CompressedTensorsW8A8Fp8"
    assert not Variant.parse("fp8+a=fp8-static").activation.dynamic
    assert Variant.parse("nvfp4+a=nvfp4").activation.vllm_scheme == "CompressedTensorsW4A4Fp4"
