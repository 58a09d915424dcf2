"""Loading the Hugging Face target that speculate and capture run (qstream/capture/target.py)
and decoding with it: a target or draft with NaN or Inf, a checkpoint whose tensors do not fit
its config, a target without its tokenizer, more prompts than the corpus holds, more positions
than the target has, a seed torch cannot take — each is one ``Error:`` line (or a usage error)
naming what, never a traceback, a silent fill-in or a result (docs/guarantees.md).  The
defaults suit the machine (float32 on a CPU) and transformers' own loading chatter stays out of
the output.  A tiny transformers Qwen3 target and a draft synthesized for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from click.testing import CliRunner
from hf_targets import make_qwen3_target
from safetensors.torch import load_file, save_file

from qstream.cli import SEED_MAX, cli
from qstream.serving import REFERENCE_VARIANT

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
WEIGHTS = "model.safetensors"


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft, a one-document corpus), read-only: tests corrupt copies."""
    root = tmp_path_factory.mktemp("pair")
    target = make_qwen3_target(root / "target")
    draft = root / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(draft)])
    corpus = root / "one.jsonl"
    corpus.write_text(json.dumps({"question": QUESTION, "answer": "7\n#### 7"}) + "\n")
    return target, draft, corpus


def _speculate(pair, target=None, draft=None, *extra: str) -> list[str]:
    t, d, corpus = pair
    return ["speculate", "--target", str(target or t), "--model", str(draft or d),
            "--corpus", str(corpus), "--prompts", "1", "--new-tokens", "4", "--formats", "bf16",
            *extra]  # fmt: skip


def _capture(pair, out: Path, target=None, *extra: str) -> list[str]:
    t, d, corpus = pair
    return ["capture", "--target", str(target or t), "--model", str(d), "--output", str(out),
            "--corpus", str(corpus), "--streams", "1", "--max-tokens", "12", *extra]  # fmt: skip


def _copy(source: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(source, tmp_path / name))


def _edit(directory: Path, edit) -> None:
    """``edit(tensors)`` applied to the directory's model.safetensors, rewritten in place."""
    tensors = load_file(directory / WEIGHTS)
    edit(tensors)
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})


def _poke(name: str, value: float):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value

    return edit


def test_a_non_finite_target_weight_is_refused_naming_it(pair, tmp_path):
    for name, value in (("model.layers.2.mlp.down_proj.weight", float("nan")),
                        ("model.norm.weight", float("inf"))):  # fmt: skip
        target = _copy(pair[0], tmp_path, name)
        _edit(target, _poke(name, value))
        error = cli_error(_speculate(pair, target, None, "--dtype", "float32"))
        assert name in error and "NaN or Inf" in error and str(target) in error
        assert name in cli_error(_capture(pair, tmp_path / "out", target))
        assert not (tmp_path / "out").exists()


def test_non_finite_target_states_stop_the_decode_naming_the_position(pair, tmp_path):
    """Finite weights whose float16 activations overflow: the decode stops at the first
    position whose hidden states or logits are not finite."""
    target = _copy(pair[0], tmp_path)
    mlp = "model.layers.0.mlp"
    _edit(target, lambda t: t.update({f"{mlp}.{n}_proj.weight": t[f"{mlp}.{n}_proj.weight"] * 1e3
                                      for n in ("gate", "up")}))  # fmt: skip
    error = cli_error(_speculate(pair, target, None, "--dtype", "float16"))
    assert "prompt 0: the target's hidden states at position 0 are not finite" in error
    # capture writes no such states: eval-drift would refuse them only on reading
    error = cli_error(_capture(pair, tmp_path / "out", target, "--dtype", "float16"))
    assert "stream 0: the target's" in error and "not finite" in error, error
    assert not list((tmp_path / "out").glob("stream-*")), "no stream file written"


def test_the_decode_names_the_first_non_finite_logit(pair):
    """The check runs at every verification, not only at the prefill: a NaN the final norm
    gives at the second position of the first verification is named by its position."""
    from qstream.arch.registry import architecture_of, load_config
    from qstream.capture.target import load_target
    from qstream.errors import QStreamError
    from qstream.speculate.decode import speculative_decode

    target = load_target(pair[0], torch.float32).model
    config = load_config(pair[1])
    arch = architecture_of(config)
    draft = arch.build(
        config, arch.load_weights(pair[1], pair[0], config), REFERENCE_VARIANT, "cpu"
    )
    calls = []

    def poison(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            output[:, 1] = float("nan")

    prompt = [5, 6, 7, 8]
    handle = target.model.norm.register_forward_hook(poison)
    try:
        with pytest.raises(QStreamError, match=rf"logits at position {len(prompt) + 1} "):
            speculative_decode(target, draft, prompt, 8)
    finally:
        handle.remove()


def test_missing_unexpected_and_misshapen_tensors_are_refused(pair, tmp_path):
    missing = _copy(pair[0], tmp_path, "missing")
    _edit(missing, lambda t: t.pop("model.layers.5.mlp.down_proj.weight"))
    error = cli_error(_speculate(pair, missing, None, "--dtype", "float32"))
    assert "model.layers.5.mlp.down_proj.weight" in error and WEIGHTS in error
    assert "missing" in error
    extra = _copy(pair[0], tmp_path, "extra")
    _edit(extra, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}))
    error = cli_error(_capture(pair, tmp_path / "out", extra))
    assert "model.layers.0.mlp.extra.weight" in error and WEIGHTS in error
    shape = _copy(pair[0], tmp_path, "shape")
    name = "model.layers.1.self_attn.q_proj.weight"
    _edit(shape, lambda t: t.update({name: t[name][:40].clone()}))
    error = cli_error(_speculate(pair, shape))
    assert name in error and "(40, 64)" in error and "(64, 64)" in error and WEIGHTS in error
    assert not (tmp_path / "out").exists()


