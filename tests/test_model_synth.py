"""qstream synth checkpoints and strict loading: determinism, tokenizer, calibration, the
strict checks, the borrowed target head, and quantized checkpoints read back."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_mla import QUANTIZE_INCLUDE, load_config, load_weights
from qstream.arch.dspark_mla.model import load_model
from qstream.arch.markov import teacher_forced
from qstream.checkpoint.inspect import checkpoint_stats, weight_stats
from qstream.checkpoint.read import read_target_tensors
from qstream.cli import cli
from qstream.errors import QStreamError
from qstream.eval.corpus import builtin_corpus_docs
from qstream.quant.quantize import quantize_checkpoint
from qstream.quant.simulate import simulate_format
from qstream.synth.draft import synth_checkpoint

# The GSM8K train split (MIT licence) beside the checkout as ../shared/data/gsm8k; only the test
# split ships inside the package, so a clone with nothing beside it skips what needs train.
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
needs_gsm8k_train = pytest.mark.skipif(
    not (GSM8K / "train.jsonl").is_file(),
    reason=f"needs the GSM8K train split at {GSM8K}/train.jsonl (not shipped with qstream)",
)
TOP1_BAND = (0.4, 0.8)  # the required band for the draft's mean top-1 probability


@pytest.fixture(scope="module")
def tiny(tiny):
    """conftest's session draft (synth tiny, seed 0), as a Path."""
    return Path(tiny)


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_synth_is_deterministic_and_complete(tiny, tmp_path):
    again = tmp_path / "again"
    synth_checkpoint("tiny", again, seed=0)
    assert _digest(again) == _digest(tiny)
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "target_head/config.json",
        "target_head/model.safetensors.index.json",
        "target_head/model-00001-of-00001.safetensors",
    } <= set(_digest(tiny))
    other = tmp_path / "other"
    synth_checkpoint("tiny", other, seed=1)
    assert _digest(other)["model.safetensors"] != _digest(tiny)["model.safetensors"]


def test_tokenizer_loads_with_transformers_offline(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    config = json.loads((tiny / "config.json").read_text())
    assert len(tok) == config["vocab_size"]
    assert tok.mask_token_id == config["mask_token_id"]
    text = "Ava has 12 apples. 12 + 30 = <<12+30=42>>42\n#### 42"
    assert tok.decode(tok(text)["input_ids"]) == text


@needs_gsm8k_train
def test_mean_top1_on_gsm8k_is_calibrated(tmp_path):
    out = tmp_path / "gsm"
    synth_checkpoint("tiny", out, seed=0, corpus=GSM8K / "train.jsonl")
    model = load_model(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.encode(doc).ids for doc in builtin_corpus_docs()[:48]]  # the shipped test split
    lengths = torch.tensor([len(i) for i in ids])
    pad = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
    for s, seq in enumerate(ids):
        pad[s, : len(seq)] = torch.tensor(seq)
    gen = torch.Generator().manual_seed(0)
    stream = torch.arange(384) % len(ids)
    anchor = (torch.rand(384, generator=gen) * (lengths[stream] - 8)).long()
    B = model.config.block_size
    truth = torch.stack([pad[stream, anchor + k + 1] for k in range(B)], 1)
    aux_by_regime = {
        "boot": model.causal_hidden(pad).flatten(2),
        "gauss": torch.randn(*pad.shape, model.config.aux_size, generator=gen),
    }
    for regime, aux in aux_by_regime.items():
        blocks = model.draft(model.context(aux, lengths), stream, anchor, pad[stream, anchor])
        top1 = torch.softmax(teacher_forced(model, blocks, truth).logits, -1).amax(-1).mean()
        assert TOP1_BAND[0] <= top1 <= TOP1_BAND[1], f"{regime}: mean top-1 {top1:.3f}"


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("layers.2.mlp.up_proj.weight"),
            r"missing tensor 'layers\.2\.mlp\.up_proj",
        ),
        (
            lambda t: t.update({"layers.9.extra.weight": torch.zeros(2)}),
            r"unexpected tensor 'layers\.9",
        ),
        (
            lambda t: t.update(
                {
                    "layers.0.self_attn.o_proj.weight": t[
                        "layers.0.self_attn.o_proj.weight"
                    ].T.contiguous()
                }
            ),
            r"'layers\.0\.self_attn\.o_proj\.weight' has shape \[32, 64\], expected \[64, 32\]",
        ),
    ],
)
def test_strict_loading_names_the_offender(tiny, tmp_path, edit, message):
    bad = _rewrite(tiny, tmp_path / "bad", edit)
    with pytest.raises(QStreamError, match=message):
        load_weights(bad)


