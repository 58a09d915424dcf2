"""quantize_checkpoint and the quantize command end to end: bit-exact against the format
functions and compressed-tensors, untouched tensors identical, config and index correct, and
every bad input refused with one line, exit 1, the input untouched and no output left."""

import json
import shlex

import pytest
import torch
from checkpoints import (
    DSPARK_RECIPE,
    as_bytes,
    dspark_config,
    dspark_tensors,
    llama_tensors,
    moe_tensors,
    sharded_llama,
    tree_digest,
    write_checkpoint,
)
from click.testing import CliRunner
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from ct_reference import ct_quantize
from safetensors.torch import load_file, save_file

import qstream.quant.write as convert_module
from qstream.cli import cli
from qstream.commands.quantize import quantize as quantize_command
from qstream.formats import FORMATS, dequantize, quantize
from qstream.formats.nvfp4 import tensor_amax
from qstream.progress import Silent
from qstream.publish import QUANTIZE_RECORD
from qstream.quant import quantize_checkpoint
from qstream.quant.quantize import default_workers
from qstream.vllm.profiles import fused_groups

FORMAT_NAMES = list(FORMATS)


def _load_all(directory):
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _module_state(tensors, module):
    prefix = module + "."
    return {
        k[len(prefix) :]: v
        for k, v in tensors.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    }


def _fused_amax(tensors, modules):
    """NVFP4: each fused group's shared amax (the groups themselves are tested in
    test_selection.py)."""
    amax = {}
    for group in fused_groups(modules):
        shared = torch.stack([tensor_amax(tensors[m + ".weight"]) for m in group.members]).amax()
        amax.update(dict.fromkeys(group.members, shared))
    return amax


def _check_output(src, out, fmt, quantized_modules, group_amax=None):
    """Every quantized module bit-exact with the format functions (and with compressed-tensors
    decompressing it under the config we wrote); everything else byte-identical."""
    original, written = _load_all(src), _load_all(out)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    scheme = parsed.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    group_amax = group_amax or {}
    expected_names = set()
    for name, w in original.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module in quantized_modules:
            ours = quantize(fmt, w, name=name, global_amax=group_amax.get(module))
            stored = {s: written[f"{module}.{s}"] for s in FORMATS[fmt].stored}
            for suffix, t in ours.items():
                assert stored[suffix].dtype == t.dtype and as_bytes(stored[suffix]) == as_bytes(
                    t
                ), f"{module}.{suffix}"
            ct_weight = compressor.decompress(dict(stored), scheme)["weight"]
            assert as_bytes(ct_weight) == as_bytes(dequantize(fmt, stored)), module
            expected_names |= {f"{module}.{s}" for s in ours}
        else:
            assert written[name].dtype == w.dtype and as_bytes(written[name]) == as_bytes(w), name
            expected_names.add(name)
    assert set(written) == expected_names
    return qconfig


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_llama_default_selection_bit_exact(tmp_path, fmt):
    src = write_checkpoint(tmp_path / "in", llama_tensors())
    before = tree_digest(src)
    summary = quantize_checkpoint(src, tmp_path / "out", fmt)
    out = tmp_path / "out"
    assert tree_digest(src) == before
    amax = _fused_amax(llama_tensors(), summary.modules_quantized) if fmt == "nvfp4" else None
    qconfig = _check_output(src, out, fmt, set(summary.modules_quantized), amax)
    config = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads(
        (src / "config.json").read_text()
    )
    group = qconfig["config_groups"]["group_0"]
    assert qconfig["format"] == group["format"] == FORMATS[fmt].layout
    assert qconfig["quant_method"] == "compressed-tensors"
    assert qconfig["quantization_status"] == "compressed"
    assert group["weights"] == FORMATS[fmt].weights_args and group["targets"] == ["Linear"]
    assert qconfig["ignore"] == summary.modules_ignored
    assert sorted(qconfig["ignore"]) == sorted(
        [
            "model.embed_tokens",
            "lm_head",
            "model.norm",
            *(
                f"model.layers.{i}.{n}"
                for i in range(2)
                for n in ("input_layernorm", "post_attention_layernorm")
            ),
        ]
    )
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert (out / "generation_config.json").exists()
    assert not (out / "model.safetensors.index.json").exists()
    assert summary.bytes_after == (out / "model.safetensors").stat().st_size
    assert len(summary.weight_snr_db) == 14 and summary.worst_snr[1] > 15
    assert not list(tmp_path.glob(".out*"))  # no temporary directory left


def test_fp8_in_fp16_and_fp32_checkpoints(tmp_path):
    for dtype in (torch.float16, torch.float32):
        src = write_checkpoint(tmp_path / f"in-{dtype}", llama_tensors(layers=1, dtype=dtype))
        summary = quantize_checkpoint(src, tmp_path / f"out-{dtype}", "fp8")
        _check_output(src, tmp_path / f"out-{dtype}", "fp8", set(summary.modules_quantized))


