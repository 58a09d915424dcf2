"""DFlash drafts under their own name (docs/qwen3-dspark.md, "DFlash drafts"; docs/vllm.md,
"The DFlash draft"): a ``DFlashDraftModel`` config.json (vLLM's dense layout or speculators'
``dflash``) is read through the registry as the Qwen3-style family without heads, ``synth
--preset qwen3-dflash-tiny`` writes one, and quantize / verify apply its own serving profile
(vLLM 0.32.0's ``DFlashQwen3ForCausalLM``, qwen3_dflash.py)."""

import json
from pathlib import Path

import pytest
from cli_helpers import cli_error, cli_ok
from qwen3_drafts import TINY, speculators_config, write_qwen3_draft
from safetensors import safe_open

from qstream.arch import dflash_qwen3, dspark_qwen3
from qstream.arch.dflash_qwen3 import PRESETS, DFlashQwen3Config, dflash_of
from qstream.arch.registry import architecture_for, architecture_of, load_config
from qstream.errors import QStreamError
from qstream.synth.draft import synth_checkpoint
from qstream.vllm.profiles import head_problem, never_quantized, profile_for, runtime_modules

DFLASH = "DFlashDraftModel"
HEADS = ("markov_head.", "confidence_head.")


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """``qstream synth --preset qwen3-dflash-tiny``."""
    out = tmp_path_factory.mktemp("dflash") / "d"
    return Path(synth_checkpoint("qwen3-dflash-tiny", out).output_dir)


def _tensor_names(directory: Path) -> set[str]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return set(f.keys())


# --- reading the config -------------------------------------------------------------------------


def test_synth_writes_a_dflash_draft_that_reads_back_as_one(draft):
    data = json.loads((draft / "config.json").read_text())
    assert data["architectures"] == [DFLASH] and data["model_type"] == "qwen3"
    assert set(data["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert not set(data) & set(dflash_qwen3.DSPARK_KEYS)  # no Markov / confidence / anchor keys
    assert not any(n.startswith(HEADS) for n in _tensor_names(draft))
    config = load_config(draft)
    assert type(config) is DFlashQwen3Config and architecture_of(config) is dflash_qwen3.ARCH
    assert config.markov_rank == 0 and not config.enable_confidence_head
    assert (config.block_slots, config.block_size, config.first_slot) == (8, 7, 1)
    assert config.target_layer_ids == PRESETS["qwen3-dflash-tiny"].target_layer_ids


def test_a_published_style_dflash_config_is_read():
    """The keys a DFlash checkpoint's config.json holds (transformers 4 RoPE keys, layer_types,
    the target layers and mask in dflash_config): vLLM's ``update_dflash`` layout."""
    data = {
        **{k: v for k, v in PRESETS["qwen3-dflash-tiny"].to_json().items() if k != "rope_parameters"},
        "rope_theta": 1000000, "rope_scaling": None, "layer_types": ["full_attention"] * 5,
        "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3, 5, 6, 7]},
        "num_target_layers": 8, "use_sliding_window": False, "sliding_window": None,
    }  # fmt: skip
    config = architecture_for(data).parse_config(data)
    assert type(config) is DFlashQwen3Config
    assert config.mask_token_id == 5 and config.target_layer_ids == (1, 3, 5, 6, 7)


def test_a_speculators_dflash_config_is_the_dflash_architecture():
    """As speculators' DFlashSpeculatorConfig saves it (the backbone nested, hidden-states
    indices for the layers, no head keys)."""
    dspark = speculators_config(TINY)
    kept = ("transformer_layer_config aux_hidden_state_layer_ids draft_vocab_size mask_token_id "
            "target_hidden_size").split()  # fmt: skip
    data = {k: dspark[k] for k in kept}
    data.update(speculators_model_type="dflash", architectures=[DFLASH], block_size=8)  # fmt: skip
    arch = architecture_for(data)
    config = arch.parse_config(data)
    assert arch is dflash_qwen3.ARCH and config.target_layer_ids == (0, 2, 4, 5, 6)
    assert config.block_size == 7 and config.markov_rank == 0
    assert profile_for(data).name == DFLASH  # vLLM's update_dflash serves it as DFlashDraftModel


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"markov_rank": 32}, "markov_rank = 32 a DFlashDraftModel has none"),
        ({"enable_confidence_head": True}, "enable_confidence_head = True a DFlashDraftModel"),
        (
            {
                "dflash_config": {
                    "mask_token_id": 2,
                    "target_layer_ids": [0],
                    "sample_from_anchor": True,
                }
            },
            "dflash_config.sample_from_anchor = True is refused by vLLM",
        ),
        ({"has_own_lm_head": "yes"}, "has_own_lm_head = 'yes' must be true or false"),
    ],
)
def test_a_bad_dflash_config_is_one_error_line(draft, tmp_path, change, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in draft.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    data = {**json.loads((draft / "config.json").read_text()), **change}
    (bad / "config.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    error = cli_error(["quantize", "--model_dir", str(bad), "--output_dir", str(out),
                       "--quant_format", "fp8"])  # fmt: skip
    assert f"{bad / 'config.json'}: {message}" in error
    assert not out.exists()


