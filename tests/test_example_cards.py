"""The checked-in model card of the trained pair (examples/card_gsm8k_pair/, written by
``python evals/calibration.py --card``): every table in it is what ``qstream card`` writes today
from the results files checked in beside it, so the card cannot drift from its numbers or from
the card code."""

from __future__ import annotations

from pathlib import Path

import pytest

from qstream.card.build import build_card
from qstream.card.measured import read_speculate
from qstream.card.results import merge_results
from qstream.tablefit import Table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = Path("examples") / "card_gsm8k_pair"  # relative: the card records the paths it read
RESULTS = [EXAMPLE / "results-synthetic.json", EXAMPLE / "results-states.json"]


def test_every_table_of_the_pairs_card_is_what_the_card_writes(monkeypatch):
    monkeypatch.chdir(ROOT)
    text = (EXAMPLE / "CARD.md").read_text()
    rs = merge_results(RESULTS)
    spec = read_speculate(EXAMPLE / "speculate.json", rs)
    card = build_card(rs, figures_dir="CARD_files", speculate=spec)
    tables = [p for s in card.sections for p in s.parts if isinstance(p, Table)]
    keys = {t.key for t in tables}
    assert {"measured_acceptance", "measured_accepted_at_least", "calibration"} <= keys
    for table in tables:
        assert table.markdown() in text, table.key
    for name in ("calibration.png", "ceiling.png", "seq_agree.png", "kl.png"):
        assert f"(CARD_files/{name})" in text and (EXAMPLE / "CARD_files" / name).is_file()


@pytest.mark.parametrize("regime", ["gauss", "heavy", "boot", "states"])
def test_the_pairs_card_covers_every_regime(regime, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert regime in merge_results(RESULTS).regimes


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