def test_dspark_recipe_fp8_via_the_issue_command_line(tmp_path):
    src = write_checkpoint(
        tmp_path / "in",
        dspark_tensors(),
        config=dspark_config(),
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        quantize_command,
        [
            "--model_dir",
            str(src),
            "--output_dir",
            str(out),
            "--quant_format",
            "fp8",
            "--include_layers",
            *DSPARK_RECIPE,
            "--device",
            "cpu",
            "--workers",
            "1",
            "--json",
            str(tmp_path / "s.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert len(summary["modules_quantized"]) == 26 and len(summary["modules_ignored"]) == 41
    assert summary["params_quantized"] == 5 * (3 * 96 * 64 + 64 * 48 + 96 * 48) + 64 * 320
    qconfig = _check_output(src, out, "fp8", set(summary["modules_quantized"]))
    # a DSpark draft's ignore entries are re: patterns by module kind (docs/vllm.md; vLLM's
    # matching of them is replayed in test_vllm_serving.py)
    assert "re:(.*\\.)?markov_head\\.markov_w1$" in qconfig["ignore"]
    assert "re:(.*\\.)?confidence_head\\.proj$" in qconfig["ignore"]
    assert (
        "re:.*\\.self_attn\\.(q_a_proj|kv_a_proj_with_mqa|fused_qkv_a_proj)$" in qconfig["ignore"]
    )
    provenance = json.loads((out / "qstream_quantize.json").read_text())
    assert provenance["command"] == shlex.join(
        [
            "qstream-quantize",
            "--model_dir",
            str(src),
            "--output_dir",
            str(out),
            "--quant_format",
            "fp8",
            "--include_layers",
            *DSPARK_RECIPE,
        ]
    )
    assert provenance["summary"]["modules_quantized"] == summary["modules_quantized"]


def test_sharded_nvfp4_fused_group_across_shards_shares_one_global_scale(tmp_path):
    src, tensors = sharded_llama(tmp_path / "in")
    out = tmp_path / "out"
    summary = quantize_checkpoint(src, out, "nvfp4", workers=2)
    gate, up = (f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj"))
    q, k, v = (f"model.layers.1.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj"))
    amax = {}
    for group in (
        (gate, up),
        (q, k, v),
        ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"),
        tuple(f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")),
    ):
        shared = torch.stack([tensor_amax(tensors[m + ".weight"]) for m in group]).amax()
        amax.update(dict.fromkeys(group, shared))
    _check_output(src, out, "nvfp4", set(summary.modules_quantized), amax)
    written = _load_all(out)
    assert written[gate + ".weight_global_scale"] == written[up + ".weight_global_scale"]
    # compressed-tensors' own fused rule (smallest member global scale) gives the same bytes
    ct = ct_quantize("nvfp4", tensors[gate + ".weight"], fused_with=[tensors[up + ".weight"]])
    for suffix, t in ct.items():
        assert as_bytes(written[f"{gate}.{suffix}"]) == as_bytes(t), suffix
    # index: every output tensor in the shard that holds it, total_size = tensor bytes
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        assert set(load_file(out / shard)) == {
            n for n, s in index["weight_map"].items() if s == shard
        }
    assert index["weight_map"][up + ".weight_packed"] == "model-00002-of-00002.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())


def test_moe_experts_share_global_scale_per_expert_and_routers_stay(tmp_path):
    tensors = moe_tensors()
    src = write_checkpoint(tmp_path / "in", tensors)
    summary = quantize_checkpoint(src, tmp_path / "out", "nvfp4")
    assert "model.layers.0.mlp.gate" in summary.modules_ignored
    written = _load_all(tmp_path / "out")
    amax = {}
    for e in range(4):
        for parent, members in (
            (f"model.layers.0.mlp.experts.{e}", ("gate_proj", "up_proj")),
            (f"model.layers.1.block_sparse_moe.experts.{e}", ("w1", "w3")),
        ):
            names = [f"{parent}.{m}" for m in members]
            shared = torch.stack([tensor_amax(tensors[n + ".weight"]) for n in names]).amax()
            amax.update(dict.fromkeys(names, shared))
            assert len({float(written[n + ".weight_global_scale"]) for n in names}) == 1
    _check_output(src, tmp_path / "out", "nvfp4", set(summary.modules_quantized), amax)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_row_pieces_and_workers_give_the_same_bytes(tmp_path, fmt, monkeypatch):
    src = write_checkpoint(tmp_path / "in", llama_tensors(layers=1))
    quantize_checkpoint(src, tmp_path / "whole", fmt)
    # pieces of 5 rows (and copies of 3 KiB), out of order across 3 threads
    monkeypatch.setattr(convert_module, "PIECE_ELEMENTS", 5 * 96)
    monkeypatch.setattr(convert_module, "COPY_BYTES", 3 << 10)
    quantize_checkpoint(src, tmp_path / "pieces", fmt, workers=3)
    assert (tmp_path / "whole" / "model.safetensors").read_bytes() == (
        tmp_path / "pieces" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_no_snr_writes_the_same_weights_and_records_the_worker_count(tmp_path, fmt):
    src = write_checkpoint(tmp_path / "in", llama_tensors(layers=1))
    with_snr = quantize_checkpoint(src, tmp_path / "snr", fmt, workers=2)
    result = CliRunner().invoke(
        quantize_command,
        [
            "--model_dir",
            str(src),
            "--output_dir",
            str(tmp_path / "plain"),
            "--quant_format",
            fmt,
            "--no-snr",
            "--json",
            "-",
        ],
    )
    assert result.exit_code == 0, result.output
    plain = json.loads(result.stdout)
    assert plain["weight_snr_db"] == {} and plain["mean_snr_db"] is None
    assert plain["workers"] == default_workers() and with_snr.workers == 2
    assert with_snr.weight_snr_db and all(v > 0 for v in with_snr.weight_snr_db.values())
    assert (tmp_path / "snr" / "model.safetensors").read_bytes() == (
        tmp_path / "plain" / "model.safetensors"
    ).read_bytes()
    provenance = json.loads((tmp_path / "plain" / QUANTIZE_RECORD).read_text())
    assert provenance["command"].endswith("--no-snr") and "workers" not in provenance["summary"]


def test_snr_matches_the_formats_weight_snr(tmp_path, monkeypatch):
    from qstream.formats import weight_snr_db

    tensors = llama_tensors(layers=1)
    src = write_checkpoint(tmp_path / "in", tensors)
    monkeypatch.setattr(convert_module, "PIECE_ELEMENTS", 7 * 64)
    summary = quantize_checkpoint(src, tmp_path / "out", "mxfp4")
    for module, snr in summary.weight_snr_db.items():
        w = tensors[module + ".weight"]
        expected = weight_snr_db(w, dequantize("mxfp4", quantize("mxfp4", w)))
        # rows summed in float32 inside the quantizer (docs/formats.md): sums within 2**-20
        # relative, so within 1e-5 dB, and the same to the two decimals printed
        assert snr == pytest.approx(expected, abs=1e-5), module
        assert f"{snr:.2f}" == f"{expected:.2f}", module


def test_dry_run_writes_nothing_and_predicts_the_size(tmp_path):
    src = write_checkpoint(tmp_path / "in", dspark_tensors())
    runner = CliRunner()
    args = ["quantize", "--model-dir", str(src), "--output-dir", str(tmp_path / "out")]
    args += ["--quant-format", "mxfp4", "--include-layers", *DSPARK_RECIPE]
    args += ["--skip-incompatible", "--dry-run"]
    result = runner.invoke(cli, [*args, "--json", "-"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["dry_run"] and plan["weight_snr_db"] == {}
    assert len(plan["modules_skipped"]) == 10
    shown = runner.invoke(cli, args, env={"COLUMNS": "200"})
    skipped = [line for line in shown.output.splitlines() if "[skipped] " in line]
    assert len(skipped) == 10, shown.output  # rich read the marker as a style tag and dropped it
    assert not (tmp_path / "out").exists()
    real = quantize_checkpoint(
        src, tmp_path / "out", "mxfp4", include=DSPARK_RECIPE, skip_incompatible=True
    )
    assert (
        plan["bytes_after"]
        == real.bytes_after
        == (tmp_path / "out" / "model.safetensors").stat().st_size
    )
    assert plan["modules_ignored"] == real.modules_ignored


def test_overwrite_replaces_and_existing_output_is_refused(tmp_path):
    src = write_checkpoint(tmp_path / "in", llama_tensors(layers=1))
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    args = ["quantize", "--model_dir", str(src), "--output_dir", str(out), "--quant_format", "fp8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "already exists (use --overwrite)" in result.output
    assert (out / "stale.txt").exists()
    # --overwrite replaces only what qstream wrote (docs/guarantees.md)
    result = CliRunner().invoke(cli, [*args, "--overwrite"])
    assert result.exit_code == 1 and "is not a directory qstream wrote" in result.output
    assert (out / "stale.txt").exists()
    (out / "stale.txt").unlink()
    out.rmdir()
    assert CliRunner().invoke(cli, args).exit_code == 0
    (out / "stale.txt").write_text("old")
    assert CliRunner().invoke(cli, [*args, "--overwrite"]).exit_code == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def test_interrupt_leaves_no_output_and_no_temporary_directory(tmp_path):
    src = write_checkpoint(tmp_path / "in", llama_tensors())

    class Interrupt(Silent):
        def advance(self, what, done, work=0.0, kind=""):
            if what.startswith("tensors 3/"):
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=Interrupt())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


# --- bad input: one line, exit 1, input untouched, no output --------------------------------


def _corrupt_header(src):
    shard = src / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["
    shard.write_bytes(bytes(data))


def _truncate(src):
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])


def _overlap(src):
    shard = src / "model.safetensors"
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    first, second = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
    )[:2]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    start = header[second]["data_offsets"][0] - 2
    header[second]["data_offsets"] = [start, start + size]
    body = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(body) == n
    shard.write_bytes(raw[:8] + body + raw[8 + n :])


def _nan(value):
    def poison(src):
        tensors = load_file(src / "model.safetensors")
        tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = value
        save_file(tensors, src / "model.safetensors")

    return poison


def _already_quantized(src):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(config))


def _missing_shard(src):
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:5]}, src / "a.safetensors")
    (src / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    **dict.fromkeys(names[:5], "a.safetensors"),
                    **dict.fromkeys(names[5:], "b.safetensors"),
                }
            }
        )
    )


