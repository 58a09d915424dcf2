"""``qstream card --speculate`` refuses speculate results it cannot publish (docs/card.md,
"Inputs"): a value outside its quantity's range (tokens per verification in [1, B+1], shares in
[0, 1], losses against bf16 in [-B, B], counts non-negative integers), one share per drafted
position, no variant at all, or a missing key.  One ``Error:`` line naming the speculate file,
the key path and the value; exit 1; nothing written.

Every case edits the pair's checked-in speculate.json (examples/card_gsm8k_pair/, B = 7)."""

import copy
import json
import math
from pathlib import Path

import pytest
from cli_helpers import cli_error, cli_ok

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "card_gsm8k_pair"
RESULTS = [EXAMPLE / "results-synthetic.json", EXAMPLE / "results-states.json"]
FP8 = "variants.fp8.summary"


@pytest.fixture(scope="module")
def spec() -> dict:
    data = json.loads((EXAMPLE / "speculate.json").read_text())
    data.pop("runs")  # the card never reads the per-prompt runs
    return data


def _card(tmp_path: Path, data: dict, ok: bool = False) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))  # NaN as Python's json writes it
    args = ["card", *map(str, RESULTS), "--speculate", str(path),
            "--output", str(tmp_path / "CARD.md"), "--no-figures"]  # fmt: skip
    return cli_ok(args).output if ok else cli_error(args)


def _refused(tmp_path: Path, data: dict, expected: str) -> None:
    err = _card(tmp_path, data)
    assert f"{tmp_path / 'spec.json'}: {expected}" in err, err
    assert list(tmp_path.iterdir()) == [tmp_path / "spec.json"], "nothing else written"


def _with(data: dict, path: str, value) -> dict:
    """``data`` with the value at dotted ``path`` replaced."""
    out = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = out
    for part in parents:
        node = node[part]
    node[last] = value
    return out


@pytest.mark.parametrize(
    "key, value, low, high",
    [
        ("mean_acceptance_length", 42.0, 1, 8),
        ("mean_acceptance_length", -3.0, 1, 8),
        ("mean_acceptance_length", 0.5, 1, 8),
        ("tokens_per_target_forward", 8.5, 1, 8),
        ("loss_vs_bf16", 7.5, -7, 7),
        ("loss_vs_bf16", -9.0, -7, 7),
    ],
)
def test_a_value_outside_its_range_is_refused(tmp_path, spec, key, value, low, high):
    data = _with(spec, f"{FP8}.{key}", {"value": value, "lo": value - 1, "hi": value + 1, "n": 32})
    _refused(tmp_path, data, f"{FP8}.{key}.value = {value!r} is outside [{low}, {high}]")


def test_a_share_outside_zero_one_is_refused(tmp_path, spec):
    shares = copy.deepcopy(spec["variants"]["fp8"]["summary"]["accepted_at_least"])
    shares[2] = {"value": 1.5, "lo": 1.4, "hi": 1.6, "n": 1331}
    data = _with(spec, f"{FP8}.accepted_at_least", shares)
    _refused(tmp_path, data, f"{FP8}.accepted_at_least[2].value = 1.5 is outside [0, 1]")


def test_shares_that_grow_with_k_are_refused(tmp_path, spec):
    shares = copy.deepcopy(spec["variants"]["fp8"]["summary"]["accepted_at_least"])
    shares[3] = {"value": 0.9, "lo": 0.85, "hi": 0.95, "n": 1331}
    data = _with(spec, f"{FP8}.accepted_at_least", shares)
    _refused(tmp_path, data, f"{FP8}.accepted_at_least[3].value = 0.9 exceeds")


def test_a_value_outside_its_interval_is_refused(tmp_path, spec):
    data = _with(
        spec, f"{FP8}.mean_acceptance_length", {"value": 3.0, "lo": 3.5, "hi": 4.0, "n": 32}
    )
    _refused(tmp_path, data, f"{FP8}.mean_acceptance_length.value = 3.0 is outside its interval")


