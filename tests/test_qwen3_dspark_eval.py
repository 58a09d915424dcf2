"""The whole study on a Qwen3-style DSpark draft (docs/qwen3-dspark.md): synth, quantize,
verify, eval-drift in every regime with acceptance, a read-back variant and --sensitivity, then
the card, through the command line on the qwen3-tiny preset."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from qwen3_drafts import REDUCED, speculators_config, write_qwen3_draft
from safetensors.torch import load_file, save_file

from qstream.verification import MODES


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "draft"
    cli_ok(["synth", "--preset", "qwen3-tiny", "--output_dir", str(out)])
    return out


def test_quantize_verify_eval_and_card(draft, tmp_path):
    fp8 = tmp_path / "fp8"
    cli_ok(
        ["quantize", "--model_dir", str(draft), "--output_dir", str(fp8), "--quant_format", "fp8"]
    )
    cli_ok(["verify", str(fp8)])
    results = tmp_path / "results.json"
    cli_ok(["eval-drift", "--model", str(draft), "--regime", "all", "--acceptance",
            "--blocks", "24", "--formats", "bf16,nvfp4", "--variant", f"shipped={fp8}",
            "--json", str(results)])  # fmt: skip
    data = json.loads(results.read_text())
    assert data["selection"]["include"] == [
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.q_proj",
        "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "fc",
    ]  # fmt: skip
    assert set(data["regimes"]) == {"gauss", "heavy", "boot"}
    for regime in data["regimes"].values():
        assert set(regime["variants"]) == {"bf16", "nvfp4", "shipped"}
    card = tmp_path / "card" / "CARD.md"
    card.parent.mkdir()
    cli_ok(["card", str(results), "--checkpoint", str(fp8), "--base", str(draft),
            "--output", str(card)])  # fmt: skip
    assert "Qwen3DSparkModel" in card.read_text()


def test_sensitivity_measures_the_markov_projection(draft, tmp_path):
    results = tmp_path / "sens.json"
    cli_ok(["eval-drift", "--model", str(draft), "--regime", "heavy", "--blocks", "16",
            "--formats", "bf16", "--sensitivity", "--json", str(results)])  # fmt: skip
    data = json.loads(results.read_text())
    steps = data["regimes"]["heavy"]["sensitivity"]["single"]
    kinds = {step["kind"] for step in steps}
    assert "markov_head.markov_w2" in kinds
    assert "self_attn.q_proj + self_attn.k_proj + self_attn.v_proj" in kinds


def _drift(model, tokenizer, out, *extra):
    cli_ok(["eval-drift", "--model", str(model), "--tokenizer", tokenizer, "--regime", "heavy",
            "--acceptance", "--blocks", "8", "--formats", "bf16,nvfp4", "--json", str(out),
            *extra])  # fmt: skip
    return json.loads(out.read_text())


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def test_a_reduced_vocabulary_draft_is_evaluated_in_every_mode(draft, tmp_path):
    write_qwen3_draft(tmp_path / "draft", REDUCED)
    data = _drift(tmp_path / "draft", str(draft / "tokenizer.json"), tmp_path / "r.json")
    for regime in data["regimes"].values():
        for variant in regime["variants"].values():
            assert _finite(variant["metrics"])
            acceptance = variant["acceptance"]["reference"]
            assert set(acceptance) >= {mode.name for mode in MODES.values()}
            assert _finite(acceptance)


def test_a_checkpoint_in_speculators_layout_is_quantized_as_vllm_serves_it(tmp_path):
    """vLLM serves speculators' DSpark layout as Qwen3DSparkModel (update_dspark): quantize
    takes that profile's default list (no confidence head, no Markov head) and verify checks it
    against the same rules."""
    draft = write_qwen3_draft(tmp_path / "draft", embed=False)
    (draft / "config.json").write_text(json.dumps(speculators_config()))
    out = tmp_path / "fp8"
    cli_ok(
        ["quantize", "--model_dir", str(draft), "--output_dir", str(out), "--quant_format", "fp8"]
    )
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        scaled = {k.rsplit(".", 1)[0] for k in f.keys() if k.endswith(".weight_scale")}
    assert len(scaled) == 5 * 7 + 1 and "fc" in scaled
    assert not any(k.startswith(("confidence_head", "markov_head")) for k in scaled)
    result = cli_ok(["verify", str(out), "--target-layers", "8"])
    assert "vLLM rules Qwen3DSparkModel" in result.output


def test_a_dflash_draft_without_heads_is_evaluated(draft, tmp_path):
    """markov_rank 0 and no confidence head: the draft drafts its base logits; the confidence
    metrics are null in the results and n/a in the card."""
    import shutil

    from safetensors.torch import load_file, save_file

    dflash = tmp_path / "dflash"
    shutil.copytree(draft, dflash)
    (dflash / "qstream_synth.json").unlink()
    config = json.loads((dflash / "config.json").read_text())
    config.update(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    (dflash / "config.json").write_text(json.dumps(config))
    tensors = load_file(dflash / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith(("markov_head", "confidence"))}
    save_file(kept, dflash / "model.safetensors", metadata={"format": "pt"})
    results = tmp_path / "dflash.json"
    cli_ok(["eval-drift", "--model", str(dflash), "--regime", "heavy", "--acceptance",
            "--blocks", "16", "--formats", "bf16,nvfp4", "--json", str(results)])  # fmt: skip
    metrics = json.loads(results.read_text())["regimes"]["heavy"]["variants"]["nvfp4"]["metrics"]
    assert metrics["confidence_r"] is None and metrics["sched_flip_rate"] is None
    card = tmp_path / "card" / "CARD.md"
    card.parent.mkdir()
    cli_ok(["card", str(results), "--output", str(card)])
    assert "| confidence r" in card.read_text()


def test_an_identity_d2t_over_the_full_vocabulary_changes_no_result(draft, monkeypatch):
    """The reduced-vocabulary path (draft ids mapped in the rollouts, logits scattered into the
    target vocabulary before both verifiers) with the identity map over the full vocabulary
    gives the full draft's results byte for byte: the scatter copies each logit to its own
    column.  (A checkpoint cannot carry that map: vLLM reads d2t only when draft_vocab_size <
    vocab_size, so the map is put where the code reads it.)"""
    from qstream.arch import markov
    from qstream.eval import verifiers
    from qstream.eval.drift import evaluate_drift
    from qstream.eval.settings import DriftSettings

    settings = DriftSettings(model=str(draft), regime="heavy", blocks=8, formats=("bf16",),
                             acceptance=True, temperature=0.7, top_k=50)  # fmt: skip
    full = evaluate_drift(settings)
    identity = torch.arange(json.loads((draft / "config.json").read_text())["vocab_size"])
    init = verifiers.RegimeAcceptance.__init__

    def mapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.to_target = identity

    monkeypatch.setattr(markov, "draft_to_target", lambda model: identity)
    monkeypatch.setattr(verifiers.RegimeAcceptance, "__init__", mapped_init)
    mapped = evaluate_drift(settings)
    assert json.dumps(mapped, sort_keys=True) == json.dumps(full, sort_keys=True)


def test_a_reduced_draft_with_a_repeated_target_id_is_one_error_line(draft, tmp_path):
    model = write_qwen3_draft(tmp_path / "draft", REDUCED)
    tensors = {**load_file(model / "model.safetensors"), "d2t": torch.tensor([1, 0] + [0] * 510)}
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "r.json"
    message = cli_error(["eval-drift", "--model", str(model), "--tokenizer",
                         str(draft / "tokenizer.json"), "--blocks", "4", "--json", str(out)])  # fmt: skip
    assert message == (f"Error: {model}: d2t[1] = 0 maps draft id 1 to target id 1, as d2t[0] = "
                       "1 maps draft id 0: each draft id needs its own\n")  # fmt: skip
    assert not out.exists()
