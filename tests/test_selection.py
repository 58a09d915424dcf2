"""docs/quantize.md's pattern rules, the default selection, fused groups (section 4) and the
block-size shape rule, on header-only tensor tables."""

import pytest
from checkpoints import DSPARK_RECIPE, dspark_tensors, llama_tensors, moe_tensors

from qstream.checkpoint.safetensors_io import DTYPE_NAMES, TensorInfo
from qstream.errors import QStreamError
from qstream.quant.select import select_modules
from qstream.vllm.profiles import matches


def _infos(tensors):
    return {
        n: TensorInfo(n, DTYPE_NAMES[t.dtype], tuple(t.shape), 0, 0) for n, t in tensors.items()
    }


@pytest.mark.parametrize(
    "pattern, module, expected",
    [
        ("layers.3.mlp.gate_proj", "layers.3.mlp.gate_proj", True),  # equal
        ("mlp.gate_proj", "layers.3.mlp.gate_proj", True),  # dotted suffix
        ("gate_proj", "layers.3.mlp.gate_proj", True),
        ("proj", "layers.3.mlp.gate_proj", False),  # a suffix, but not a dotted one
        ("mlp.gate", "layers.3.mlp.gate_proj", False),
        ("layers.*.mlp.*_proj", "layers.3.mlp.gate_proj", True),  # glob
        ("layers.[0-2].mlp.gate_proj", "layers.3.mlp.gate_proj", False),
        ("re:.*mlp\\.(gate|up)_proj", "layers.3.mlp.up_proj", True),  # regex, re.match
        ("re:mlp", "layers.3.mlp.up_proj", False),  # re.match anchors at the start
        ("re:layers\\.3", "layers.3.mlp.up_proj", True),
    ],
)
def test_pattern_rules(pattern, module, expected):
    assert matches(pattern, module) is expected


def test_default_selection_is_linear_weights_without_embeddings_heads_or_norms():
    sel = select_modules(_infos(llama_tensors()), "fp8")
    assert len(sel.quantized) == 14
    assert set(sel.ignored) == {
        "model.embed_tokens",
        "lm_head",
        "model.norm",
        "model.layers.0.input_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.post_attention_layernorm",
    }
    assert not set(sel.quantized) & set(sel.ignored)


def test_default_selection_leaves_routers_and_dspark_embedding_tables():
    moe = select_modules(_infos(moe_tensors()), "nvfp4")
    assert "model.layers.0.mlp.gate" in moe.ignored
    assert "model.layers.1.block_sparse_moe.gate" in moe.ignored
    assert len(moe.quantized) == 4 * 3 * 2
    dspark = select_modules(_infos(dspark_tensors()), "fp8")
    assert "markov_head.markov_w1" in dspark.ignored and "embed_tokens" in dspark.ignored
    assert "markov_head.markov_w2" in dspark.quantized


def test_dspark_recipe_selects_26_modules_and_ignores_41():
    sel = select_modules(_infos(dspark_tensors()), "fp8", include=DSPARK_RECIPE)
    assert len(sel.quantized) == 5 * 5 + 1 and len(sel.ignored) == 41  # docs/model.md
    # one gate/up group per layer is quantized; q_a/kv_a_with_mqa groups are ignored whole
    assert [g.label for g in sel.fused_groups] == [
        f"layers.{i}.mlp.{{gate_proj, up_proj}}" for i in range(5)
    ]


