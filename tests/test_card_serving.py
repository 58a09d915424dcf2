"""The card's "Serving conditions" (docs/card.md): a variant served otherwise than the default
configuration gets one row naming what differs, its cost against bf16 in drift (the ceiling
table's gap) and acceptance (the results' paired loss of vLLM's default mode), its cost against
the same weights at the default, and the vLLM setting that avoids it; every number is one of the
results.  Results without configurations get no section and the card they always had.

The eval-drift cases rename examples/card_tiny's variants into serving configurations (fp8's
numbers as bf16+kv=fp8_e4m3, mxfp4's as nvfp4+a=nvfp4); the speculate case adds one to the pair's
speculate.json (examples/card_gsm8k_pair/)."""

import copy
import json
from pathlib import Path

import pytest
from card_helpers import tables

from qstream.card.build import build_card, write_card
from qstream.card.document import render
from qstream.card.measured import read_speculate
from qstream.card.results import merge_results, renamed_modes
from qstream.card.serving import condition_words
from qstream.errors import QStreamError
from qstream.serving import DEFAULTS, Variant
from qstream.verification import VLLM_DEFAULT_MODE

ROOT = Path(__file__).parent.parent
TINY = ROOT / "examples" / "card_tiny" / "results.json"
PAIR = ROOT / "examples" / "card_gsm8k_pair"
MODE = VLLM_DEFAULT_MODE.name  # the mode whose loss the section shows
# card_tiny's variant -> the configuration its numbers stand for here
SERVED = {"bf16": "bf16", "fp8": "bf16+kv=fp8_e4m3", "nvfp4": "nvfp4", "mxfp4": "nvfp4+a=nvfp4"}
CONDITIONS = ["bf16+kv=fp8_e4m3", "nvfp4+a=nvfp4"]
KV_WORDS = "KV cache fp8_e4m3, scale 1.0"
NVFP4_WORDS = "activations NVFP4 static per tensor, with dynamic per-16 block scales"


def _info(token: str) -> dict:
    """What eval-drift records of a variant: kind, source and its whole configuration."""
    v = Variant.parse(token)
    return {"kind": v.kind, "source": v.source, "configuration": v.configuration()}


@pytest.fixture(scope="module")
def tiny() -> dict:
    """card_tiny's results without the variants it serves otherwise than the default: the
    results of the same run with only its weight formats."""
    data = renamed_modes(json.loads(TINY.read_text()))  # as eval-drift writes results now
    served = [name for name, info in data["variants"].items() if "configuration" in info]
    assert served  # the example card shows the section (examples/card_end_to_end.sh)
    for name in served:
        del data["variants"][name]
        for block in data["regimes"].values():
            del block["variants"][name]
    return data


@pytest.fixture(scope="module")
def served(tiny) -> dict:
    data = copy.deepcopy(tiny)
    for block in data["regimes"].values():
        block["variants"] = {new: block["variants"][old] for old, new in SERVED.items()}
    data["variants"] = {new: _info(new) for new in SERVED.values()}
    return data


def _card(tmp_path: Path, data: dict, speculate: dict | None = None):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return build_card(merge_results([path]), figures_dir=None, speculate=speculate)


def _column(table, name: str) -> list[str]:
    i = table.columns.index(name)
    return [row[i].text for row in table.rows]


def _variant(data: dict, regime: str, name: str) -> dict:
    return data["regimes"][regime]["variants"][name]


def _ceiling(data: dict, regime: str, name: str) -> float:
    return _variant(data, regime, name)["metrics"]["rollouts"]["greedy"]["ceiling"]["value"]


def _emitted(data: dict, regime: str, name: str) -> float:
    return _variant(data, regime, name)["acceptance"]["reference"][MODE]["emitted"]["value"]


def test_each_condition_is_one_row_naming_what_differs(tmp_path, served):
    card = _card(tmp_path, served)
    section = next(s for s in card.sections if s.title == "Serving conditions")
    keys = [p.key for p in section.parts if hasattr(p, "key")]
    assert keys == ["serving_conditions", *(f"serving_{r}" for r in served["regimes"])]
    table = tables(card)["serving_conditions"]
    assert _column(table, "condition") == CONDITIONS
    assert _column(table, "what differs") == [KV_WORDS, NVFP4_WORDS]
    assert _column(table, "weights") == ["bf16", "nvfp4 (simulated)"]
    assert _column(table, "same weights at default") == ["bf16", "nvfp4"]
    kv, act = _column(table, "avoided in vLLM 0.32.0 by")
    assert kv == '"kv_cache_dtype": "auto" in --speculative-config'
    assert act == "a weight-only checkpoint (vLLM's W4A16 scheme)"
    assert table.columns[-1] == "avoided in vLLM 0.32.0 by"