# --- the serving profile ------------------------------------------------------------------------


def test_the_profile_shares_the_dspark_backbone_and_drops_its_heads():
    dflash = profile_for(PRESETS["qwen3-dflash-tiny"].to_json())
    dspark = profile_for(dspark_qwen3.PRESETS["qwen3-tiny"].to_json())
    assert (dflash.name, dflash.served_class) == (DFLASH, "DFlashQwen3ForCausalLM")
    assert (dspark.name, dspark.served_class) == ("Qwen3DSparkModel", "Qwen3DSparkForCausalLM")
    assert dflash.method == "dflash" and dflash.drafted_tokens_given
    assert dflash.layer_modules is dspark.layer_modules  # the same rules, not a copy
    assert dflash.default_include == dspark.default_include and dflash.gqa_heads == dspark.gqa_heads
    assert never_quantized(dflash, "embed_tokens") == never_quantized(dspark, "embed_tokens")
    assert never_quantized(dspark, "lm_head") and never_quantized(dflash, "lm_head") is None
    assert "markov_head.markov_w2" not in dflash.lm_heads


def test_the_lm_head_takes_the_quant_config_only_with_has_own_lm_head():
    dflash = profile_for(PRESETS["qwen3-dflash-tiny"].to_json())
    plain = dflash_of(TINY, draft_vocab_size=512).to_json()
    own = dflash_of(TINY, draft_vocab_size=512, has_own_lm_head=True).to_json()
    assert own["has_own_lm_head"] is True and "has_own_lm_head" not in plain
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        assert head_problem(dflash, "lm_head", fmt, own) is None
        assert "only when config.json sets has_own_lm_head: true" in head_problem(
            dflash, "lm_head", fmt, plain
        )
    heads = [m for m in runtime_modules(dflash, ["lm_head", "fc"], 8) if not m.linear]
    assert [(m.name, m.shards) for m in heads] == [("lm_head", ("lm_head",))]


def test_has_own_lm_head_makes_the_lm_head_required(tmp_path):
    directory = write_qwen3_draft(tmp_path / "d", dflash_of(TINY, has_own_lm_head=True))
    assert "lm_head.weight" in _tensor_names(directory)
    config = load_config(directory)
    assert config.own_lm_head and not config.reduced_vocab
    data = json.loads((directory / "config.json").read_text())
    (tmp_path / "d" / "model.safetensors").unlink()
    write_qwen3_draft(tmp_path / "e", dflash_of(TINY))
    (tmp_path / "e" / "config.json").write_text(json.dumps(data))
    error = cli_error(["quantize", "--model_dir", str(tmp_path / "e"), "--output_dir",
                       str(tmp_path / "out"), "--quant_format", "fp8"])  # fmt: skip
    assert "lm_head.weight: missing; vLLM builds it [1024, 64]" in error
    e = tmp_path / "e"  # and the reader says why (eval-drift, speculate)
    with pytest.raises(QStreamError, match=r"missing tensor 'lm_head.weight'.*has_own_lm_head"):
        dflash_qwen3.ARCH.load_weights(e, None, load_config(e))


