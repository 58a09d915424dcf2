"""Checkpoints that vLLM's K3 DSpark draft loader serves as intended (docs/vllm.md).

The test carries its own replay of vLLM's loading decision, written from vLLM's source and
independent of ``qstream.vllm.profiles``: the draft's runtime Linear layers
(``model.layers.{L+i}...`` with fused q_a/kv_a and gate/up, ``model.context_proj``, and the
cross-layer ``context_kv_proj`` that takes its scheme from layer 0's ``fused_qkv_a_proj``),
compressed-tensors' ignore matching (equal, or ``re:`` + ``re.match``), the Markov head built
without a quant config, one NVFP4 global scale per fused layer, and what a tensor-parallel size
changes (the draft's heads and splits must divide; FP4 row-parallel shards must hold whole
blocks).  Real ``quantize`` outputs of the tiny draft must pass it (and ``verify``) for L = 8 and
93; deliberately broken checkpoints must fail both, with ``verify`` naming the rule.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import DSPARK_RECIPE, as_bytes
from click.testing import CliRunner
from ct_reference import ct_quantize
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_mla import PRESETS, tensor_shapes
from qstream.checkpoint.safetensors_io import PlannedTensor, ShardWriter, TensorInfo
from qstream.cli import cli
from qstream.errors import QStreamError
from qstream.formats import FORMATS, quantize
from qstream.formats.nvfp4 import tensor_amax
from qstream.quant import quantize_checkpoint
from qstream.quant.select import select_modules
from qstream.vllm.profiles import K3_DSPARK, PROFILES
from qstream.vllm.verify import verify_checkpoint

LAYERS = 5  # the tiny draft's
TARGET_LAYERS = (8, 93)  # the tiny preset's target, and Kimi-K3


# --- vLLM's decision, replayed independently ---------------------------------------------------


def vllm_linear_layers(L: int) -> dict[str, list[str]]:
    """Runtime Linear layer -> checkpoint modules loaded into it, for the K3 DSpark draft."""
    layers: dict[str, list[str]] = {}
    for i in range(LAYERS):
        rt, ck = f"model.layers.{L + i}.", f"layers.{i}."
        layers[rt + "self_attn.fused_qkv_a_proj"] = [
            ck + "self_attn.q_a_proj",
            ck + "self_attn.kv_a_proj_with_mqa",
        ]
        for leaf in (
            "self_attn.q_b_proj",
            "self_attn.kv_b_proj",
            "self_attn.o_proj",
            "mlp.down_proj",
        ):
            layers[rt + leaf] = [ck + leaf]
        layers[rt + "mlp.gate_up_proj"] = [ck + "mlp.gate_proj", ck + "mlp.up_proj"]
    layers["model.context_proj"] = ["context_proj"]
    return layers


def vllm_ignores(name: str, ignore: list[str]) -> bool:
    return any(e == name or (e.startswith("re:") and re.match(e[3:], name)) for e in ignore)


def replay(directory, L: int, tp: int = 1) -> list[str]:
    """Everything vLLM would load differently from what the checkpoint stores."""
    config = json.loads((directory / "config.json").read_text())
    qconfig = config["quantization_config"]
    fmt = {
        "naive-quantized": "fp8",
        "mxfp4-pack-quantized": "mxfp4",
        "nvfp4-pack-quantized": "nvfp4",
    }[qconfig["format"]]
    tensors = load_file(directory / "model.safetensors")
    first = FORMATS[fmt].stored[0]

    def stored_quantized(module):
        return f"{module}.{first}" in tensors and (
            fmt != "fp8" or tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn
        )

    wrong = []
    layers = vllm_linear_layers(L)
    kv_a = [f"layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(LAYERS)]
    layers_with_kv = {**layers, f"model.layers.{L}.self_attn.fused_qkv_a_proj#context_kv": kv_a}
    for name, shards in layers_with_kv.items():
        prefix = name.split("#")[0]
        builds_quantized = not vllm_ignores(prefix, qconfig["ignore"])
        wrong += [f"{name}: {s}" for s in shards if stored_quantized(s) != builds_quantized]
        scales = {
            tensors[f"{s}.weight_global_scale"].item()
            for s in shards
            if f"{s}.weight_global_scale" in tensors
        }
        if len(scales) > 1:
            wrong.append(f"{name}: global scales {sorted(scales)}")
    for module in ("markov_head.markov_w1", "markov_head.markov_w2", "confidence_head.proj"):
        if stored_quantized(module):
            wrong.append(f"{module}: quantized")
    return wrong + replay_tp(config, tensors, fmt, stored_quantized, tp)


def replay_tp(config, tensors, fmt, stored_quantized, tp: int) -> list[str]:
    """vLLM 0.32.0 at TP tp.  MultiHeadLatentAttention.__init__ (vllm/models/kimi_k3/nvidia/
    mla.py) asserts heads % tp == 0; KimiMLP's gate_up_proj / down_proj divide the intermediate
    size (ColumnParallelLinear / RowParallelLinear.__init__, vllm/model_executor/layers/linear.py).
    Row-parallel o_proj and down_proj: each rank's FP4 scales are (K/tp) // group columns read
    from column rank * that (create_weights; RowvLLMParameter.load_row_parallel_weight in
    vllm/model_executor/parameter.py), right only when K/tp is a whole number of groups."""
    if config["num_attention_heads"] % tp or config["intermediate_size"] % tp:
        return [f"vLLM cannot build the draft at TP {tp}"]
    if fmt == "fp8":
        return []
    group = {"mxfp4": 32, "nvfp4": 16}[fmt]
    wrong = []
    for i in range(LAYERS):
        for leaf in ("self_attn.o_proj", "mlp.down_proj"):
            module = f"layers.{i}.{leaf}"
            if stored_quantized(module):
                k = 2 * tensors[f"{module}.weight_packed"].shape[1]
                if (k // tp) % group:
                    wrong.append(f"{module}: K/tp = {k // tp} splits {fmt} scale groups")
    return wrong


# --- real quantize outputs ----------------------------------------------------------------------

GOOD = {
    "recipe fp8": ("fp8", dict(include=DSPARK_RECIPE)),
    "recipe nvfp4": ("nvfp4", dict(include=DSPARK_RECIPE)),
    "recipe mxfp4": ("mxfp4", dict(include=DSPARK_RECIPE, skip_incompatible=True)),
    "default nvfp4": ("nvfp4", dict()),
    "user ignore nvfp4": ("nvfp4", dict(ignore=["self_attn.kv_b_proj", "mlp.down_proj"])),
    # one layer's module ignored: its runtime name depends on L (written for config.json's 8)
    "partial-layer ignore nvfp4": ("nvfp4", dict(ignore=["layers.2.mlp.down_proj"])),
}


@pytest.fixture(scope="module")
def outputs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return {
        case: Path(quantize_checkpoint(tiny, root / case.replace(" ", "-"), fmt, **kw).output_dir)
        for case, (fmt, kw) in GOOD.items()
    }


@pytest.mark.parametrize("case", list(GOOD))
def test_quantize_outputs_load_as_intended_for_every_L(outputs, case):
    out = outputs[case]
    layer_specific = case.startswith("partial-layer")
    for L in TARGET_LAYERS:
        assert (replay(out, L) == []) == (L == 8 or not layer_specific), (case, L)
        report = verify_checkpoint(out, target_layers=L)
        assert report.ok == (L == 8 or not layer_specific), report.problems
    assert verify_checkpoint(out).target_layers == 8


def test_default_selection_follows_vllm(outputs):
    out = outputs["default nvfp4"]
    written = load_file(out / "model.safetensors")
    for module in ("markov_head.markov_w2", "confidence_head.proj", "markov_head.markov_w1"):
        assert f"{module}.weight" in written and written[f"{module}.weight"].dtype == torch.bfloat16
    # q_a/kv_a of every layer quantized, sharing one global scale (the cross-layer group)
    scales = {
        written[f"layers.{i}.self_attn.{m}.weight_global_scale"].item()
        for i in range(LAYERS)
        for m in ("q_a_proj", "kv_a_proj_with_mqa")
    }
    assert len(scales) == 1


def test_cross_layer_group_is_byte_identical_to_compressed_tensors(tiny, outputs):
    """The group scale is the only change: with the ten q_a/kv_a weights as one fused group,
    compressed-tensors (smallest global scale over the group, as llm-compressor's fused-scale
    helper does) writes exactly our bytes."""
    base = load_file(Path(tiny) / "model.safetensors")
    written = load_file(outputs["default nvfp4"] / "model.safetensors")
    group = [
        f"layers.{i}.self_attn.{m}"
        for i in range(LAYERS)
        for m in ("q_a_proj", "kv_a_proj_with_mqa")
    ]
    for module in group:
        others = [base[f"{m}.weight"] for m in group if m != module]
        expected = ct_quantize("nvfp4", base[f"{module}.weight"], fused_with=others)
        for suffix in FORMATS["nvfp4"].stored:
            assert as_bytes(written[f"{module}.{suffix}"]) == as_bytes(expected[suffix]), (
                f"{module}.{suffix}"
            )


def test_ignore_entries_are_regexes_by_kind_covering_hf_and_fused_names(outputs):
    qconfig = json.loads((outputs["recipe fp8"] / "config.json").read_text())
    ignore = qconfig["quantization_config"]["ignore"]
    for name in (
        "layers.3.self_attn.q_a_proj",
        "model.layers.96.self_attn.fused_qkv_a_proj",
        "model.layers.11.self_attn.kv_a_proj_with_mqa",
        "layers.0.self_attn.kv_b_proj",
        "model.layers.93.self_attn.kv_b_proj",
        "markov_head.markov_w2",
    ):
        assert vllm_ignores(name, ignore), name
    for name in (
        "model.context_proj",
        "model.layers.93.mlp.gate_up_proj",
        "model.layers.95.self_attn.q_b_proj",
        "layers.0.mlp.down_proj",
    ):
        assert not vllm_ignores(name, ignore), name


# --- deliberately broken checkpoints ------------------------------------------------------------


def _rewrite(out, change_tensors=None, change_ignore=None):
    path = out / "model.safetensors"
    tensors = load_file(path)
    if change_tensors:
        change_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    if change_ignore:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"]["ignore"] = change_ignore(
            config["quantization_config"]["ignore"]
        )
        (out / "config.json").write_text(json.dumps(config))


def _quantize_module(base, fmt, module, amax=None):
    def change(tensors):
        w = base[f"{module}.weight"]
        del tensors[f"{module}.weight"]
        stored = quantize(fmt, w, global_amax=amax)
        tensors.update({f"{module}.{k}": v for k, v in stored.items()})

    return change


def _unquantize_module(base, fmt, module):
    def change(tensors):
        for suffix in FORMATS[fmt].stored:
            tensors.pop(f"{module}.{suffix}", None)
        tensors[f"{module}.weight"] = base[f"{module}.weight"]

    return change


def _per_pair_scales(base):
    """NVFP4 as qstream wrote it before: each layer's q_a/kv_a pair with its own scale."""

    def change(tensors):
        for i in range(LAYERS):
            pair = [f"layers.{i}.self_attn.{m}" for m in ("q_a_proj", "kv_a_proj_with_mqa")]
            amax = max(tensor_amax(base[f"{m}.weight"]) for m in pair)
            for m in pair:
                tensors.update(
                    {
                        f"{m}.{k}": v
                        for k, v in quantize("nvfp4", base[f"{m}.weight"], global_amax=amax).items()
                    }
                )

    return change


