"""``qstream verify`` passes what quantize writes and catches each structural problem of
docs/quantize.md; ``qstream inspect`` counts parameters and reads the config."""

import json

import pytest
import torch
from checkpoints import llama_tensors, sharded_llama, write_checkpoint
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qstream.cli import cli
from qstream.quant import quantize_checkpoint


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """One quantized output per format (the sharded Llama, fused group across shards)."""
    root = tmp_path_factory.mktemp("verify")
    src, _ = sharded_llama(root / "in")
    return src, {
        fmt: quantize_checkpoint(src, root / fmt, fmt).output_dir
        for fmt in ("fp8", "mxfp4", "nvfp4")
    }


def _copy(path, tmp_path):
    import shutil

    return shutil.copytree(path, tmp_path / "copy")


def _verify(directory, *args):
    result = CliRunner().invoke(cli, ["verify", str(directory), "--json", "-", *args])
    return result


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_verify_passes_quantize_output(quantized, fmt):
    result = _verify(quantized[1][fmt])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["quant_format"] == fmt and report["problems"] == []
    assert len(report["modules_quantized"]) == 14 and len(report["modules_ignored"]) == 7


def _edit_config(directory, change):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config["quantization_config"])
    path.write_text(json.dumps(config))


def _edit_tensors(directory, change):
    """Apply ``change`` to each shard's tensors, then rewrite the index to match.  The quantize
    record goes too, as for a checkpoint another tool edited (its sha256s are tested apart)."""
    (directory / "qstream_quantize.json").unlink(missing_ok=True)
    weight_map = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors = load_file(shard)
        if change(tensors):
            save_file(tensors, shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _second_global_scale(tensors):
    name = "model.layers.0.mlp.up_proj.weight_global_scale"
    if name in tensors:
        tensors[name] = tensors[name] * 2
        return True
    return False


def _nan_scale(tensors):
    name = "model.layers.1.mlp.down_proj.weight_scale"
    if name in tensors:
        tensors[name][0, 0] = float("nan")
        return True
    return False


def _scale_value(name, value):
    def change(tensors):
        if name not in tensors:  # the shard that does not hold it
            return False
        tensors[name].view(-1)[0] = value
        return True

    return change


def _nan_code(tensors):
    """An FP8 NaN code (0x7F) in the weight: the scales stay sane, only --deep sees it."""
    name = "model.layers.1.mlp.down_proj.weight"
    if name not in tensors:
        return False
    tensors[name].view(torch.uint8)[0, 0] = 0x7F
    return True


def _wrong_scale_dtype(tensors):
    name = "model.layers.1.mlp.down_proj.weight_scale"
    if name in tensors:
        tensors[name] = tensors[name].float()
        return True
    return False


def _split_group(tensors):
    """Replace layer 1's up_proj with an unquantized weight (the group is now split)."""
    prefix = "model.layers.1.mlp.up_proj."
    names = [n for n in tensors if n.startswith(prefix)]
    for n in names:
        del tensors[n]
    if names:
        tensors[prefix + "weight"] = torch.zeros(96, 64, dtype=torch.bfloat16)
    return bool(names)


CASES = {
    "module unaccounted for": (
        "fp8",
        "config",
        lambda q: q["ignore"].remove("model.norm"),
        "model.norm holds an unquantized weight but is not in ignore",
    ),
    "quantized module ignored": (
        "mxfp4",
        "config",
        lambda q: q["ignore"].append("model.layers.0.mlp.down_proj"),
        "model.layers.0.mlp.down_proj is quantized but listed in ignore",
    ),
    "in targets and ignore": (
        "fp8",
        "config",
        lambda q: q["config_groups"]["group_0"]["targets"].append("model.norm"),
        "model.norm is in both targets and ignore",
    ),
    "two groups": (
        "fp8",
        "config",
        lambda q: q["config_groups"].update(group_1=q["config_groups"]["group_0"]),
        "expected exactly one config group, found 2",
    ),
    "weights args": (
        "nvfp4",
        "config",
        lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32),
        "weights.group_size is 32, the nvfp4-pack-quantized format needs 16",
    ),
    "global scales differ": (
        "nvfp4",
        "tensors",
        _second_global_scale,
        "model.layers.0.mlp.{gate_proj, up_proj} has 2 different NVFP4 global",
    ),
    "nan block scale": (
        "nvfp4",
        "tensors",
        _nan_scale,
        "model.layers.1.mlp.down_proj.weight_scale: 1 value(s) non-finite or "
        "not positive, e.g. nan",
    ),
    "zero fp8 scale": (
        "fp8",
        "tensors",
        _scale_value("model.layers.1.mlp.down_proj.weight_scale", 0.0),
        "model.layers.1.mlp.down_proj.weight_scale: 1 value(s) non-finite or "
        "not positive, e.g. 0.0",
    ),
    "negative global scale": (
        "nvfp4",
        "tensors",
        _scale_value("model.layers.1.mlp.down_proj.weight_global_scale", -1.0),
        "model.layers.1.mlp.down_proj.weight_global_scale: 1 value(s) "
        "non-finite or not positive, e.g. -1.0",
    ),
    "E8M0 NaN": (
        "mxfp4",
        "tensors",
        _scale_value("model.layers.1.mlp.down_proj.weight_scale", 0xFF),
        "model.layers.1.mlp.down_proj.weight_scale: 1 value(s) E8M0 0xFF (NaN), e.g. 255",
    ),
    "non-finite dequantize (--deep)": (
        "fp8",
        "tensors",
        _nan_code,
        "model.layers.1.mlp.down_proj: dequantized weight has non-finite",
    ),
    "scale dtype": ("fp8", "tensors", _wrong_scale_dtype, None),
    "wrong scale dtype": (
        "mxfp4",
        "tensors",
        _wrong_scale_dtype,
        "model.layers.1.mlp.down_proj.weight_scale: stored F32 [64, 3], expected U8 [64, 3]",
    ),
    "split group": (
        "mxfp4",
        "tensors",
        _split_group,
        "fused group model.layers.1.mlp.{gate_proj, up_proj} is split",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_finds_each_problem(quantized, tmp_path, case):
    fmt, kind, change, message = CASES[case]
    directory = _copy(quantized[1][fmt], tmp_path)
    if kind == "config":
        _edit_config(directory, change)
    else:
        _edit_tensors(directory, change)
    result = _verify(directory)
    if "--deep" in case:  # only the round trip sees it
        assert result.exit_code == 0, result.output
        result = _verify(directory, "--deep")
    if message is None:  # FP8's scale may be any float dtype: still fine
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["problems"]
    assert any(message in p for p in problems), problems
    assert result.stderr.rstrip().splitlines()[-1].startswith("Error: ")


def test_verify_refuses_an_unquantized_or_broken_checkpoint(quantized, tmp_path):
    result = CliRunner().invoke(cli, ["verify", str(quantized[0])])
    assert result.exit_code == 1
    assert "has no quantization_config; not a quantized checkpoint" in result.output
    directory = _copy(quantized[1]["fp8"], tmp_path)
    (directory / "model-00002-of-00002.safetensors").unlink()
    result = CliRunner().invoke(cli, ["verify", str(directory)])
    assert result.exit_code == 1 and "names shard 'model-00002-of-00002" in result.output


def test_inspect_counts_logical_parameters(quantized, tmp_path):
    src, outputs = quantized
    runner = CliRunner()
    before = json.loads(runner.invoke(cli, ["inspect", str(src), "--json", "-"]).output)
    assert before["quantization_config"] is None and before["shards"] == 2
    total = sum(t.numel() for t in llama_tensors().values())
    assert before["params"] == total
    for fmt, directory in outputs.items():
        result = runner.invoke(cli, ["inspect", str(directory), "--json", "-"])
        assert result.exit_code == 0, result.output
        after = json.loads(result.output)
        assert after["params"] == total, fmt  # packed bytes count twice, scales not at all
        assert after["quant_format"] == fmt and after["bytes"] < before["bytes"]
        kinds = {k["kind"]: k for k in after["kinds"]}
        down = "model.layers.*.mlp.down_proj." + ("weight" if fmt == "fp8" else "weight_packed")
        assert kinds[down]["tensors"] == 2
    plain = runner.invoke(cli, ["inspect", str(outputs["nvfp4"])])
    assert plain.exit_code == 0 and "nvfp4-pack-quantized" in plain.output


def test_inspect_of_a_missing_directory_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "nope")])
    assert result.exit_code == 1 and result.output.strip().startswith("Error: ")
    assert "not a directory" in result.output
    write_checkpoint(tmp_path / "ok", llama_tensors(layers=1))
    assert CliRunner().invoke(cli, ["inspect", str(tmp_path / "ok")]).exit_code == 0


