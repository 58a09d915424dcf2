"""EAGLE-3 served as users serve it (docs/eagle3.md, "Serving conditions"): a quantized drafting
head (``+head=``, vLLM 0.33.0's ``draft_lm_head_quantization``) over its own lm_head, an fp8 KV
cache (``+kv=``, what vLLM's ``reshape_and_cache_flash`` stores at scale 1.0) and dynamic FP8
activations (``+a=fp8-dynamic``) at every linear the weight format quantizes, each against a
transcription of vLLM's ops (tests/test_head.py, tests/test_kv_cache.py,
tests/test_activations.py); eval-drift and speculate with these tokens; what needs a
calibration stays one ``Error:`` line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import cli_error, cli_ok
from test_activations import vllm_quant_fp8
from test_eagle3_drafting import _reduced
from test_head import vllm_fp8_head, vllm_nvfp4_head
from test_kv_cache import vllm_cache

from qstream.arch.eagle3 import ARCH, LAYER
from qstream.arch.interface import LM_HEAD
from qstream.arch.registry import load_config
from qstream.errors import QStreamError
from qstream.eval.settings import DriftSettings
from qstream.eval.variants import served_linears, variant_weights
from qstream.serving import FLOOR_VARIANT, Variant

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def draft(e3):
    config = load_config(e3)
    return config, ARCH.load_weights(e3, None, config)


def _served(token: str, config, weights):
    """The model ``token`` names, built as eval-drift builds it (qstream/eval/variants.py)."""
    variant = Variant.parse(token)
    settings = DriftSettings(formats=(token,), include_layers=ARCH.quantize_include)
    var_weights, _ = variant_weights(variant, weights, config, settings, None)
    served = served_linears(variant, weights, config, settings, None)
    return ARCH.build(config, var_weights, variant, "cpu", served), var_weights, served


def _inputs(config, S=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (S, T), generator=g)
    aux = (torch.randn(S, T, config.aux_size, generator=g) * 2).bfloat16()
    return ids, aux


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("head, vllm", [("fp8", vllm_fp8_head), ("nvfp4", vllm_nvfp4_head)])
def test_the_drafting_head_is_vllms_quantized_copy_to_the_bit(draft, head, vllm, reduced):
    """Only the logits move: each is vLLM's op sequence over the bf16 lm_head (its own rows,
    the draft vocabulary's when reduced) applied to the final-normed state the step handed on."""
    config, weights = draft
    if reduced:
        config, weights = _reduced(config, weights, torch.arange(0, config.vocab_size, 3))
    plain = ARCH.build(config, weights, FLOOR_VARIANT)
    served, _, _ = _served(f"bf16+head={head}", config, weights)
    ids, aux = _inputs(config)
    want, got = plain.prefill(ids, aux), served.prefill(ids, aux)
    assert torch.equal(got.hidden, want.hidden) and torch.equal(got.k, want.k)
    normed = plain.norm(want.hidden, "norm")  # [S, T, H] bf16, what lm_head reads
    lm_head = weights[LM_HEAD].bfloat16()
    assert got.logits.shape[-1] == config.draft_vocab_size
    assert torch.equal(got.logits, vllm(lm_head, normed).float())
    assert not torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("kv, fp8", [("fp8", torch.float8_e4m3fn),
                                     ("fp8_e4m3", torch.float8_e4m3fn),
                                     ("fp8_e5m2", torch.float8_e5m2)])  # fmt: skip
def test_every_read_of_the_kv_cache_sees_what_vllm_stores(draft, kv, fp8, monkeypatch):
    """The prefill's keys and values and each chain step's own, rounded as
    reshape_and_cache_flash stores them at scale 1.0 before attention reads them; the
    queries, states and weights are as the bf16 cache's."""
    config, weights = draft
    plain = ARCH.build(config, weights, FLOOR_VARIANT)
    cached, _, _ = _served(f"bf16+kv={kv}", config, weights)
    read = []
    attend = type(cached).attend

    def recording(self, q, k, v, mask):
        read.append((k, v))
        return attend(self, q, k, v, mask)

    ids, aux = _inputs(config)
    want = plain.prefill(ids, aux)
    monkeypatch.setattr(type(cached), "attend", recording)
    got = cached.prefill(ids, aux)
    rounded = [vllm_cache(t, fp8, 1.0) for t in (want.k, want.v)]
    assert torch.equal(got.k, rounded[0]) and torch.equal(got.v, rounded[1])
    assert not torch.equal(got.k, want.k)
    assert torch.equal(read[-1][0], got.k) and torch.equal(read[-1][1], got.v)
    # a chain step: its own key joins the cached prefill's, rounded the same way
    token, hidden = ids[:, -1:], got.hidden[:, -1:]
    pos = torch.full((2, 1), ids.shape[1])
    visible = torch.ones(2, 1, ids.shape[1], dtype=torch.bool)
    mine = plain.step(token, hidden, pos, (got.k, got.v), visible)
    step = cached.step(token, hidden, pos, (got.k, got.v), visible)  # read last (one class)
    assert torch.equal(step.k, vllm_cache(mine.k, fp8, 1.0))
    assert torch.equal(read[-1][0], torch.cat((got.k, step.k), 1))
    assert torch.equal(read[-1][1], torch.cat((got.v, step.v), 1))


