"""The K3 draft embeds with the target's embed_tokens, as vLLM 0.32.0 serves it (docs/model.md,
"Whose embed_tokens"): a stored copy that differs is not what drafts, and eval-drift says so once
and records by how much (speculate too)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_ok
from hf_targets import make_target
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_mla import QUANTIZE_INCLUDE, load_weights
from qstream.arch.dspark_mla.model import load_model
from qstream.arch.interface import EMBED
from qstream.checkpoint.read import read_target_tensors
from qstream.eval.variants import foreign_tensors
from qstream.quant.quantize import quantize_checkpoint


@pytest.fixture(scope="module")
def moved(tiny, tmp_path_factory) -> tuple[Path, float]:
    """A copy of tiny whose stored embed_tokens moved off target_head's; the max |diff|."""
    draft = tmp_path_factory.mktemp("moved") / "draft"
    shutil.copytree(tiny, draft)
    tensors = load_file(draft / "model.safetensors")
    stored = tensors[EMBED]
    gen = torch.Generator().manual_seed(0)
    tensors[EMBED] = (stored.float() + torch.randn(stored.shape, generator=gen)).to(stored.dtype)
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    diff = float((tensors[EMBED].float() - stored.float()).abs().max())
    assert diff > 0
    return draft, diff


def _lent(draft: Path) -> torch.Tensor:
    return read_target_tensors(draft / "target_head", [EMBED])[EMBED]


def test_synth_stores_the_embedding_its_target_head_lends(tiny):
    stored = load_file(Path(tiny) / "model.safetensors")[EMBED]
    lent = _lent(Path(tiny))
    assert stored.dtype == lent.dtype and torch.equal(stored, lent)
    noted: list[dict] = []
    load_weights(tiny, noted=noted.append)
    assert noted == []


def test_the_forward_embeds_with_the_targets_not_the_stored_copy(tiny, moved):
    draft, diff = moved
    noted: list[dict] = []
    weights = load_weights(draft, noted=noted.append)
    assert torch.equal(weights[EMBED], _lent(draft))
    assert noted == [{"target": str(draft / "target_head"), "max_abs_diff": diff}]
    # tiny's stored copy is the target's: the moved draft computes exactly what tiny computes
    ids = torch.tensor([[5, 17, 40, 3, 99, 12, 7, 64, 21, 8, 30, 2]])
    ours, theirs = load_model(draft), load_model(tiny)
    hidden = ours.causal_hidden(ids)
    assert torch.equal(hidden, theirs.causal_hidden(ids))
    lengths = torch.tensor([ids.shape[1]])
    stream, anchor = torch.tensor([0, 0]), torch.tensor([2, 4])
    blocks = [m.draft(m.context(hidden.flatten(2), lengths), stream, anchor, ids[0, anchor])
              for m in (ours, theirs)]  # fmt: skip
    assert torch.equal(blocks[0].logits_base, blocks[1].logits_base)


def test_a_stored_copy_serves_a_target_that_lends_none(tiny, moved, tmp_path):
    draft, _ = moved
    head = tmp_path / "head"
    head.mkdir()
    lm_head = read_target_tensors(draft / "target_head", ["lm_head.weight"])
    save_file(lm_head, head / "model.safetensors")
    noted: list[dict] = []
    weights = load_weights(draft, target=head, noted=noted.append)
    assert torch.equal(weights[EMBED], load_file(draft / "model.safetensors")[EMBED])
    assert noted == []


def test_eval_drift_notes_it_once_and_records_it(moved, tmp_path):
    draft, diff = moved
    out = tmp_path / "r.json"
    run = cli_ok(["eval-drift", "--model", str(draft), "--formats", "bf16,fp8", "--regime",
                  "gauss", "--blocks", "4", "--json", str(out)])  # fmt: skip
    assert run.stderr.count("embed_tokens differ") == 1, run.stderr
    assert f"max |diff| {diff:.6g}" in run.stderr
    recorded = json.loads(out.read_text())["model"]["embed_tokens"]
    assert recorded == {"target": str(draft / "target_head"), "max_abs_diff": diff}


def test_a_quantized_copy_is_derived_though_its_stored_embedding_is_not_served(moved, tmp_path):
    """vLLM never reads a K3 checkpoint's stored embed_tokens: the derived-from check skips it."""
    draft, _ = moved
    quantize_checkpoint(draft, tmp_path / "fp8", "fp8", include=list(QUANTIZE_INCLUDE))
    assert foreign_tensors(tmp_path / "fp8", load_weights(draft)) == []


def test_speculate_notes_a_float32_targets_embedding_and_records_it(tmp_path):
    """synth --target stores a float32 target's embedding in bf16; the draft embeds with the
    target's float32 values, and speculate says so once and records by how much they differ."""
    target = make_target(tmp_path / "target", "llama")
    draft = tmp_path / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(draft)])
    corpus = tmp_path / "one.jsonl"
    corpus.write_text(json.dumps({"question": "Tom has 3 apples.", "answer": "3\n#### 3"}) + "\n")
    run = cli_ok(["speculate", "--target", str(target), "--model", str(draft), "--corpus",
                  str(corpus), "--prompts", "1", "--new-tokens", "2", "--formats", "bf16",
                  "--json", "-"])  # fmt: skip
    stored = load_file(draft / "model.safetensors")[EMBED].float()
    diff = float((stored - read_target_tensors(target, [EMBED])[EMBED].float()).abs().max())
    assert diff > 0 and run.stderr.count("embed_tokens differ") == 1, run.stderr
    recorded = json.loads(run.stdout)["provenance"]["draft"]["embed_tokens"]
    assert recorded == {"target": str(target), "max_abs_diff": diff}