def test_costs_are_the_results_numbers(tmp_path, served):
    card = _card(tmp_path, served)
    defaults = _column(tables(card)["serving_conditions"], "same weights at default")
    for regime in served["regimes"]:
        table = tables(card)[f"serving_{regime}"]
        assert _column(table, "condition") == CONDITIONS
        for name, default, gap, loss, gap_d, loss_d in zip(
            CONDITIONS,
            defaults,
            _column(table, "ceiling gap to bf16"),
            _column(table, f"loss vs bf16, {VLLM_DEFAULT_MODE.label} [95% CI]"),
            _column(table, "ceiling gap to default"),
            _column(table, "loss vs default"),
        ):
            ceiling = _ceiling(served, regime, name)
            assert gap == f"{ceiling - _ceiling(served, regime, 'bf16'):+.3f}"
            e = _variant(served, regime, name)["acceptance"]["reference"]["loss_vs_bf16"][MODE]
            assert loss == f"{e['value']:+.3f} [{e['lo']:+.3f}, {e['hi']:+.3f}]"
            assert gap_d == f"{ceiling - _ceiling(served, regime, default):+.3f}"
            if default == "bf16":  # the paired loss against bf16 is the one against it
                assert loss_d == loss
            else:
                unpaired = _emitted(served, regime, default) - _emitted(served, regime, name)
                assert loss_d == f"{unpaired:+.3f} (unpaired)"


def test_the_caption_says_how_the_costs_were_measured(tmp_path, served):
    data = copy.deepcopy(served)
    for result in data["regimes"]["boot"]["variants"].values():
        result["acceptance"]["reference"][MODE]["mode"]["temperature"] = 0.7
    t = tables(_card(tmp_path, data))
    for regime, temperature in (("heavy", "T=1.0"), ("boot", "T=0.7")):
        caption = t[f"serving_{regime}"].caption
        assert f"Regime {regime}:" in caption and temperature in caption, caption
        assert VLLM_DEFAULT_MODE.label in caption and "the FP32 reference" in caption
        assert "unpaired" in caption


def test_a_condition_without_its_default_weights_says_so(tmp_path, served):
    data = copy.deepcopy(served)
    for block in data["regimes"].values():
        del block["variants"]["nvfp4"]
    del data["variants"]["nvfp4"]
    t = tables(_card(tmp_path, data))
    assert _column(t["serving_conditions"], "same weights at default") == ["bf16", "not in the run"]
    row = dict(zip(t["serving_heavy"].columns, (c.text for c in t["serving_heavy"].rows[1])))
    assert row["condition"] == "nvfp4+a=nvfp4"
    assert row["ceiling gap to default"] == row["loss vs default"] == "n/a"


def test_a_configuration_recorded_in_each_regime_reads_the_same(tmp_path, served):
    """eval-drift's passes may record the configuration in each regime's entry instead."""
    data = copy.deepcopy(served)
    for name, info in data["variants"].items():
        configuration = info.pop("configuration")
        for block in data["regimes"].values():
            block["variants"][name]["configuration"] = configuration
    (tmp_path / "top").mkdir()
    (tmp_path / "regimes").mkdir()
    top, regimes = _card(tmp_path / "top", served), _card(tmp_path / "regimes", data)
    assert tables(regimes)["serving_conditions"].rows == tables(top)["serving_conditions"].rows
    assert render(regimes, "md") == render(top, "md")


def test_results_without_configurations_get_no_section_and_the_same_card(tmp_path, tiny):
    explicit = copy.deepcopy(tiny)
    for info in explicit["variants"].values():
        info["configuration"] = dict(DEFAULTS)
    texts = []
    for name, data in (("plain", tiny), ("explicit", explicit)):
        (tmp_path / name).mkdir()
        texts.append(render(_card(tmp_path / name, data), "md"))
    assert texts[0] == texts[1]
    assert "Serving conditions" not in texts[0] and "serving_" not in texts[0]