def _exact_checkpoint_names(out):
    tensors = load_file(out / "model.safetensors")
    return lambda _: sorted(
        {
            n.rsplit(".", 1)[0]
            for n in tensors
            if n.endswith(".weight") and tensors[n].dtype == torch.bfloat16
        }
    )


BROKEN = {
    # case: (good output, tensors change(base), ignore change(out), verify kwargs, verify line)
    "split gate/up": (
        "default nvfp4",
        lambda b: _unquantize_module(b, "nvfp4", "layers.1.mlp.up_proj"),
        None,
        {},
        "fused group layers.1.mlp.{gate_proj, up_proj} is split",
    ),
    "one layer's kv_a quantized": (
        "recipe fp8",
        lambda b: _quantize_module(b, "fp8", "layers.2.self_attn.kv_a_proj_with_mqa"),
        None,
        {},
        "model.layers.10.self_attn.fused_qkv_a_proj: vLLM builds it unquantized",
    ),
    "quantized markov_w2": (
        "recipe nvfp4",
        lambda b: _quantize_module(b, "nvfp4", "markov_head.markov_w2"),
        None,
        {},
        "markov_head.markov_w2: stored nvfp4, but vLLM never quantizes it",
    ),
    "quantized confidence head": (
        "recipe fp8",
        lambda b: _quantize_module(b, "fp8", "confidence_head.proj"),
        None,
        {},
        "confidence_head.proj: stored fp8, but vLLM never quantizes it",
    ),
    "exact-name ignore": (
        "recipe fp8",
        None,
        "exact",
        {},
        "model.layers.8.self_attn.fused_qkv_a_proj: vLLM builds it fp8",
    ),
    "per-pair NVFP4 scales": (
        "default nvfp4",
        _per_pair_scales,
        None,
        {},
        "fused group self_attn.{q_a_proj, kv_a_proj_with_mqa} of every "
        "layer has 5 different NVFP4 global scales",
    ),
    # the tiny draft's o_proj K is 32 and down_proj's 96: 8 and 24 per shard at TP 4
    "FP4 row-parallel shards of part blocks": (
        "recipe nvfp4",
        None,
        None,
        {"tensor_parallel_size": 4},
        "layers.0.self_attn.o_proj: stored nvfp4, but K per shard 8 at tensor_parallel_size 4 "
        "is not a multiple of the block size 16",
    ),
    "draft unbuildable at TP 8": (
        "recipe fp8",
        None,
        None,
        {"tensor_parallel_size": 8},
        "vLLM 0.32.0 cannot build the draft at tensor_parallel_size 8: "
        "num_attention_heads 4 is not a multiple of 8",
    ),
    "ignore reaches a quantized layer": (
        "recipe fp8",
        None,
        lambda: lambda ig: ig + ["re:.*mlp\\..*"],
        {},
        "model.layers.8.mlp.gate_up_proj: vLLM builds it unquantized (ignore entry 're:.*mlp",
    ),
    "fused runtime name not ignored": (
        "recipe fp8",
        None,
        lambda: lambda ig: [e.replace("|fused_qkv_a_proj", "") for e in ig],
        {},
        "model.layers.8.self_attn.fused_qkv_a_proj: vLLM builds it fp8 (no ignore entry",
    ),
    "partial ignore served at another L": (
        "partial-layer ignore nvfp4",
        None,
        None,
        {"target_layers": 93},
        "model.layers.95.mlp.down_proj: vLLM builds it nvfp4",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_verify_catches_each_broken_checkpoint(tiny, outputs, tmp_path, case):
    good, tensors_change, ignore_change, kwargs, line = BROKEN[case]
    out = tmp_path / "broken"
    shutil.copytree(outputs[good], out)
    base = load_file(Path(tiny) / "model.safetensors")
    if ignore_change == "exact":
        ignore_change = lambda: _exact_checkpoint_names(out)  # noqa: E731
    _rewrite(
        out,
        tensors_change(base) if tensors_change else None,
        ignore_change() if ignore_change else None,
    )
    L = kwargs.get("target_layers", 8)
    assert replay(out, L, kwargs.get("tensor_parallel_size", 1)), "the replay must see it too"
    report = verify_checkpoint(out, **kwargs)
    assert not report.ok
    assert any(p.startswith(line) for p in report.problems), report.problems
    result = CliRunner().invoke(
        cli,
        [
            "verify",
            str(out),
            *[a for k, v in kwargs.items() for a in (f"--{k.replace('_', '-')}", str(v))],
        ],
    )
    assert result.exit_code == 1 and line in result.output


# --- selection rules ----------------------------------------------------------------------------


def test_quantize_refuses_what_vllm_cannot_serve(tiny, tmp_path):
    with pytest.raises(
        QStreamError,
        match="markov_head.markov_w2, which vLLM cannot serve quantized: the DSpark Markov head",
    ):
        quantize_checkpoint(tiny, tmp_path / "a", "fp8", include=["markov_head.markov_w2"])
    # served, not skipped: K3DSparkModel.__init__ (vllm/models/kimi_k3/nvidia/dspark_mla.py)
    # builds DSparkConfidenceHead (qwen3_dspark.py), an fp32 ReplicatedLinear with no quant config
    with pytest.raises(
        QStreamError,
        match="confidence_head.proj, which vLLM cannot serve quantized: the DSpark confidence "
        r"head is built in fp32 without a quant config \(served for adaptive verification\)",
    ):
        quantize_checkpoint(tiny, tmp_path / "a", "fp8", include=["confidence_head.proj"])
    with pytest.raises(
        QStreamError,
        match=r"fused group self_attn\.\{q_a_proj, "
        r"kv_a_proj_with_mqa\} of every layer would be split",
    ):
        quantize_checkpoint(
            tiny,
            tmp_path / "c",
            "fp8",
            include=["layers.0.self_attn.q_a_proj", "layers.0.self_attn.kv_a_proj_with_mqa"],
        )
    assert not any(tmp_path.iterdir())


# vLLM 0.32.0 builds context_proj as a ReplicatedLinear and context_kv_proj (every layer's
# kv_a_proj_with_mqa) as a MergedColumnParallelLinear with disable_tp=True, both with the draft's
# quant config, at every TP size (K3DSparkModel.__init__, vllm/models/kimi_k3/nvidia/dspark_mla.py).
# The tiny draft has 4 heads, so vLLM builds it at TP 1, 2 and 4 only.
TP_CASES = [("recipe fp8", 4), ("recipe nvfp4", 2), ("default nvfp4", 2)]


@pytest.mark.parametrize("case, tp", TP_CASES)
def test_context_proj_and_qkv_a_quantized_at_tp(outputs, case, tp):
    out = outputs[case]
    fmt = GOOD[case][0]
    assert replay(out, 8, tp) == []
    report = verify_checkpoint(out, tensor_parallel_size=tp)
    assert report.ok and report.warnings == [], (report.problems, report.warnings)
    scheme = {m["module"]: m["scheme"] for m in report.runtime_modules}
    assert scheme["model.context_proj"] == fmt
    expected = fmt if case.startswith("default") else None
    assert scheme["model.layers.8.self_attn.fused_qkv_a_proj"] == expected
    assert scheme["model.context_kv_proj"] == expected
    result = CliRunner().invoke(cli, ["verify", str(out), "--tensor-parallel-size", str(tp)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_quantize_selects_context_proj_and_qkv_a_at_any_tp(tiny, tmp_path, tp):
    plan = quantize_checkpoint(tiny, tmp_path / "d", "fp8", dry_run=True, tensor_parallel_size=tp)
    assert {"context_proj", "layers.0.self_attn.q_a_proj"} <= set(plan.modules_quantized)
    plan = quantize_checkpoint(
        tiny, tmp_path / "d", "fp8", include=DSPARK_RECIPE, dry_run=True, tensor_parallel_size=tp
    )
    assert "context_proj" in plan.modules_quantized


def test_layer_specific_ignores_are_warned_about(tiny, tmp_path):
    plan = quantize_checkpoint(
        tiny, tmp_path / "o", "fp8", ignore=["layers.2.mlp.down_proj"], dry_run=True
    )
    assert (
        "model.layers.10.mlp.down_proj" in plan.ignore and "layers.2.mlp.down_proj" in plan.ignore
    )
    assert any(
        "name single runtime layers (model.layers.10.mlp.down_proj, ...) at L=8" in w
        for w in plan.warnings
    )


def test_quantize_refuses_shards_vllm_loads_wrongly(tiny, tmp_path):
    """At TP 4 the tiny draft's down_proj (K 96) holds 24 inputs per shard: not whole NVFP4
    blocks, so vLLM 0.32.0 would read the wrong block scales (RowvLLMParameter.
    load_row_parallel_weight, vllm/model_executor/parameter.py); the shape rule applies per shard
    and --skip-incompatible leaves it unquantized."""
    args = ["quantize", "--model_dir", str(tiny), "--output_dir", str(tmp_path / "o")]
    args += ["--quant_format", "nvfp4", "--include_layers", "mlp.down_proj", "--dry-run"]
    result = CliRunner().invoke(cli, [*args, "--tensor-parallel-size", "4"])
    assert result.exit_code == 1
    assert (
        "Error: layers.0.mlp.down_proj.weight: shape [64, 96]: K per shard 24 at "
        "tensor_parallel_size 4 is not a multiple of the block size 16" in result.output
    )
    plan = quantize_checkpoint(
        tiny, tmp_path / "o", "nvfp4", dry_run=True, skip_incompatible=True, tensor_parallel_size=4
    )
    assert "layers.0.mlp.down_proj" in plan.modules_skipped
    assert "layers.0.self_attn.o_proj" in plan.modules_skipped  # K 32: 8 per shard
    assert "layers.0.mlp.gate_proj" in plan.modules_quantized  # column-parallel: K whole
    # MXFP4 blocks are 32 wide: at TP 2, down_proj's 48 and o_proj's 16 are not whole blocks
    plan = quantize_checkpoint(
        tiny, tmp_path / "o", "mxfp4", dry_run=True, skip_incompatible=True, tensor_parallel_size=2
    )
    assert {"layers.0.mlp.down_proj", "layers.0.self_attn.o_proj"} <= set(plan.modules_skipped)
    assert not any(tmp_path.iterdir())


def test_quantize_refuses_a_tp_size_vllm_cannot_build_the_draft_at(tiny, tmp_path):
    """MultiHeadLatentAttention.__init__ (vllm/models/kimi_k3/nvidia/mla.py) asserts that the
    heads divide by TP: the tiny draft has 4."""
    with pytest.raises(
        QStreamError,
        match="--tensor-parallel-size 8: vLLM 0.32.0 cannot build this draft at it: "
        "num_attention_heads 4 is not a multiple of 8",
    ):
        quantize_checkpoint(tiny, tmp_path / "o", "fp8", dry_run=True, tensor_parallel_size=8)


def test_fp4_marlin_shapes_are_not_refused(tiny, tmp_path):
    """vLLM 0.32.0's FP4 Marlin zero-pads each shard's N and K to a tile family
    (prepare_fp4_layer_for_marlin in vllm/model_executor/layers/quantization/utils/
    marlin_utils_fp4.py, marlin_padded_nk in marlin_utils.py): q_b_proj's N of 48 per shard at
    TP 2 (not a multiple of 64) is neither refused nor warned about."""
    plan = quantize_checkpoint(
        tiny, tmp_path / "o", "nvfp4", include=DSPARK_RECIPE, dry_run=True, tensor_parallel_size=2
    )
    assert "layers.0.self_attn.q_b_proj" in plan.modules_quantized and plan.warnings == []


def test_generic_profile_keeps_plain_names():
    """A non-DSpark architecture keeps today's rules: exact names, sibling fused groups."""
    infos = _k3_infos()
    sel = select_modules(infos, "fp8")
    assert "markov_head.markov_w2" in sel.quantized  # generic: nothing says it is a Markov head
    sel = select_modules(infos, "fp8", profile=PROFILES[K3_DSPARK])
    assert "markov_head.markov_w2" not in sel.quantized
    assert "confidence_head.proj" not in sel.quantized
    # generic: qstream does not know the model's splits, so a TP size changes nothing
    at_tp = select_modules(infos, "nvfp4", tensor_parallel_size=7)
    assert at_tp.quantized == select_modules(infos, "nvfp4").quantized


# --- the Kimi-K3-shaped plan, from headers only -------------------------------------------------


def _k3_infos():
    return {n: TensorInfo(n, "BF16", s, 0, 0) for n, s in tensor_shapes(PRESETS["k3"]).items()}


def test_k3_recipe_plan(tmp_path):
    """docs/model.md's numbers for the published recipe, on a sparse K3-shaped checkpoint (headers
    written, data never touched): 2,186,280,960 of 3,562,312,961 parameters, 41 ignored
    modules, 6.6 -> 4.6 GiB in FP8."""
    config = PRESETS["k3"]
    src = tmp_path / "k3"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({**config.to_json(), "architectures": ["K3DSparkModel"]})
    )
    shapes = tensor_shapes(config)
    planned = [PlannedTensor(n, "BF16", s) for n, s in shapes.items()]
    ShardWriter(src / "model.safetensors", planned, {"format": "pt"}).abort()  # sparse file
    plan = quantize_checkpoint(src, tmp_path / "fp8", "fp8", include=DSPARK_RECIPE, dry_run=True)
    assert plan.params_total == 3_562_312_961 and plan.params_quantized == 2_186_280_960
    assert len(plan.modules_ignored) == 41 and plan.serving_profile == K3_DSPARK
    assert abs(plan.bytes_before / 2**30 - 6.6) < 0.05
    assert abs(plan.bytes_after / 2**30 - 4.6) < 0.1
    # at TP 16 too: vLLM 0.32.0 quantizes the replicated context_proj at every TP size
    # (K3DSparkModel.__init__, vllm/models/kimi_k3/nvidia/dspark_mla.py)
    at_16 = quantize_checkpoint(
        src, tmp_path / "fp8", "fp8", include=DSPARK_RECIPE, dry_run=True, tensor_parallel_size=16
    )
    assert at_16.modules_quantized == plan.modules_quantized
    assert "context_proj" in at_16.modules_quantized


def test_sensitivity_considers_only_kinds_vllm_can_serve_quantized(tiny):
    from qstream.arch.dspark_mla import load_config, load_weights
    from qstream.eval.sensitivity import module_kinds

    names = [k.name for k in module_kinds(load_weights(tiny), "nvfp4", load_config(tiny))]
    assert not any("confidence" in n or "markov" in n for n in names), names
    assert "self_attn.q_a_proj + self_attn.kv_a_proj_with_mqa" in names


def test_simulated_format_equals_the_read_back_checkpoint(tiny, outputs):
    """eval-drift's simulated NVFP4 (default selection: the cross-layer q_a/kv_a group with its
    shared global scale) is bit-identical to loading what quantize wrote."""
    from qstream.arch.dspark_mla import load_config, load_weights
    from qstream.quant.simulate import simulate_format

    simulated = simulate_format(load_weights(tiny), "nvfp4", None, config=load_config(tiny))
    read_back = load_weights(outputs["default nvfp4"], target=Path(tiny) / "target_head")
    assert simulated.keys() == read_back.keys()
    for name, w in simulated.items():
        assert w.dtype == read_back[name].dtype and as_bytes(w) == as_bytes(read_back[name]), name
