"""Quantized activations in the forwards and their calibration (docs/eval-drift.md, "Serving
configurations"): every linear the format quantizes takes its input quantizer and no other
does, on both architectures; the calibration is reproducible from the seed and never uses an
evaluated block; a non-finite activation is one error naming the module; eval-drift measures
W4A4 and W8A8 on the tiny K3 draft and the qwen3-tiny preset."""

import shutil

import pytest
import torch
from model_helpers import random_model_weights
from qwen3_drafts import TINY as QWEN3_TINY
from qwen3_drafts import qwen3_tensors

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.interface import EMBED, LM_HEAD
from qstream.arch.registry import architecture_of, load_config
from qstream.arch.weights import ServedLinears
from qstream.calibration import (
    LINEAR_INPUTS,
    Calibration,
    Observer,
    calibrate,
    calibration_plan,
    calibration_seed,
)
from qstream.errors import QStreamError
from qstream.eval.corpus import sample_anchors
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.eval.variants import served_linears
from qstream.quant.simulate import simulated_selection
from qstream.serving import REFERENCE_VARIANT, Variant


def _mla():
    config = PRESETS["tiny"]
    return config, random_model_weights(config, seed=0)


def _qwen3():
    weights = qwen3_tensors(QWEN3_TINY)
    gen = torch.Generator().manual_seed(1)
    V, H = QWEN3_TINY.vocab_size, QWEN3_TINY.hidden_size
    weights[EMBED] = (torch.randn(V, H, generator=gen) * 0.02).bfloat16()
    weights[LM_HEAD] = (torch.randn(V, H, generator=gen) * 0.02).bfloat16()
    return QWEN3_TINY, weights


ARCHS = {"dspark": _mla, "qwen3": _qwen3}
SETTINGS = DriftSettings()  # the default selection


def _draft(model, config, seed=0):
    """One batch of two streams drafted at a few anchors (context and blocks)."""
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 24, config.aux_size, generator=gen).bfloat16()
    ctx = model.context(aux)
    stream, anchor = torch.tensor([0, 0, 1]), torch.tensor([5, 20, 11])
    return model.draft(ctx, stream, anchor, torch.tensor([3, 4, 5]))


def _calibration(config, weights):
    return calibrate(config, weights, "cpu", lambda m: _draft(m, config, seed=1), {})


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("token", ["fp8+a=fp8-dynamic", "fp8+a=fp8-static", "nvfp4+a=nvfp4"])
def test_every_quantized_linear_and_no_other_takes_its_input_quantizer(arch, token):
    config, weights = ARCHS[arch]()
    variant = Variant.parse(token)
    served = served_linears(variant, weights, config, SETTINGS, _calibration(config, weights))
    selection = simulated_selection(weights, variant.source, None, None, True, config)
    assert served is not None and set(served.inputs) == {f"{m}.weight" for m in selection.quantized}
    called: set[str] = set()

    def counted(name, quantize):
        return lambda x: called.add(name) or quantize(x)

    inputs = {name: counted(name, q) for name, q in served.inputs.items()}
    model = architecture_of(config).build(config, weights, variant, "cpu", ServedLinears(inputs))
    out = _draft(model, config)
    # vLLM's MLA decode never runs kv_b_proj as a linear: its weight is split into W_UK and W_UV
    # (qstream/arch/dspark_mla/model.py, Layer.absorbed), so its input is never quantized
    absorbed = {n for n in inputs if ".kv_b_proj." in n} if arch == "dspark" else set()
    assert absorbed or arch != "dspark"
    assert called == set(inputs) - absorbed
    assert torch.isfinite(out.logits_base).all()


def test_the_qwen3_cpu_path_is_the_same_arithmetic_through_computeweights():
    """A bf16 Qwen3 draft on the CPU multiplies in fp32 through ComputeWeights.linear: serving
    every linear an input that is only upcast changes no bit."""
    config, weights = _qwen3()
    arch, bf16 = architecture_of(config), Variant.of_format("bf16")
    plain = _draft(arch.build(config, weights, bf16, "cpu"), config)
    upcast = dict.fromkeys((k for k, v in weights.items() if v.dim() == 2 and k != EMBED), None)
    served = ServedLinears({k: (lambda x: x.float()) for k in upcast})
    routed = _draft(arch.build(config, weights, bf16, "cpu", served), config)
    assert torch.equal(plain.logits_base, routed.logits_base)


def test_quantized_activations_need_their_quantizers_and_a_scaled_kv_cache_its_scales():
    config, weights = _mla()
    arch = architecture_of(config)
    with pytest.raises(ValueError, match="input quantizers are missing"):
        arch.build(config, weights, Variant.parse("fp8+a=fp8-dynamic"), "cpu")
    with pytest.raises(ValueError, match="its KV-cache scales are missing"):
        arch.build(config, weights, Variant.parse("bf16+kv=fp8+kvscale=calibrated"), "cpu")


def test_calibration_is_the_amax_of_each_linear_input():
    config, weights = _mla()
    seen: dict[str, float] = {}

    def record(name, x):
        module = name.removesuffix(".weight")
        seen[module] = max(seen.get(module, 0.0), float(x.abs().max()))

    model = architecture_of(config).build(config, weights, REFERENCE_VARIANT, "cpu",
                                          ServedLinears(observe=record))  # fmt: skip
    _draft(model, config, seed=1)
    calibration = _calibration(config, weights)
    assert {k: float(v) for k, v in calibration.amax[LINEAR_INPUTS].items()} == seen
    assert calibration.input_amax("layers.0.mlp.down_proj") > 0
    with pytest.raises(QStreamError, match="no input of nowhere was observed"):
        Calibration({}, {}).input_amax("nowhere")


