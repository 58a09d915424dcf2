"""The target served quantized (docs/capture.md and docs/speculate.md, "A quantized target"):
its decoder linears hold qstream's quantize-dequantize of the stored weights bit for bit and
nothing else changes; ``capture --target-format`` captures other states and records the format,
which eval-drift reports and checks a variant's ``target=`` against; ``speculate`` decodes a
``target=`` variant against that target; bad input is one line and writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from click.testing import CliRunner
from hf_targets import make_qwen3_target, make_target
from safetensors.torch import load_file, save_file
from test_cli_speculate import QUESTIONS, _shared_direction

from qstream.capture.run import CaptureSettings, run_capture
from qstream.capture.target import load_target
from qstream.capture.target_format import simulate_target
from qstream.cli import cli
from qstream.errors import QStreamError
from qstream.formats import dequantize, quantize
from qstream.formats.nvfp4 import tensor_amax
from qstream.speculate.decode import target_greedy

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# The projections vLLM fuses, written out here rather than taken from qstream.vllm.profiles:
# under NVFP4 each group's members share the group's largest amax (one global scale).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))  # fmt: skip
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "deepseek_v3", "llama-bf16"])
def tiny(request, tmp_path_factory):
    """A tiny target; ``llama-bf16`` stores its weights in bf16 (loaded in fp32 below, so the
    format math must run on the stored bf16 weights, not on the loaded fp32 copy)."""
    family, _, stored = request.param.partition("-")
    target = make_target(tmp_path_factory.mktemp(request.param) / "target", family)
    if stored:
        path = target / "model.safetensors"
        tensors = {n: t.to(torch.bfloat16) for n, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return target


def _expected(stored: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """qstream's format math on each stored decoder Linear weight, fused NVFP4 amaxes shared."""
    amax = {}
    if fmt == "nvfp4":
        for name in stored:
            parent, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            group = next((g for g in FUSED if leaf in g), (leaf,))
            members = [f"{parent}.{m}.weight" for m in group if f"{parent}.{m}.weight" in stored]
            amax[name] = max((tensor_amax(stored[m]) for m in members), key=float)
    return {
        name: dequantize(fmt, quantize(fmt, w, name, amax.get(name)), dtype=w.dtype)
        for name, w in stored.items()
    }


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_decoder_linears_are_the_formats_math_of_the_stored_weights(tiny, fmt):
    stored = load_file(tiny / "model.safetensors")
    model = load_target(tiny, torch.float32).model
    linears = {f"{n}.weight" for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")}  # fmt: skip
    before = {n: t.clone() for n, t in model.state_dict().items()}
    changed = simulate_target(model, tiny, fmt)
    assert {f"{m}.weight" for m in changed} == linears and "lm_head.weight" not in linears
    want = _expected({n: stored[n] for n in linears}, fmt)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want.get(name, before[name]).to(tensor.dtype)), name
    assert all(not torch.equal(want[n], stored[n]) for n in linears), "the format changes each"


