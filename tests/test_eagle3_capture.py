"""``qstream capture`` for an EAGLE-3 draft (docs/eagle3.md, "Captured states"): vLLM's aux
ids are hidden-states indices (id i, the residual stream entering layer i: transformers'
``output_hidden_states[i]``), so the states written are those the target hands the draft, and
they feed ``eval-drift --states``; calibration stays one ``Error:`` line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from hf_targets import VOCAB, make_qwen3_target
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from qstream.arch.eagle3 import PRESETS, tensor_shapes
from qstream.arch.interface import EMBED, LM_HEAD

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

DEPTH = 8  # the preset's target_num_hidden_layers: its aux ids 2, 4, 6 lie inside the target
# fp32 on CPU: the same model run batched with padding vs alone differs only by summation order
# in matmuls of different shapes (tests/test_capture.py's bound)
PAD_ATOL = 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3 target of DEPTH layers and an eagle3-tiny draft shaped for it, embedding
    and lm_head the target's."""
    tmp = tmp_path_factory.mktemp("pair")
    target = make_qwen3_target(tmp / "target", layers=DEPTH)
    config = replace(PRESETS["eagle3-tiny"], vocab_size=VOCAB, draft_vocab_size=VOCAB)
    assert config.aux_layer_ids == (2, 4, 6) and config.target_num_hidden_layers == DEPTH
    lent = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) / math.sqrt(s[-1])
               for n, s in tensor_shapes(config).items()}  # fmt: skip
    tensors[EMBED], tensors[LM_HEAD] = lent["model.embed_tokens.weight"], lent["lm_head.weight"]
    draft = tmp / "draft"
    draft.mkdir()
    save_file({k: v.bfloat16().contiguous() for k, v in tensors.items()},
              draft / "model.safetensors")  # fmt: skip
    (draft / "config.json").write_text(json.dumps(config.to_json()))
    return target, draft


@pytest.fixture(scope="module")
def states(pair, tmp_path_factory) -> Path:
    target, draft = pair
    out = tmp_path_factory.mktemp("states") / "s"
    cli_ok(["capture", "--target", str(target), "--model", str(draft), "--output", str(out),
            "--streams", "3", "--max-tokens", "48", "--dtype", "float32"])  # fmt: skip
    return out


def test_capture_writes_the_states_vllm_hands_an_eagle3_draft(pair, states):
    """aux ids 2, 4, 6 (hidden-states indices) are transformers' output_hidden_states[2, 4, 6],
    recorded as layer outputs 1, 3, 5."""
    record = json.loads((states / "capture.json").read_text())
    assert record["layer_convention"] == "layer-output" and record["layer_ids"] == [1, 3, 5]
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    for i in range(3):
        f = load_file(states / f"stream-{i:06d}.safetensors")
        with torch.no_grad():
            hs = model(f["input_ids"][None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[k][0] for k in (2, 4, 6)], dim=-1)
        torch.testing.assert_close(f["aux_hidden_states"], want, rtol=0, atol=PAD_ATOL)


def test_eval_drift_reads_the_captured_states(pair, states, tmp_path):
    out = tmp_path / "r.json"
    formats = ["bf16", "fp8", "bf16+kv=fp8", "bf16+head=fp8"]
    cli_ok(["eval-drift", "--model", str(pair[1]), "--states", str(states), "--target",
            str(pair[0]), "--blocks", "12", "--acceptance", "--formats", ",".join(formats),
            "--json", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    variants = data["regimes"]["states"]["variants"]
    assert list(variants) == formats
    k, emitted = data["block_size"], []
    for entry in variants.values():
        assert math.isfinite(entry["metrics"]["kl"]["mean"]["value"])
        modes = entry["acceptance"]["target"].values()  # verified by the captured target
        emitted += [m["emitted"]["value"] for m in modes if m and "emitted" in m]
    assert emitted and all(1 <= e <= k + 1 for e in emitted), emitted


def test_quantize_calibration_refuses_an_eagle3_draft_in_one_line(pair, tmp_path):
    error = cli_error(["quantize", "--model_dir", str(pair[1]), "--output_dir",
                       str(tmp_path / "q"), "--quant_format", "fp8", "--activations",
                       "fp8-static", "--calibration", "heavy"])  # fmt: skip
    assert "EAGLE-3 draft is not calibrated yet" in error
    assert not (tmp_path / "q").exists()