def test_bad_config_names_key_and_value(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    config = json.loads((bad / "config.json").read_text())
    config["target_layer_ids"] = [0, 2, 99]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(QStreamError, match=r"config\.json: target_layer_ids = \[0, 2, 99\]"):
        load_model(bad)


def test_target_supplies_lm_head_and_embedding_through_its_index(tiny, tmp_path):
    weights = load_weights(tiny)
    draft = _rewrite(tiny, tmp_path / "draft", lambda t: t.pop("embed_tokens.weight"))
    shutil.rmtree(draft / "target_head")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    save_file(
        {
            "lm_head.weight": weights["lm_head.weight"].bfloat16(),
            "model.embed_tokens.weight": weights["embed_tokens.weight"],
        },
        target / "head.safetensors",
    )
    index = {
        "weight_map": {
            "lm_head.weight": "head.safetensors",
            "model.embed_tokens.weight": "head.safetensors",
            "model.layers.0.mlp.up_proj.weight": "absent-shard.safetensors",
        }
    }
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QStreamError, match="--target"):
        load_weights(draft)
    borrowed = load_weights(draft, target=target)  # never opens absent-shard.safetensors
    for name in ("lm_head.weight", "embed_tokens.weight"):
        assert torch.equal(borrowed[name], weights[name])
    with pytest.raises(QStreamError, match="exactly one tensor named 'final_norm.weight'"):
        read_target_tensors(target, ["final_norm.weight"])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_quantized_checkpoint_loads_as_in_memory_quantization(tiny, tmp_path, fmt):
    quantize_checkpoint(
        tiny, tmp_path / fmt, fmt, include=list(QUANTIZE_INCLUDE), skip_incompatible=True
    )
    from_disk = load_weights(tmp_path / fmt)
    in_memory = simulate_format(
        load_weights(tiny), fmt, QUANTIZE_INCLUDE, skip_incompatible=True, config=load_config(tiny)
    )
    assert from_disk.keys() == in_memory.keys()
    for name in from_disk:
        assert torch.equal(from_disk[name], in_memory[name]), name
    changed = [n for n in in_memory if not torch.equal(in_memory[n], load_weights(tiny)[n])]
    assert "context_proj.weight" in changed and "layers.0.mlp.gate_proj.weight" in changed


def test_weight_statistics(tiny):
    gauss = weight_stats(torch.randn(512, 512, generator=torch.Generator().manual_seed(0)))
    assert abs(gauss["kurtosis"] - 3) < 0.1 and gauss["row_spread"] < 1.2
    stats = {r["name"]: r for r in checkpoint_stats(tiny)}
    assert len(stats) == 68
    up, down = stats["layers.0.mlp.up_proj.weight"], stats["layers.0.mlp.down_proj.weight"]
    assert up["kurtosis"] > 4  # heavy tails everywhere
    assert down["col_spread"] > 2 * up["col_spread"]  # input-channel outliers in down_proj


def test_synth_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    result = runner.invoke(
        cli, ["synth", "--preset", "tiny", "--output_dir", str(out), "--seed", "3", "--json", "-"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["tensors"] == 68 and summary["seed"] == 3
    again = runner.invoke(cli, ["synth", "--output-dir", str(out)])
    assert again.exit_code == 1 and "Error:" in again.output and "--overwrite" in again.output