def test_a_bfloat16_cache_stores_the_compute_dtype(draft):
    config, weights = draft
    ids, aux = _inputs(config)
    want = ARCH.build(config, weights, FLOOR_VARIANT).prefill(ids, aux)
    got = _served("bf16+kv=bfloat16", config, weights)[0].prefill(ids, aux)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.k, want.k)


def test_dynamic_fp8_inputs_reach_every_linear_the_format_quantizes(draft):
    """Every linear FP8 quantizes (fc, q/k/v, o, gate/up/down) takes its input as vLLM's
    QuantFP8.forward_native per token; lm_head and the embedding do not.  fc by hand: the
    per-token codes times the fp32 scale, multiplied with the FP8 weight in fp32, rounded
    once to bf16."""
    config, weights = draft
    model, var_weights, served = _served("fp8+a=fp8-dynamic", config, weights)
    p = LAYER + "self_attn."
    linears = ["fc", *(p + f"{x}_proj" for x in "qkvo"),
               *(LAYER + f"mlp.{x}_proj" for x in ("gate", "up", "down"))]  # fmt: skip
    assert sorted(served.inputs) == sorted(f"{m}.weight" for m in linears)
    seen: list[str] = []
    inputs = {n: (lambda f, n: lambda x: (seen.append(n), f(x))[1])(f, n)
              for n, f in served.inputs.items()}  # fmt: skip
    recorded = replace(served, inputs=inputs)
    variant = Variant.parse("fp8+a=fp8-dynamic")
    ids, aux = _inputs(config)
    ARCH.build(config, var_weights, variant, "cpu", recorded).prefill(ids, aux)
    assert sorted(set(seen)) == sorted(served.inputs)
    codes, scale = vllm_quant_fp8(aux)
    fc = F.linear(codes.float() * scale, var_weights["fc.weight"].float()).bfloat16()
    assert torch.equal(model.combine(aux), fc)
    weight_only = _served("fp8", config, weights)[0]
    assert not torch.equal(weight_only.combine(aux), fc)


def test_a_kv_scale_other_than_1_is_one_error(draft):
    config, weights = draft
    variant = Variant.parse("bf16+kv=fp8+kvscale=calibrated")
    with pytest.raises(QStreamError, match="kvscale=calibrated is not evaluated for EAGLE-3"):
        ARCH.build(config, weights, variant)


def test_eval_drift_reports_each_serving_condition(e3, tmp_path):
    out = tmp_path / "r.json"
    formats = ["bf16", "bf16+head=fp8", "bf16+head=nvfp4", "bf16+kv=fp8", "bf16+kv=fp8_e5m2",
               "fp8", "fp8+a=fp8-dynamic"]  # fmt: skip
    cli_ok(["eval-drift", "--model", str(e3), "--regime", "heavy", "--blocks", "16",
            "--acceptance", "--formats", ",".join(formats), "--json", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["variants"]["bf16+head=nvfp4"]["configuration"]["head"] == "nvfp4"
    assert data["variants"]["bf16+kv=fp8_e5m2"]["configuration"]["kv_cache"] == "fp8_e5m2"
    assert data["variants"]["fp8+a=fp8-dynamic"]["configuration"]["activations"] == "fp8-dynamic"
    variants = data["regimes"]["heavy"]["variants"]
    assert list(variants) == formats
    kl = {n: v["metrics"]["kl"]["mean"]["value"] for n, v in variants.items()}
    assert all(math.isfinite(v) and v >= 0 for v in kl.values())
    for name, base in (("bf16+head=fp8", "bf16"), ("bf16+head=nvfp4", "bf16"),
                       ("bf16+kv=fp8", "bf16"), ("bf16+kv=fp8_e5m2", "bf16"),
                       ("fp8+a=fp8-dynamic", "fp8")):  # fmt: skip
        assert kl[name] != kl[base], name


@pytest.mark.parametrize("token", ["nvfp4+a=nvfp4", "fp8+a=fp8-static",
                                   "bf16+kv=fp8+kvscale=calibrated"])  # fmt: skip
def test_what_needs_a_calibration_is_one_error_line(e3, tmp_path, token):
    out = tmp_path / "r.json"
    error = cli_error(["eval-drift", "--model", str(e3), "--regime", "heavy", "--blocks", "4",
                       "--formats", f"bf16,{token}", "--json", str(out)])  # fmt: skip
    assert "static activation or KV-cache scales" in error and "EAGLE-3" in error, error
    assert not out.exists()