def test_a_non_finite_draft_weight_is_refused_in_every_format(pair, tmp_path):
    draft = _copy(pair[1], tmp_path)
    _edit(draft, _poke("layers.0.mlp.down_proj.weight", float("nan")))
    for formats in ("bf16", "fp32", "nvfp4"):
        error = cli_error(_speculate(pair, None, draft, "--formats", formats))
        assert "layers.0.mlp.down_proj.weight" in error and "NaN or Inf" in error, formats


def test_more_prompts_than_the_corpus_holds_are_refused(pair):
    error = cli_error([*_speculate(pair), "--prompts", "5"])
    assert "--prompts 5" in error and "1 document" in error and str(pair[2]) in error


def test_a_decode_past_the_targets_positions_is_refused(pair, tmp_path):
    """The longest sequence the target reads is the prompt, the new tokens but the last, and one
    draft block: at max_position_embeddings it decodes, one more is refused before decoding
    (with --capture, whose streams run on for a block and a token, two fewer)."""
    from transformers import AutoTokenizer

    from qstream.arch.registry import load_config

    prompt = len(AutoTokenizer.from_pretrained(pair[0])(QUESTION + "\n")["input_ids"])
    block = load_config(pair[1]).block_size
    target = _copy(pair[0], tmp_path)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": prompt + 4 + block - 1})
    )
    cli_ok([*_speculate(pair, target), "--new-tokens", "4"])
    error = cli_error([*_speculate(pair, target), "--new-tokens", "5"])
    assert f"max_position_embeddings {prompt + 4 + block - 1}" in error
    assert f"{prompt + 5 + block - 1} positions" in error
    capture = cli_error([*_speculate(pair, target), "--capture", str(tmp_path / "states")])
    assert f"{prompt + 4 + block + 1} positions" in capture  # its streams run on a block and one
    assert "1100" in cli_error([*_speculate(pair), "--new-tokens", "1100"])


def test_the_largest_seed_decodes_and_one_more_is_a_usage_error(pair, tmp_path):
    assert SEED_MAX == 2**63 - 1
    args = [*_speculate(pair), "--rule", "probabilistic/standard", "--json", "-"]
    results = json.loads(cli_ok([*args, "--seed", str(SEED_MAX)]).stdout)
    assert results["settings"]["seed"] == SEED_MAX
    cli_ok(_capture(pair, tmp_path / "gen", None, "--generate", "--new-tokens", "2",
                    "--seed", str(SEED_MAX)))  # fmt: skip
    for command in (args, _capture(pair, tmp_path / "no", None, "--generate"),
                    ["formats", "--json", "-"]):  # fmt: skip
        result = CliRunner().invoke(cli, [*command, "--seed", str(SEED_MAX + 1)])
        assert result.exit_code == 2 and "--seed" in result.stderr, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "no").exists()


def test_a_target_without_its_tokenizer_is_named(pair, tmp_path):
    target = _copy(pair[0], tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (target / name).unlink()
    error = cli_error(_speculate(pair, target))
    assert "tokenizer.json" in error and str(target) in error and "corpus" not in error
    error = cli_error(_capture(pair, tmp_path / "out", target))
    assert "tokenizer.json" in error and "no document" not in error


def test_transformers_own_loading_output_stays_out(pair, tmp_path):
    """transformers' "Loading weights" bar and load report would interleave with qstream's."""
    for args in (_speculate(pair), _capture(pair, tmp_path / "states")):
        stderr = cli_ok(args).stderr
        assert "Loading weights" not in stderr and "LOAD REPORT" not in stderr, args[0]


def test_on_a_cpu_the_target_defaults_to_float32(pair, tmp_path):
    result = cli_ok([*_speculate(pair), "--json", "-"])
    assert json.loads(result.stdout)["settings"]["target_dtype"] == "float32"
    out = tmp_path / "states"
    cli_ok(_capture(pair, out))
    assert json.loads((out / "capture.json").read_text())["dtype"] == "float32"
    for command in ("speculate", "capture"):
        help_text = " ".join(cli_ok([command, "--help"]).stdout.split())
        assert "float32 on a CPU, bfloat16 on CUDA" in help_text, command


def test_speculate_runs_the_target_on_the_device_asked_for(pair):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: test_the_target_on_cuda_decodes_as_on_the_cpu")
    assert "CUDA is not available" in cli_error([*_speculate(pair), "--device", "cuda"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_target_on_cuda_decodes_as_on_the_cpu(pair):
    args = [*_speculate(pair), "--dtype", "float32", "--new-tokens", "16", "--json", "-"]
    cpu = json.loads(cli_ok(args).stdout)
    cuda = json.loads(cli_ok([*args, "--device", "cuda"]).stdout)
    assert cuda["settings"]["device"] == "cuda" and cuda["runs"] == cpu["runs"]