def test_inspect_reports_weight_statistics(tmp_path):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen)
    w[:, 3] *= 40.0  # one outlier input channel
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file(
        {"proj.weight": w.to(torch.bfloat16), "norm.weight": torch.ones(32)},
        str(src / "model.safetensors"),
    )
    result = CliRunner().invoke(cli, ["inspect", str(src), "--json", "-"])
    assert result.exit_code == 0, result.output
    stats = {r["name"]: r for r in json.loads(result.output)["weight_stats"]}
    assert stats["proj.weight"]["col_spread"] > 10  # the outlier column shows
    assert stats["norm.weight"]["std"] == 0.0


def test_verify_checks_the_recorded_sha256_of_every_file(quantized, tmp_path):
    directory = _copy(quantized[1]["nvfp4"], tmp_path)
    assert _verify(directory).exit_code == 0
    record = json.loads((directory / "qstream_quantize.json").read_text())
    assert set(record["files"]) >= {
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "tokenizer.json",
    }
    shard = directory / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header_len])["lm_head.weight"]["data_offsets"]
    data[8 + header_len + begin] ^= 0x01  # one flipped bit of an unquantized weight
    shard.write_bytes(bytes(data))
    (directory / "tokenizer.json").unlink()
    result = _verify(directory)
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert problems[0].startswith("model-00002-of-00002.safetensors: sha256 ")
    assert "recorded by quantize (changed since)" in problems[0]
    assert "tokenizer.json: recorded by quantize but missing" in problems