def test_ignore_wins_and_patterns_that_match_nothing_are_errors():
    infos = _infos(llama_tensors())
    sel = select_modules(
        infos, "fp8", include=["mlp.down_proj", "o_proj"], ignore=["model.layers.1.mlp.down_proj"]
    )
    assert sel.quantized == (
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.o_proj",
    )
    with pytest.raises(QStreamError, match="--include_layers pattern 'mlp.gate_prj' matches no"):
        select_modules(infos, "fp8", include=["mlp.gate_prj"])
    with pytest.raises(QStreamError, match="--ignore_layers pattern 'lm_haed' matches no"):
        select_modules(infos, "fp8", ignore=["lm_haed"])
    with pytest.raises(QStreamError, match="cannot be quantized, e.g. model.layers.0.input_lay"):
        select_modules(infos, "fp8", include=["input_layernorm"])
    with pytest.raises(QStreamError, match="embed_tokens \\(an embedding\\)"):
        select_modules(infos, "fp8", include=["embed_tokens"])
    with pytest.raises(QStreamError, match="quantizes no module"):
        select_modules(infos, "fp8", include=["o_proj"], ignore=["o_proj"])


def test_splitting_a_fused_group_names_the_group_and_both_sides():
    infos = _infos(llama_tensors())
    with pytest.raises(QStreamError) as exc:
        select_modules(infos, "fp8", include=["mlp.gate_proj"])
    assert str(exc.value).startswith(
        "fused group model.layers.0.mlp.{gate_proj, up_proj} would be split: quantized "
        "gate_proj; not quantized up_proj"
    )
    with pytest.raises(
        QStreamError,
        match=r"self_attn.\{q_proj, k_proj, v_proj\} would be split: "
        r"quantized q_proj, v_proj; not quantized k_proj",
    ):
        select_modules(infos, "nvfp4", ignore=["re:.*k_proj"])
    with pytest.raises(QStreamError, match=r"\{q_a_proj, kv_a_proj_with_mqa\} would be split"):
        select_modules(_infos(dspark_tensors()), "fp8", include=["q_a_proj"])
    with pytest.raises(QStreamError, match=r"experts.2.\{gate_proj, up_proj\} would be split"):
        select_modules(_infos(moe_tensors()), "fp8", ignore=["mlp.experts.2.up_proj"])
    with pytest.raises(QStreamError, match=r"experts.0.\{w1, w3\} would be split"):
        select_modules(_infos(moe_tensors()), "fp8", ignore=["re:.*experts.0.w3"])


def test_shape_rule_and_skip_incompatible():
    infos = _infos(dspark_tensors())
    # MXFP4 blocks are 32 wide; o_proj (K = 4 * 12 = 48) and q_b_proj (K = 48) do not fit
    with pytest.raises(
        QStreamError,
        match=r"layers.0.self_attn.q_b_proj.weight: shape \[96, 48\]"
        r": K=48 is not a multiple of the block size 32",
    ):
        select_modules(infos, "mxfp4", include=DSPARK_RECIPE)
    sel = select_modules(infos, "mxfp4", include=DSPARK_RECIPE, skip_incompatible=True)
    assert set(sel.skipped) == {
        f"layers.{i}.self_attn.{m}" for i in range(5) for m in ("q_b_proj", "o_proj")
    }
    assert set(sel.skipped) <= set(sel.ignored)
    # NVFP4's 16 divides 48: nothing skipped
    assert select_modules(infos, "nvfp4", include=DSPARK_RECIPE).skipped == {}


def test_skip_incompatible_drops_a_fused_group_whole():
    tensors = llama_tensors(layers=1)
    import torch

    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 40, dtype=torch.bfloat16)
    infos = _infos(tensors)
    with pytest.raises(QStreamError, match="up_proj.weight: shape \\[96, 40\\]"):
        select_modules(infos, "nvfp4")
    sel = select_modules(infos, "nvfp4", skip_incompatible=True)
    assert sel.skipped["model.layers.0.mlp.gate_proj"].startswith(
        "fused with model.layers.0.mlp.up_proj"
    )
    assert "model.layers.0.mlp.gate_proj" in sel.ignored


@pytest.mark.parametrize("option", ["include", "ignore"])
def test_an_invalid_regex_is_one_error_line(option):
    with pytest.raises(
        QStreamError,
        match=r"pattern 're:mlp_\(gate' is not a valid regular "
        r"expression \(missing \), unterminated subpattern",
    ):
        select_modules(_infos(llama_tensors()), "fp8", **{option: ["re:mlp_(gate"]})