def _tensor_in_two_shards(src):
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:6]}, src / "a.safetensors")
    save_file({n: tensors[n] for n in names[5:]}, src / "b.safetensors")


BAD_INPUTS = {
    "missing config": (lambda src: (src / "config.json").unlink(), [], "missing config.json"),
    "unreadable config": (
        lambda src: (src / "config.json").write_text("{"),
        [],
        "config.json is not valid JSON",
    ),
    "truncated shard": (_truncate, [], "run past the end of the data (156278 bytes; truncated"),
    "corrupt header": (_corrupt_header, [], "corrupt safetensors header"),
    "overlapping offsets": (_overlap, [], "overlaps tensor"),
    "index names a missing shard": (_missing_shard, [], "names shard 'b.safetensors'"),
    "tensor in two shards": (
        _tensor_in_two_shards,
        [],
        "is in two shards: a.safetensors and b.safetensors",
    ),
    "NaN weight fp8": (
        _nan(float("nan")),
        [],
        "model.layers.1.mlp.down_proj.weight: weight contains NaN or Inf",
    ),
    "Inf weight nvfp4": (
        _nan(float("inf")),
        ["--quant_format", "nvfp4"],
        "model.layers.1.mlp.down_proj.weight: weight contains NaN or Inf",
    ),
    "already quantized": (_already_quantized, [], "already quantized"),
    "include typo": (lambda src: None, ["--include_layers", "mlp.gate_prj"], "matches no module"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_cleanly(tmp_path, case):
    mutate, extra, message = BAD_INPUTS[case]
    src = write_checkpoint(tmp_path / "in", llama_tensors())
    mutate(src)
    before = tree_digest(src)
    args = [
        "--model_dir",
        str(src),
        "--output_dir",
        str(tmp_path / "out"),
        "--quant_format",
        "fp8",
        *extra,
    ]
    result = CliRunner().invoke(quantize_command, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
    assert tree_digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_output_equal_to_or_inside_the_input_is_refused(tmp_path, where):
    src = write_checkpoint(tmp_path / "in", llama_tensors(layers=1))
    before = tree_digest(src)
    out = src if where == "same" else src / "quantized"
    result = CliRunner().invoke(
        quantize_command,
        ["--model_dir", str(src), "--output_dir", str(out), "--quant_format", "fp8", "--overwrite"],
    )
    assert result.exit_code == 1 and "is inside --model_dir" in result.output
    assert tree_digest(src) == before


def test_quantize_entry_point_imports_nothing_it_does_not_use():
    """qstream-quantize's start-up is part of its wall time: the evaluator's and the card's
    heavy dependencies must stay out of it (cli.COMMANDS imports commands lazily)."""
    import subprocess
    import sys

    # the DSpark config parser and tensor table are pure Python, and quantize checks a draft's
    # tensors against them (qstream/vllm/shapes.py); the model itself stays out
    code = (
        "import sys, qstream.cli, qstream.commands.quantize; "
        "table = ('qstream.arch.dspark_mla',); "
        "heavy = ('matplotlib', 'scipy', 'transformers', 'pandas', 'safetensors', "
        "'compressed_tensors'); "
        "print(' '.join(m for m in sys.modules if m not in table and ("
        "m.split('.')[0] in heavy or m.startswith(('qstream.eval', 'qstream.arch.dspark_mla.', "
        "'qstream.card')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