def test_a_weight_the_format_cannot_hold_is_one_line_naming_it(tmp_path):
    """MXFP4 blocks of 32 along K: the tiny DeepSeek-V3's kv_b_proj has K = kv_lora_rank = 16."""
    target = make_target(tmp_path / "ds", "deepseek_v3")
    model = load_target(target, torch.float32).model
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(
        QStreamError,
        match=r"^--target-format mxfp4: .*: model.layers.0.self_attn.kv_b_proj.weight: shape \(128, 16\) has K=16",
    ):
        simulate_target(model, target, "mxfp4")
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items()), "untouched"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_non_finite_weight_is_one_line_naming_it_and_changes_nothing(tmp_path, fmt):
    """simulate_target reads the stored weights itself (load_target refuses a non-finite one
    when it loads the model; here the file changes after that)."""
    target = make_target(tmp_path / "t", "llama")
    model = load_target(target, torch.float32).model
    path = target / "model.safetensors"
    tensors = load_file(path)
    bad = max(n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight"))
    tensors[bad][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(
        QStreamError, match=rf"^--target-format {fmt}: .*: {bad}: weight contains NaN or Inf"
    ):
        simulate_target(model, target, fmt)
    for n, t in model.state_dict().items():
        torch.testing.assert_close(t, before[n], rtol=0, atol=0, equal_nan=True)


def _capture_args(target, draft, out, corpus, *extra):
    return ["capture", "--target", str(target), "--model", str(draft), "--output", str(out),
            "--corpus", str(corpus), "--dtype", "float32", "--streams", "2",
            "--max-tokens", "24", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(Qwen3 target, a DSpark draft made for it by ``synth --target``, questions)."""
    root = tmp_path_factory.mktemp("pair")
    target = make_qwen3_target(root / "target")
    _shared_direction(target)
    draft = root / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(draft)])
    corpus = root / "questions.jsonl"
    rows = [{"question": q, "answer": "It is done.\n#### 0"} for q in QUESTIONS]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, draft, corpus


def test_capture_with_a_target_format_captures_its_states_and_records_it(pair, tmp_path):
    target, draft, corpus = pair
    plain, served = tmp_path / "plain", tmp_path / "nvfp4"
    cli_ok(_capture_args(target, draft, plain, corpus))
    cli_ok(_capture_args(target, draft, served, corpus, "--target-format", "nvfp4"))
    record = json.loads((served / "capture.json").read_text())
    assert record["target"]["format"] == "nvfp4"
    assert "format" not in json.loads((plain / "capture.json").read_text())["target"]
    a, b = (load_file(d / "stream-000000.safetensors") for d in (plain, served))
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["aux_hidden_states"], b["aux_hidden_states"])
    resumed = cli_error(_capture_args(target, draft, served, corpus, "--target-format", "fp8"))
    assert "was captured with target = " in resumed and '"format": "nvfp4"' in resumed
    # eval-drift reports the states' target and takes target= only as the states were captured
    drift = tmp_path / "drift.json"
    args = ["eval-drift", "--model", str(draft), "--target", str(target), "--states", str(served),
            "--blocks", "8"]  # fmt: skip
    cli_ok([*args, "--formats", "bf16,bf16+target=nvfp4", "--json", str(drift)])
    results = json.loads(drift.read_text())
    assert results["states"]["manifest"]["target"]["format"] == "nvfp4"
    assert "bf16+target=nvfp4" in results["regimes"]["states"]["variants"]
    refused = cli_error([*args, "--formats", "bf16+target=fp8", "--json", str(tmp_path / "x")])
    assert "target=fp8, but --states" in refused and "the nvfp4 target" in refused
    synthetic = cli_error(["eval-drift", "--model", str(draft), "--regime", "gauss",
                           "--formats", "bf16+target=nvfp4", "--json", str(tmp_path / "y")])  # fmt: skip
    assert "capture --target-format nvfp4" in synthetic and "speculate" in synthetic
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_bad_target_format_writes_nothing(pair, tmp_path):
    target, draft, corpus = pair
    out = tmp_path / "out"
    with pytest.raises(QStreamError, match=r"^--target-format 'int4': choose one of unquantized"):
        run_capture(CaptureSettings(str(target), str(draft), str(out), target_format="int4"))
    # on the command line it is click's choice, refused as every choice is (exit 2)
    result = CliRunner().invoke(
        cli, _capture_args(target, draft, out, corpus, "--target-format", "int4")
    )
    assert result.exit_code == 2 and "Invalid value for '--target-format'" in result.stderr
    assert not out.exists()


def test_speculate_decodes_each_variant_against_its_own_target(pair, tmp_path):
    target, draft, corpus = pair
    out = tmp_path / "spec.json"
    cli_ok(["speculate", "--target", str(target), "--model", str(draft), "--corpus", str(corpus),
            "--prompts", "3", "--new-tokens", str(NEW_TOKENS), "--dtype", "float32",
            "--formats", "bf16,bf16+target=nvfp4", "--json", str(out)])  # fmt: skip
    results = json.loads(out.read_text())
    variants = results["variants"]
    assert list(variants) == ["bf16", "bf16+target=nvfp4"]
    assert "configuration" not in variants["bf16"]  # recorded when not the default
    assert variants["bf16+target=nvfp4"]["configuration"]["target"] == "nvfp4"
    # greedy verification emits the served target's own greedy decoding, so each variant's
    # tokens are its target's: the NVFP4 one's come from the simulated target
    served = load_target(target, torch.float32)
    simulate_target(served.model, target, "nvfp4")
    for i, question in enumerate(QUESTIONS):
        prompt = served.tokenizer(question + "\n", add_special_tokens=False)["input_ids"]
        greedy = target_greedy(served.model, prompt, NEW_TOKENS)
        assert results["runs"]["bf16+target=nvfp4"][i]["tokens"] == greedy, i
    refused = cli_error(["speculate", "--target", str(target), "--model", str(draft),
                         "--formats", "bf16,bf16+target=fp8", "--capture", str(tmp_path / "c")])  # fmt: skip
    assert "one target= for all variants" in refused and not (tmp_path / "c").exists()
