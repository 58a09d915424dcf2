"""``qstream synth --target``: a draft shaped for a real Hugging Face target, and the path it
exists for, synth → capture → eval-drift --states, on a tiny DeepSeek-V3 target
(docs/model.md, docs/capture.md)."""

import json

import pytest
import torch
from cli_helpers import cli_ok
from hf_targets import HIDDEN, LAYERS, VOCAB, make_target
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.dspark_mla.model import load_model
from qstream.arch.interface import TARGET_HEAD_DIR
from qstream.synth.target import spread_layer_ids


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("ds") / "target", "deepseek_v3")


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(out)])
    return out


def test_spread_layer_ids_rule():
    assert spread_layer_ids(24, 5) == PRESETS["small"].target_layer_ids
    assert spread_layer_ids(8, 5) == (1, 2, 4, 5, 6)
    assert spread_layer_ids(93, 5) == (1, 24, 46, 69, 91)
    assert spread_layer_ids(4, 5) == (1, 2)  # a shallow target gives fewer ids
    for depth in range(3, 200):
        ids = spread_layer_ids(depth, 5)
        assert len(set(ids)) == len(ids) and 1 <= ids[0] and ids[-1] <= depth - 2


def test_draft_is_shaped_for_the_target(target, draft):
    config = json.loads((draft / "config.json").read_text())
    assert (config["hidden_size"], config["target_hidden_size"]) == (HIDDEN, HIDDEN)
    assert config["vocab_size"] == VOCAB and config["target_num_hidden_layers"] == LAYERS
    assert config["target_layer_ids"] == list(spread_layer_ids(LAYERS, 5))
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    assert not (draft / TARGET_HEAD_DIR).exists()
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    embed = load_file(draft / "model.safetensors")["embed_tokens.weight"]
    want = reference.model.embed_tokens.weight.detach().to(torch.bfloat16)
    assert torch.equal(embed, want)
    model = load_model(draft, target=target)
    assert torch.equal(model.w["lm_head.weight"].float(), reference.lm_head.weight.detach())


def _eval(draft, target, states, out) -> dict:
    cli_ok(["eval-drift", "--model", str(draft), "--target", str(target), "--states", str(states),
         "--formats", "bf16,nvfp4", "--blocks", "32", "--acceptance", "--json", str(out)])  # fmt: skip
    return json.loads(out.read_text())


def test_capture_then_eval_drift_on_the_captured_states(target, draft, tmp_path):
    """The capture directory, its --export vllm twin and the same streams merged into qstream's
    one-file layout give identical results: capture's writers and eval-drift's readers were
    written separately (each from the layout's source), so this checks one against the other."""
    common = ["--target", str(target), "--model", str(draft), "--dtype", "float32",
              "--streams", "4", "--max-tokens", "64"]  # fmt: skip
    cli_ok(["capture", *common, "--output", str(tmp_path / "states")])
    cli_ok(["capture", *common, "--output", str(tmp_path / "hs"), "--export", "vllm"])
    merged = {}
    for i, path in enumerate(sorted((tmp_path / "states").glob("stream-*.safetensors"))):
        merged.update({f"stream.{i}.{k}": v for k, v in load_file(path).items()})
    save_file(merged, tmp_path / "merged.safetensors")
    runs = {
        name: _eval(draft, target, tmp_path / name, tmp_path / f"{name}.json")
        for name in ("states", "hs", "merged.safetensors")
    }
    assert runs["states"]["states"]["streams"] == 4
    assert runs["hs"]["states"]["format"] == "vllm"
    assert runs["states"]["regimes"] == runs["merged.safetensors"]["regimes"]
    assert runs["hs"]["regimes"] == runs["states"]["regimes"]
