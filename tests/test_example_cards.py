"""The checked-in model cards of the trained pairs (examples/card_gsm8k_pair/ and
examples/card_smollm2_pair/, written by ``python evals/calibration.py --card``): every table in
them is what ``qstream card`` writes today from the results files checked in beside them, so a
card cannot drift from its numbers or from the card code."""

from __future__ import annotations

from pathlib import Path

import pytest

from qstream.card.build import build_card
from qstream.card.measured import read_speculate
from qstream.card.results import merge_results
from qstream.tablefit import Table

ROOT = Path(__file__).resolve().parents[1]
# relative: a card records the paths it read; the GSM8K pair's and the SmolLM2 pair's
# (docs/calibration.md, "The study on SmolLM2"), both written by evals/calibration.py --card
PAIR_CARDS = [Path("examples") / "card_gsm8k_pair", Path("examples") / "card_smollm2_pair"]


def _results(example: Path) -> list[Path]:
    return [example / "results-synthetic.json", example / "results-states.json"]


@pytest.mark.parametrize("example", PAIR_CARDS, ids=str)
def test_every_table_of_the_pairs_card_is_what_the_card_writes(example, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = (example / "CARD.md").read_text()
    rs = merge_results(_results(example))
    spec = read_speculate(example / "speculate.json", rs)
    card = build_card(rs, figures_dir="CARD_files", speculate=spec)
    tables = [p for s in card.sections for p in s.parts if isinstance(p, Table)]
    keys = {t.key for t in tables}
    assert {"measured_acceptance", "measured_accepted_at_least", "calibration"} <= keys
    for table in tables:
        assert table.markdown() in text, table.key
    for name in ("calibration.png", "ceiling.png", "seq_agree.png", "kl.png"):
        assert f"(CARD_files/{name})" in text and (example / "CARD_files" / name).is_file()


@pytest.mark.parametrize("example", PAIR_CARDS, ids=str)
@pytest.mark.parametrize("regime", ["gauss", "heavy", "boot", "states"])
def test_the_pairs_card_covers_every_regime(regime, example, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert regime in merge_results(_results(example)).regimes


EAGLE3 = Path("examples") / "card_eagle3_pair"  # examples/eagle3_end_to_end.sh's output


def test_every_table_of_the_eagle3_pairs_card_is_what_the_card_writes(monkeypatch):
    """The trained EAGLE-3 draft's card (docs/eagle3.md, "A trained EAGLE-3 draft"): its
    tables are what ``qstream card`` writes today from the results checked in beside it."""
    monkeypatch.chdir(ROOT)
    text = (EAGLE3 / "CARD.md").read_text()
    rs = merge_results([EAGLE3 / "results.json"])
    spec = read_speculate(EAGLE3 / "spec.json", rs)
    card = build_card(rs, figures_dir="CARD_files", speculate=spec)
    tables = [p for s in card.sections for p in s.parts if isinstance(p, Table)]
    assert {"measured_acceptance", "measured_accepted_at_least"} <= {t.key for t in tables}
    for table in tables:
        assert table.markdown() in text, table.key
    assert sorted(rs.regimes) == ["boot", "gauss", "heavy"]