# --- quantize and verify ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantize_and_verify_a_dflash_draft(draft, tmp_path, fmt):
    out = tmp_path / fmt
    cli_ok(["quantize", "--model_dir", str(draft), "--output_dir", str(out), "--quant_format",
            fmt, "--json", str(tmp_path / "q.json")])  # fmt: skip
    summary = json.loads((tmp_path / "q.json").read_text())
    assert summary["serving_profile"] == DFLASH
    assert len(summary["modules_quantized"]) == 5 * 7 + 1  # every backbone linear and fc
    result = cli_ok(["verify", str(out), "--deep"])
    assert f"vLLM rules {DFLASH} (served as DFlashQwen3ForCausalLM)" in result.output
    cli_ok(["verify", str(out), "--json", str(tmp_path / "v.json")])
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"] and report["served_class"] == "DFlashQwen3ForCausalLM"
    runtime = {m["module"] for m in report["runtime_modules"]}
    assert {"model.fc", "model.layers.8.mlp.gate_up_proj"} <= runtime


def test_the_lm_head_is_quantized_with_has_own_lm_head_and_refused_without(tmp_path):
    include = [*dspark_qwen3.DEFAULT_INCLUDE, "lm_head"]
    own = write_qwen3_draft(tmp_path / "own", dflash_of(TINY, draft_vocab_size=512,
                                                       has_own_lm_head=True))  # fmt: skip
    out = tmp_path / "own-nvfp4"
    cli_ok(["quantize", "--model_dir", str(own), "--output_dir", str(out), "--quant_format",
            "nvfp4", "--include_layers", *include])  # fmt: skip
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["targets"] == ["Linear", "lm_head"]
    assert "lm_head.weight_packed" in _tensor_names(out)
    cli_ok(["verify", str(out)])
    plain = write_qwen3_draft(tmp_path / "plain", dflash_of(TINY, draft_vocab_size=512))
    refused = tmp_path / "plain-nvfp4"
    error = cli_error(["quantize", "--model_dir", str(plain), "--output_dir", str(refused),
                       "--quant_format", "nvfp4", "--include_layers", *include])  # fmt: skip
    assert "lm_head: vLLM cannot serve it quantized" in error and "has_own_lm_head" in error
    assert not refused.exists()


# --- the other commands that read a draft -------------------------------------------------------


def test_inspect_eval_drift_and_card_read_the_dflash_draft(draft, tmp_path):
    kinds = json.loads(cli_ok(["inspect", str(draft), "--json", "-"]).output)["kinds"]
    assert "fc.weight" in {k["kind"] for k in kinds}
    assert not any(k["kind"].startswith(HEADS) for k in kinds)
    results = tmp_path / "r.json"
    cli_ok(["eval-drift", "--model", str(draft), "--regime", "gauss", "--blocks", "8",
            "--formats", "bf16,nvfp4", "--json", str(results)])  # fmt: skip
    data = json.loads(results.read_text())
    assert data["model"]["architecture"] == DFLASH
    metrics = data["regimes"]["gauss"]["variants"]["nvfp4"]["metrics"]
    assert len(metrics["greedy_agree"]) == 7 and metrics["confidence_r"] is None
    card = tmp_path / "card" / "CARD.md"
    card.parent.mkdir()
    cli_ok(["card", str(results), "--output", str(card)])
    assert card.read_text()