def test_md_json_and_html_render_the_section(tmp_path, served):
    card = _card(tmp_path, served)
    md, page = render(card, "md"), render(card, "html")
    assert "## Serving conditions" in md and f"| {KV_WORDS} |" in md
    assert "<h2>Serving conditions</h2>" in page and KV_WORDS in page
    by_key = {
        t["key"]: t for s in json.loads(render(card, "json"))["sections"] for t in s["tables"]
    }
    assert by_key["serving_conditions"]["rows"][0]["what differs"] == KV_WORDS
    row = by_key["serving_heavy"]["rows"][0]
    assert row["condition"] == "bf16+kv=fp8_e4m3"
    loss = _variant(served, "heavy", "bf16+kv=fp8_e4m3")["acceptance"]["reference"]["loss_vs_bf16"]
    assert row[f"loss vs bf16, {VLLM_DEFAULT_MODE.label} [95% CI]"] == loss[MODE]


@pytest.mark.parametrize(
    "token, words, setting",
    [
        ("fp8+a=fp8-dynamic", "activations FP8 dynamic per token", "W8A16"),
        ("fp8+a=fp8-static", "activations FP8 static per tensor", "W8A16"),
        ("bf16+kv=fp8_e4m3+kvscale=calibrated", "KV cache fp8_e4m3, scale calibrated",
         '"kv_cache_dtype": "auto"'),
        ("bf16+kv=bfloat16", "KV cache bfloat16", '"kv_cache_dtype": "auto"'),
        ("bf16+target=nvfp4", "target weights nvfp4", "none on the draft side"),
        ("bf16+head=fp8", "drafting head fp8", '"draft_lm_head_quantization" unset'),
        ("nvfp4+a=nvfp4+kv=fp8", f"{NVFP4_WORDS}; KV cache fp8, scale 1.0", "W4A16"),
    ],
)  # fmt: skip
def test_every_field_is_named_in_words_with_its_vllm_setting(token, words, setting):
    said, avoided = condition_words(Variant.parse(token))
    assert said == words and setting in avoided, (said, avoided)


def test_an_unknown_configuration_value_is_one_error_naming_file_and_value(tmp_path, served):
    data = copy.deepcopy(served)
    data["variants"]["bf16+kv=fp8_e4m3"]["configuration"]["kv_cache"] = "fp9"
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        QStreamError, match=r"results.json: variant bf16\+kv=fp8_e4m3: kv_cache 'fp9'"
    ):
        write_card([path], tmp_path / "CARD.md", figures=False)
    assert list(tmp_path.iterdir()) == [path], "nothing written"


def test_measured_conditions_from_speculate_results(tmp_path):
    spec = json.loads((PAIR / "speculate.json").read_text())
    spec["variants"]["nvfp4+a=nvfp4"] = {**copy.deepcopy(spec["variants"]["mxfp4"]),
                                         **_info("nvfp4+a=nvfp4")}  # fmt: skip
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    rs = merge_results([PAIR / "results-synthetic.json", PAIR / "results-states.json"])
    card = build_card(rs, figures_dir=None, speculate=read_speculate(path, rs))
    t = tables(card)
    assert not any(key.startswith("serving_") and key != "serving_measured" for key in t)
    table = t["serving_measured"]
    row = dict(zip(table.columns, (c.text for c in table.rows[0])))
    summary = spec["variants"]["nvfp4+a=nvfp4"]["summary"]
    length, loss = summary["mean_acceptance_length"], summary["loss_vs_bf16"]
    unpaired = spec["variants"]["nvfp4"]["summary"]["mean_acceptance_length"]["value"]
    assert len(table.rows) == 1 and row["condition"] == "nvfp4+a=nvfp4"
    assert row["what differs"] == NVFP4_WORDS and row["same weights at default"] == "nvfp4"
    assert row["avoided in vLLM 0.32.0 by"] == "a weight-only checkpoint (vLLM's W4A16 scheme)"
    assert row["tokens per verification [95% CI]"] == (
        f"{length['value']:.2f} [{length['lo']:.2f}, {length['hi']:.2f}]"
    )
    assert (
        row["loss vs bf16 [95% CI]"]
        == f"{loss['value']:+.3f} [{loss['lo']:+.3f}, {loss['hi']:+.3f}]"
    )
    assert row["loss vs default"] == f"{unpaired - length['value']:+.3f} (unpaired)"
    assert f"{spec['settings']['rule']} verification" in table.caption


@pytest.mark.parametrize("width", [80, 100])
def test_eval_drift_prints_the_conditions_whole(served, width):
    """The terminal report (qstream/card/terminal.py) ends with the same tables, no cell split."""
    from test_terminal_width import _assert_fits, _report, _split_cells

    text = _report(served, width)
    _assert_fits(text, width)
    assert "Serving conditions: the variants served" in text and "Regime boot: what each" in text
    assert not _split_cells(served, text)
