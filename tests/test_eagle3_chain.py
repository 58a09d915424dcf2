"""An EAGLE-3 draft through the whole chain a card author runs (examples/eagle3_end_to_end.sh
runs it on the trained draft): synth --preset eagle3-tiny, quantize, verify, eval-drift in
every regime with --acceptance, speculate against a transformers target, card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_ok

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def make_target(draft: Path, directory: Path) -> Path:
    """A tiny transformers Qwen3 target the eagle3-tiny draft fits: its width, vocabulary,
    tokenizer and the depth its config names, random weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = json.loads((draft / "config.json").read_text())
    config = Qwen3Config(
        vocab_size=c["vocab_size"], hidden_size=c["target_hidden_size"], intermediate_size=96,
        num_hidden_layers=c["target_num_hidden_layers"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(draft / name, directory / name)
    return directory


def test_an_eagle3_draft_goes_from_synth_to_the_card(tmp_path):
    draft, fp8, nvfp4 = tmp_path / "draft", tmp_path / "draft-fp8", tmp_path / "draft-nvfp4"
    cli_ok(["synth", "--preset", "eagle3-tiny", "--output_dir", str(draft), "--seed", "0"])
    target = make_target(draft, tmp_path / "target")
    for fmt, out in (("fp8", fp8), ("nvfp4", nvfp4)):
        cli_ok(["quantize", "--model_dir", str(draft), "--output_dir", str(out),
                "--quant_format", fmt])  # fmt: skip
        assert "vLLM rules Eagle3LlamaForCausalLM" in cli_ok(["verify", str(out)]).output
    results, spec = tmp_path / "results.json", tmp_path / "spec.json"
    cli_ok(["eval-drift", "--model", str(draft), "--variant", f"shipped-fp8={fp8}",
            "--formats", "bf16,fp8,nvfp4", "--regime", "all", "--blocks", "16", "--seed", "0",
            "--acceptance", "--json", str(results)])  # fmt: skip
    cli_ok(["speculate", "--target", str(target), "--model", str(draft), "--variant",
            f"shipped-fp8={fp8}", "--formats", "bf16,nvfp4", "--prompts", "1",
            "--new-tokens", "8", "--json", str(spec)])  # fmt: skip
    card = tmp_path / "CARD.json"
    cli_ok(["card", str(results), "--speculate", str(spec), "--checkpoint", str(fp8),
            "--checkpoint", str(nvfp4), "--base", str(draft), "--format", "json",
            "--no-figures", "--output", str(card)])  # fmt: skip
    assert sorted(json.loads(results.read_text())["regimes"]) == ["boot", "gauss", "heavy"]
    sections = {s["title"]: s for s in json.loads(card.read_text())["sections"]}
    measured = sections["Acceptance with the target in the loop (measured)"]
    assert "(1..4)" in measured["text"][0]  # k = 3 drafted tokens, plus the bonus
    rows = {r["variant"]: r for r in measured["tables"][0]["rows"]}
    speculated = json.loads(spec.read_text())["variants"]
    assert sorted(rows) == sorted(speculated) == ["bf16", "nvfp4", "shipped-fp8"]
    for name, row in rows.items():
        summary = speculated[name]["summary"]
        assert row["tokens per verification"] == summary["mean_acceptance_length"], name
