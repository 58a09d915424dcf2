"""The EAGLE-3 draft trained on the shipped pair's target, examples/gsm8k-pair/eagle3/
(docs/eagle3.md, "A trained EAGLE-3 draft"): its files are the ones
evals/train_eagle3_pair.py recorded, qstream reads speculators' layout as the Qwen3-form
EAGLE-3 draft it is, and greedy speculative decoding with the real target in the loop emits
exactly the target's own greedy continuation while the draft's chains are accepted."""

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
DRAFT = PAIR / "eagle3"
NEW_TOKENS = 24

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_the_shipped_files_are_the_recorded_ones():
    record = json.loads((DRAFT / "train.json").read_text())
    assert sorted(record["sha256"]) == ["config.json", "model.safetensors"]
    for name, digest in record["sha256"].items():
        assert hashlib.sha256((DRAFT / name).read_bytes()).hexdigest() == digest, name
    assert sum(p.stat().st_size for p in DRAFT.iterdir()) < 10 * 2**20  # the budget


def test_the_draft_reads_as_speculators_wrote_it():
    config = load_config(DRAFT)
    assert type(config).__name__ == "Eagle3Config" and config.model_type == "qwen3"
    assert config.block_size == 3  # speculators' ttt_steps, its speculative_tokens
    assert config.target_layer_ids == (0, 2, 4)  # speculators' ids 1, 3, 5, minus one
    assert config.norm_before_residual and config.draft_vocab_size == config.vocab_size


@pytest.fixture(scope="module")
def decoded():
    config = load_config(DRAFT)
    arch = architecture_of(config)
    draft = arch.build(config, arch.load_weights(DRAFT, PAIR / "target", config), FLOOR_VARIANT)
    target = load_target(PAIR / "target", torch.float32)
    texts = corpus_docs(None).texts[:2]
    prompts = [target.tokenizer(t.partition("\n")[0] + "\n")["input_ids"] for t in texts]
    runs = [speculative_decode(target.model, draft, p, NEW_TOKENS) for p in prompts]
    return target, prompts, runs


def test_greedy_verification_is_the_targets_greedy_decoding(decoded):
    target, prompts, runs = decoded
    for prompt, run in zip(prompts, runs):
        assert run.tokens == target_greedy(target.model, prompt, NEW_TOKENS)


def test_the_trained_draft_is_accepted(decoded):
    _, _, runs = decoded
    accepted = [a for r in runs for a in r.accepted]
    # an untrained draft is almost never accepted (1.0 tokens per verification); this one is
    assert 1 + sum(accepted) / len(accepted) > 1.5
