"""The trained pair shipped in examples/gsm8k-pair/ (docs/calibration.md): its files are the
ones evals/train_pair.py recorded, qstream reads the draft in speculators' layout as the
Qwen3-style DSpark draft it is, and speculative decoding with the real target in the loop emits
exactly the target's own greedy decoding while the draft's blocks are accepted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from qstream.arch.registry import architecture_of, load_config
from qstream.capture.run import corpus_docs
from qstream.capture.target import load_target
from qstream.serving import FLOOR_VARIANT
from qstream.speculate.decode import speculative_decode, target_greedy

PAIR = Path(__file__).resolve().parents[1] / "examples" / "gsm8k-pair"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_the_shipped_weights_are_the_recorded_ones():
    record = json.loads((PAIR / "train.json").read_text())
    assert sorted(record["sha256"]) == ["draft/model.safetensors", "target/model.safetensors"]
    for name, digest in record["sha256"].items():
        assert hashlib.sha256((PAIR / name).read_bytes()).hexdigest() == digest, name
    size = sum(p.stat().st_size for p in PAIR.rglob("*") if p.is_file())
    assert size < 25 * 2**20


def test_the_draft_reads_as_speculators_wrote_it():
    config = load_config(PAIR / "draft")
    assert type(config).__name__ == "Qwen3DSparkConfig"
    assert (config.block_size, len(config.target_layer_ids)) == (7, 5)
    assert config.target_layer_ids == (0, 1, 2, 3, 4)  # speculators' ids 1..5, minus one
    assert not getattr(config, "reduced_vocab", False)


@pytest.fixture(scope="module")
def decoded():
    config = load_config(PAIR / "draft")
    arch = architecture_of(config)
    weights = arch.load_weights(PAIR / "draft", PAIR / "target", config)
    draft = arch.build(config, weights, FLOOR_VARIANT)
    target = load_target(PAIR / "target", torch.float32)
    texts = corpus_docs(None).texts[:2]
    prompts = [target.tokenizer(t.partition("\n")[0] + "\n")["input_ids"] for t in texts]
    runs = [speculative_decode(target.model, draft, p, 48) for p in prompts]
    return target, prompts, runs


def test_greedy_verification_is_the_targets_greedy_decoding(decoded):
    target, prompts, runs = decoded
    for prompt, run in zip(prompts, runs):
        assert run.tokens == target_greedy(target.model, prompt, 48)


def test_the_trained_draft_is_accepted(decoded):
    _, _, runs = decoded
    accepted = [a for r in runs for a in r.accepted]
    # an untrained draft is almost never accepted (1.0 tokens per verification); this one is
    assert 1 + sum(accepted) / len(accepted) > 2.0


def test_the_boot_regime_runs_the_two_layer_draft_for_five_aux_layers(tmp_path):
    """The shipped draft has 2 layers and reads 5 target layers: the boot regime runs its
    stack again on its own output (steps 0, 1, 0, 1, 0), so its reference aux states carry
    the real token stream's correlation and a bf16 variant stays close to it."""
    from cli_helpers import cli_ok

    out = tmp_path / "boot.json"
    cli_ok(["eval-drift", "--model", str(PAIR / "draft"), "--target", str(PAIR / "target"),
            "--tokenizer", str(PAIR / "target" / "tokenizer.json"), "--regime", "boot",
            "--formats", "bf16", "--blocks", "32", "--json", str(out)])  # fmt: skip
    metrics = json.loads(out.read_text())["regimes"]["boot"]["variants"]["bf16"]["metrics"]
    assert metrics["greedy_agree_overall"]["value"] > 0.9
