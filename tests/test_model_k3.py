"""The k3 preset at full Kimi-K3 scale (docs/model.md).  Writes ~7.1 GB, so no CI lane runs it:
run it with ``pytest -m k3 tests/test_model_k3.py``."""

import pytest

from qstream.arch.dspark_mla import QUANTIZE_INCLUDE, read_draft_tensors
from qstream.checkpoint.inspect import inspect_checkpoint
from qstream.quant.quantize import quantize_checkpoint
from qstream.synth.draft import synth_checkpoint


@pytest.mark.k3
def test_k3_synth_shapes_and_quantize_plan(tmp_path):
    out = tmp_path / "k3"
    summary = synth_checkpoint("k3", out, seed=0)
    assert summary.tensors == 68
    assert summary.parameters == 3_562_312_961
    report = inspect_checkpoint(out)
    assert report["tensors"] == 68 and report["params"] == 3_562_312_961
    read_draft_tensors(out)  # strict check of every name and shape, memory-mapped
    plan = quantize_checkpoint(
        out, tmp_path / "fp8", "fp8", include=list(QUANTIZE_INCLUDE), dry_run=True
    )
    assert plan.params_quantized == 2_186_280_960
    assert len(plan.modules_ignored) == 41
    assert abs(plan.bytes_before / 2**30 - 6.6) < 0.05
    assert abs(plan.bytes_after / 2**30 - 4.6) < 0.1
