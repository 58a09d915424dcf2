"""qstream card refuses results it cannot publish: a non-finite number, a proportion outside
[0, 1] (a correlation outside [-1, 1]), a point estimate outside its own interval.  One
``Error:`` line naming the file and the JSON path, exit 1, nothing written; unbounded quantities
(KL, tokens per step, losses against bf16) and null values are published as they are.

Every case edits a real results file: tests/data/card_results.json (eval-drift, 48 blocks) and
examples/card_tiny/results.json (every study: acceptance, sensitivity)."""

import copy
import json
import math
from pathlib import Path

import pytest
from cli_helpers import cli_error, cli_ok

ROOT = Path(__file__).parent.parent
SMALL = ROOT / "tests" / "data" / "card_results.json"
FULL = ROOT / "examples" / "card_tiny" / "results.json"
MXFP4 = "regimes.heavy.variants.mxfp4"


@pytest.fixture(scope="module")
def small() -> dict:
    return json.loads(SMALL.read_text())


@pytest.fixture(scope="module")
def full() -> dict:
    return json.loads(FULL.read_text())


def _node(data: dict, path: str):
    """The object at a dotted results path (``a.b[2].c``)."""
    node = data
    for part in path.replace("[", ".[").split("."):
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    return node


def _edited(data: dict, path: str, **fields) -> dict:
    out = copy.deepcopy(data)
    _node(out, path).update(fields)
    return out


def _card(tmp_path: Path, data: dict, ok: bool) -> tuple[str, Path]:
    """Run ``qstream card`` on ``data`` written as results.json; (stderr or stdout, output)."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    out = tmp_path / "CARD.md"
    args = ["card", str(results), "--output", str(out), "--no-figures"]
    return (cli_ok(args).output if ok else cli_error(args)), out


def _refused(tmp_path: Path, data: dict, expected: str) -> None:
    err, out = _card(tmp_path, data, ok=False)
    assert f"{tmp_path / 'results.json'}: {expected}" in err, err
    assert list(tmp_path.iterdir()) == [tmp_path / "results.json"], "nothing else written"


def test_nan_point_value_is_refused(tmp_path, small):
    path = f"{MXFP4}.metrics.greedy_agree[0]"
    data = _edited(small, path, value=math.nan)
    _refused(tmp_path, data, f"{path}.value = nan is not a finite number")


def test_infinite_percentile_is_refused(tmp_path, small):
    data = _edited(small, f"{MXFP4}.metrics.kl", p99=math.inf)
    _refused(tmp_path, data, f"{MXFP4}.metrics.kl.p99 = inf is not a finite number")


def test_point_value_outside_its_interval_is_refused(tmp_path, small):
    path = f"{MXFP4}.metrics.greedy_agree_overall"
    e = _node(small, path)
    data = _edited(small, path, value=1.7)
    _refused(
        tmp_path, data, f"{path}.value = 1.7 is outside its interval [{e['lo']!r}, {e['hi']!r}]"
    )


def test_proportion_above_one_is_refused_even_inside_its_interval(tmp_path, small):
    path = f"{MXFP4}.metrics.rollouts.greedy.seq_agree[3]"
    data = _edited(small, path, value=1.2, lo=1.1, hi=1.3)
    _refused(tmp_path, data, f"{path}.value = 1.2 is outside [0, 1] (seq_agree is a proportion)")


@pytest.mark.parametrize(
    "path, key",
    [
        ("metrics.one_minus_tv[6]", "one_minus_tv"),
        ("metrics.sched_flip_rate", "sched_flip_rate"),
        ("metrics.rollouts.sampled.prefix_agree[0]", "prefix_agree"),
        ("acceptance.reference.probabilistic/block.prefix_accept[2]", "prefix_accept"),
    ],
)
def test_every_kind_of_share_is_bounded(tmp_path, full, path, key):
    data = _edited(full, f"{MXFP4}.{path}", value=-0.25, lo=-0.3, hi=-0.2)
    _refused(tmp_path, data, f"{MXFP4}.{path}.value = -0.25 is outside [0, 1] ({key} is a")


def test_correlation_outside_minus_one_one_is_refused(tmp_path, small):
    path = f"{MXFP4}.metrics.confidence_r"
    data = _edited(small, path, value=-1.2, lo=-1.3, hi=-1.1)
    _refused(tmp_path, data, f"{path}.value = -1.2 is outside [-1, 1] (confidence_r is a")


def test_the_sensitivity_section_is_checked_too(tmp_path, full):
    path = "regimes.gauss.sensitivity.cumulative[2].ceiling"
    data = _edited(full, path, value=math.nan)
    _refused(tmp_path, data, f"{path}.value = nan is not a finite number")


def test_every_problem_is_counted(tmp_path, small):
    data = _edited(small, f"{MXFP4}.metrics.kl", p99=math.inf, max=math.inf)
    err, _ = _card(tmp_path, data, ok=False)
    assert err.rstrip().endswith("(1 more such numbers)"), err


def test_unbounded_quantities_and_nulls_are_published(tmp_path, full):
    """KL, tokens per step and a loss against bf16 are not shares: large or negative values
    pass; a null value or interval (undefined, as eval-drift writes it) passes."""
    data = copy.deepcopy(full)
    mxfp4 = _node(data, MXFP4)
    mxfp4["metrics"]["kl"]["mean"].update(value=3.5, lo=3.25, hi=3.75)
    mxfp4["metrics"]["kl"]["max"] = 41.0
    mode = mxfp4["acceptance"]["reference"]["probabilistic/block"]
    assert mode["emitted"]["value"] > 1  # tokens per step, not a share
    mxfp4["acceptance"]["reference"]["loss_vs_bf16"]["probabilistic/block"].update(
        value=-0.5, lo=-0.75, hi=-0.25
    )
    mxfp4["metrics"]["confidence_r"].update(value=None, lo=None, hi=None)
    mxfp4["metrics"]["greedy_agree"][0].update(lo=None, hi=None)
    _, out = _card(tmp_path, data, ok=True)
    assert "3.50e+00 [3.25e+00, 3.75e+00]" in out.read_text()


def test_a_second_file_is_named_when_it_is_the_bad_one(tmp_path, small):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_edited(small, f"{MXFP4}.metrics.kl", median=-math.inf)))
    err = cli_error(["card", str(SMALL), str(bad), "--output", str(tmp_path / "c.md")])
    assert err.startswith(f"Error: {bad}: {MXFP4}.metrics.kl.median = -inf is not a finite")