def test_a_non_finite_number_is_refused(tmp_path, spec):
    data = _with(spec, f"{FP8}.loss_vs_bf16", {"value": math.nan, "lo": None, "hi": None, "n": 32})
    _refused(tmp_path, data, f"{FP8}.loss_vs_bf16.value = nan is not a finite number")


@pytest.mark.parametrize("key, value", [("verifications", -1), ("prompts", 2.5), ("prompts", "32")])
def test_a_count_that_is_not_a_non_negative_integer_is_refused(tmp_path, spec, key, value):
    data = _with(spec, f"{FP8}.{key}", value)
    _refused(tmp_path, data, f"{FP8}.{key} = {value!r} is not a non-negative integer")


def test_no_variant_is_refused(tmp_path, spec):
    _refused(tmp_path, _with(spec, "variants", {}), "variants = {} names no variant")


def test_fewer_shares_than_the_block_size_name_the_speculate_file_and_key(tmp_path, spec):
    shares = spec["variants"]["fp8"]["summary"]["accepted_at_least"][:6]
    data = _with(spec, f"{FP8}.accepted_at_least", shares)
    _refused(tmp_path, data, f"{FP8}.accepted_at_least holds 6 entries, not one per k = 1..7")


@pytest.mark.parametrize(
    "path",
    ["settings.new_tokens", "provenance.target", "provenance.draft.block_size",
     "variants.fp8.summary", f"{FP8}.tokens_per_target_forward"],
)  # fmt: skip
def test_a_missing_key_is_named(tmp_path, spec, path):
    _refused(tmp_path, _with(spec, path, None), f"speculate results lack {path}")


def test_a_rule_that_names_no_mode_is_refused(tmp_path, spec):
    """settings.rule is a mode's name; results of schema speculate/1 name it as --rule did
    ("greedy"), speculate/2's (the shipped file's) by the name itself."""
    assert spec["schema"] == "qstream.speculate/2" and spec["settings"]["rule"] == "greedy/greedy"
    old = {**_with(spec, "settings.rule", "greedy"), "schema": "qstream.speculate/1"}
    for data in (spec, old):
        assert "wrote" in _card(tmp_path, data, ok=True)
        (tmp_path / "CARD.md").unlink()
    for data in (
        _with(old, "settings.rule", "typical"),
        _with(spec, "settings.rule", "greedy"),
    ):
        _refused(tmp_path, data, f"settings.rule = {data['settings']['rule']!r} is not one of")


def test_a_block_size_other_than_the_drafts_is_refused(tmp_path, spec):
    data = _with(spec, "provenance.draft.block_size", 8)
    _refused(tmp_path, data, "provenance.draft.block_size = 8, but the eval-drift results'")


def test_the_shipped_file_and_null_intervals_are_accepted(tmp_path, spec):
    """A mean from one prompt has no interval (null bounds), and a t interval may reach past
    the range its value is held to: both are published."""
    data = _with(
        spec, f"{FP8}.mean_acceptance_length", {"value": 1.2, "lo": None, "hi": None, "n": 1}
    )
    data = _with(data, f"{FP8}.loss_vs_bf16", {"value": 0.1, "lo": -7.5, "hi": 7.7, "n": 32})
    assert "wrote" in _card(tmp_path, data, ok=True)


@pytest.mark.parametrize(
    "key, value",
    [("loss_vs_bf16", 0.5), ("mean_acceptance_length", {"value": 3.0, "lo": "2.9", "hi": 3.1})],
)
def test_an_estimate_that_is_not_numbers_is_refused(tmp_path, spec, key, value):
    expected = f"{FP8}.{key} = {value!r} is not a {{value, lo, hi}} estimate of numbers"
    _refused(tmp_path, _with(spec, f"{FP8}.{key}", value), expected)


def test_a_card_with_measured_acceptance_is_rewritten_in_place(tmp_path, spec):
    """calibration.png is one of the card's own figures: writing the card again over itself
    replaces it instead of calling its figures folder someone else's."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    args = [
        "card",
        *map(str, RESULTS),
        "--speculate",
        str(path),
        "--output",
        str(tmp_path / "CARD.md"),
    ]
    cli_ok(args)
    assert (tmp_path / "CARD_files" / "calibration.png").is_file()
    cli_ok(args)