def test_a_non_finite_activation_names_its_module():
    observer = Observer()
    observer.linear_input("layers.2.mlp.down_proj.weight", torch.ones(3))
    with pytest.raises(QStreamError, match=r"^calibration: the linear inputs of layers\.2\.mlp"
                                           r"\.down_proj hold NaN or Inf"):  # fmt: skip
        observer.linear_input("layers.2.mlp.down_proj.weight", torch.tensor([1.0, float("inf")]))
    config, weights = _mla()
    weights = {**weights, "layers.0.post_attention_layernorm.weight": torch.full(
        weights["layers.0.post_attention_layernorm.weight"].shape, 3e38)}  # fmt: skip
    with pytest.raises(QStreamError, match="of layers.0.mlp.gate_proj hold NaN or Inf"):
        _calibration(config, weights)


def test_a_non_finite_calibration_activation_is_one_error_line_and_writes_nothing(tiny, tmp_path):
    from cli_helpers import cli_error
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    tensors = load_file(bad / "model.safetensors")
    norm = "layers.0.post_attention_layernorm.weight"
    tensors[norm] = torch.full_like(tensors[norm], 3e38)  # finite in bf16, overflows after
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "results.json"
    message = cli_error(["eval-drift", "--model", str(bad), "--regime", "gauss", "--blocks", "8",
                         "--formats", "fp8+a=fp8-static", "--json", str(out)])  # fmt: skip
    assert "the linear inputs of layers.0.mlp.gate_proj hold NaN or Inf" in message
    assert not out.exists()


def test_the_calibration_set_is_drawn_from_its_own_seed_and_leaves_evaluated_blocks_out(
    tiny, corpus
):
    config = load_config(tiny)
    assert calibration_seed(0) != 0 and calibration_seed(0) == calibration_seed(0)
    evaluated = sample_anchors(corpus, 64, config.block_size, 0)
    seed = calibration_seed(0)
    plan = calibration_plan(corpus, evaluated, 64, config, seed)
    again = calibration_plan(corpus, evaluated, 64, config, seed)
    assert torch.equal(plan.stream, again.stream) and torch.equal(plan.anchor, again.anchor)
    pairs = set(zip(plan.stream.tolist(), plan.anchor.tolist()))
    assert not pairs & set(zip(evaluated.stream.tolist(), evaluated.anchor.tolist()))
    assert 0 < len(pairs) <= 64
    # a plan that is the whole draw leaves nothing but evaluated blocks: refused
    drawn = sample_anchors(corpus, 8, config.block_size, seed,
                           max_context=config.max_position_embeddings - config.block_size)  # fmt: skip
    with pytest.raises(QStreamError, match="every calibration block is an evaluated one"):
        calibration_plan(corpus, drawn, 8, config, seed)


FORMATS = ("fp8", "fp8+a=fp8-dynamic", "fp8+a=fp8-static", "nvfp4", "nvfp4+a=nvfp4")


def _drift(model, corpus):
    settings = DriftSettings(model=model, regime=("gauss",), formats=FORMATS, blocks=16, seed=5)
    return evaluate_drift(settings, corpus)["regimes"]["gauss"]


@pytest.fixture(scope="module")
def drifts(tiny, corpus, qwen3_draft):
    return {"tiny": _drift(tiny, corpus), "qwen3": _drift(qwen3_draft, None)}


@pytest.fixture(scope="module")
def qwen3_draft(tmp_path_factory):
    from cli_helpers import cli_ok

    out = tmp_path_factory.mktemp("qwen3") / "draft"
    cli_ok(["synth", "--preset", "qwen3-tiny", "--output_dir", str(out)])
    return out


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_eval_drift_measures_quantized_activations(which, drifts):
    """Finite everywhere; NVFP4 inputs cost what NVFP4 weights alone do not (on this draft and
    these blocks, W4A4's KL is above W4A16's); the calibration's source is recorded."""
    regime = drifts[which]
    variants = regime["variants"]
    for name, entry in variants.items():
        kl = entry["metrics"]["kl"]["mean"]["value"]
        assert kl == kl and 0 <= kl < float("inf"), (name, kl)
        served = entry.get("configuration", {}).get("activations", "none")
        assert served == (name.partition("+a=")[2] or "none")
    w4a4, w4a16 = (
        variants[n]["metrics"]["kl"]["mean"]["value"] for n in ("nvfp4+a=nvfp4", "nvfp4")
    )
    assert w4a4 > w4a16, (w4a4, w4a16)
    assert regime["calibration"]["seed"] == calibration_seed(5)
    assert regime["calibration"]["blocks"] > 0


def test_eval_drift_with_quantized_activations_is_reproducible(drifts, tiny, corpus):
    assert _drift(tiny, corpus) == drifts["tiny"]


def test_a_quantized_linear_upcasts_a_big_weight_a_row_chunk_at_a_time(monkeypatch):
    """Integer operands make every float32 sum exact, so the chunked product must equal the
    whole one bit for bit whatever order a BLAS sums in."""
    import qstream.arch.weights as weights_module
    from qstream.arch.weights import ComputeWeights

    monkeypatch.setattr(weights_module, "UPCAST_MIN_ROWS", 3)
    monkeypatch.setattr(weights_module, "UPCAST_CHUNK_ELEMENTS", 3 * 16)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-8, 8, (10, 16), generator=gen).bfloat16()
    x = torch.randint(-8, 8, (2, 5, 16), generator=gen).bfloat16()
    served = ServedLinears({"w": lambda t: t.float() * 2})
    got = ComputeWeights({"w": weight}, torch.bfloat16, "cpu", served).linear("w", x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.nn.functional.linear(x.float() * 2, weight.float()).bfloat16())
