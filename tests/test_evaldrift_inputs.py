"""What eval-drift, quantize and verify read, refused in one line when it is wrong and read when
it is right (docs/guarantees.md): a --states-anchors entry that is not an integer; a d2t that
does not map every draft id to its own target id; a speculators config qstream does not know;
and the shipped pair (examples/gsm8k-pair: a speculators-layout draft without a tokenizer or a
target_num_hidden_layers) through capture --export vllm, eval-drift and quantize + verify,
with --target supplying what the draft lacks.  The simulated formats follow the draft
architecture's serving rules through the public call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from qwen3_drafts import REDUCED, TINY, qwen3_tensors, write_qwen3_draft
from safetensors.torch import save_file

from qstream.errors import QStreamError
from qstream.eval.corpus import Corpus, read_anchor_plan

PAIR = Path(__file__).resolve().parents[1] / "examples" / "gsm8k-pair"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.mark.parametrize(
    ("entry", "named"),
    [([0, 5.5], "anchor 5.5"), ([0, True], "anchor true"), ([0.0, 5], "stream 0.0"),
     (["0", 5], 'stream "0"')],
)  # fmt: skip
def test_an_anchor_that_is_not_an_integer_is_refused(tmp_path, entry, named):
    corpus = Corpus("c", "0", (torch.arange(40),))
    path = tmp_path / "anchors.json"
    path.write_text(json.dumps({"blocks": [[0, 3], entry]}))
    with pytest.raises(QStreamError) as refused:
        read_anchor_plan(path, corpus, 7)
    message = str(refused.value)
    assert message.startswith(f"{path}: block 1 ") and f"{named} is not an integer" in message


@pytest.mark.parametrize(
    ("d2t", "message"),
    [
        (torch.full((512,), 5000), "d2t[0] = 5000 maps draft id 0 to target id 5000, outside"),
        (torch.full((512,), -1), "d2t[0] = -1 maps draft id 0 to target id -1, outside"),
        (torch.tensor([0, -1] + [0] * 510), "d2t[1] = -1 maps draft id 1 to target id 0, as "
                                            "d2t[0] = 0"),
        (torch.arange(512).float(), "tensor 'd2t' is float32, expected int64"),
    ],
)  # fmt: skip
def test_a_d2t_that_maps_no_draft_id_to_its_own_target_id_is_refused(tmp_path, d2t, message):
    """quantize refuses the input, verify the output and loading the draft: one check."""
    from qstream.arch.dspark_qwen3 import load_weights
    from qstream.vllm.verify import verify_checkpoint

    draft = write_qwen3_draft(tmp_path / "draft", REDUCED)
    good = tmp_path / "good-fp8"
    cli_ok(["quantize", "--model_dir", str(draft), "--output_dir", str(good),
            "--quant_format", "fp8"])  # fmt: skip
    tensors = {**qwen3_tensors(REDUCED), "d2t": d2t}
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "fp8"
    refused = cli_error(["quantize", "--model_dir", str(draft), "--output_dir", str(out),
                         "--quant_format", "fp8"])  # fmt: skip
    assert refused.startswith(f"Error: {draft}: {message}") and not out.exists()
    with pytest.raises(QStreamError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_weights(draft, None, REDUCED)
    shard = good / "model.safetensors"  # the output with d2t changed after quantize
    from safetensors.torch import load_file

    save_file({**load_file(shard), "d2t": d2t}, shard, metadata={"format": "pt"})
    assert any(p.startswith(message) for p in verify_checkpoint(good).problems)


def test_a_draft_vocabulary_larger_than_the_targets_is_refused(tmp_path):
    draft = write_qwen3_draft(tmp_path / "draft", TINY)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 2048}))
    refused = cli_error(["quantize", "--model_dir", str(draft), "--output_dir",
                         str(tmp_path / "out"), "--quant_format", "fp8"])  # fmt: skip
    assert "draft_vocab_size = 2048 must not exceed the target's vocab_size (1024)" in refused


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"speculators_model_type": "eagle9"},
         "speculators_model_type = 'eagle9' is not a speculators draft qstream knows (known: "
         "'dspark', 'dflash')"),
        ({"transformer_layer_config": None}, "transformer_layer_config = None must be an object"),
    ],
)  # fmt: skip
def test_a_speculators_config_is_named_by_its_own_keys(tmp_path, change, message):
    draft = tmp_path / "draft"
    draft.mkdir()
    config = {**json.loads((PAIR / "draft" / "config.json").read_text()), **change}
    config = {k: v for k, v in config.items() if v is not None}
    (draft / "config.json").write_text(json.dumps(config))
    (draft / "model.safetensors").symlink_to(PAIR / "draft" / "model.safetensors")
    refused = cli_error(["eval-drift", "--model", str(draft), "--target", str(PAIR / "target")])
    assert refused.startswith(f"Error: {draft / 'config.json'}: {message}")
    assert "k3" not in refused.lower()


def test_the_pairs_vllm_export_reads_back_with_the_targets_depth_and_tokenizer(tmp_path):
    """The draft has no tokenizer and no target_num_hidden_layers: --target lends both."""
    states, out = tmp_path / "hs", tmp_path / "r.json"
    cli_ok(["capture", "--target", str(PAIR / "target"), "--model", str(PAIR / "draft"),
            "--output", str(states), "--streams", "2", "--max-tokens", "24",
            "--export", "vllm"])  # fmt: skip
    cli_ok(["eval-drift", "--model", str(PAIR / "draft"), "--target", str(PAIR / "target"),
            "--states", str(states), "--blocks", "4", "--formats", "bf16",
            "--json", str(out)])  # fmt: skip
    results = json.loads(out.read_text())
    assert results["corpus"]["tokenizer"] == str(PAIR / "target" / "tokenizer.json")
    assert results["states"]["layers"]["named_by"][0]["ids"] == [1, 2, 3, 4, 5, 6]


def test_verify_takes_the_targets_layer_count_from_target(tmp_path):
    out = tmp_path / "nvfp4"
    cli_ok(["quantize", "--model_dir", str(PAIR / "draft"), "--output_dir", str(out),
            "--quant_format", "nvfp4"])  # fmt: skip
    refused = cli_error(["verify", str(out)])
    assert "pass the target checkpoint (--target DIR)" in refused
    assert ", L=6" in cli_ok(["verify", str(out), "--target", str(PAIR / "target")]).output
    both = ["verify", str(out), "--target", str(PAIR / "target"), "--target-layers", "6"]
    assert "--target-layers and --target" in cli_error(both)


def test_simulated_nvfp4_shares_one_global_scale_across_q_k_v_of_a_qwen3_draft():
    """vLLM fuses a Qwen3-style layer's q/k/v into one layer with one global scale: the public
    call follows the draft's own architecture, not the K3 draft's rules."""
    from qstream.arch.registry import architecture_of
    from qstream.formats import dequantize, quantize
    from qstream.formats.nvfp4 import tensor_amax
    from qstream.quant.simulate import simulate_format

    weights = qwen3_tensors(TINY)
    arch = architecture_of(TINY)
    simulated = simulate_format(weights, "nvfp4", arch.quantize_include, config=TINY)
    names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    amaxes = [tensor_amax(weights[n]) for n in names]
    assert len({float(a) for a in amaxes}) == 3  # one shared scale differs from each own one
    shared = torch.stack(amaxes).max()
    for name in names:
        stored = quantize("nvfp4", weights[name], name=name, global_amax=shared)
        assert torch.equal(simulated[name], dequantize("nvfp4", stored, dtype=torch.bfloat16))
