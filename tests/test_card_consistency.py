"""One number, one format across the card: every difference against bf16 in tokens is printed
with its sign and the same decimals wherever it appears, and the two parameter counts a card
shows say what each counts (docs/card.md, "What the card contains")."""

import re
from pathlib import Path

import pytest
from card_helpers import tables

from qstream.card.build import build_card
from qstream.card.checkpoints import CheckpointFacts, quantization_parts
from qstream.card.measured import read_speculate
from qstream.card.results import merge_results

ROOT = Path(__file__).parent.parent
PAIR = ROOT / "examples" / "card_gsm8k_pair"
TINY = ROOT / "examples" / "card_tiny" / "results.json"  # with sensitivity and acceptance
NUMBER = re.compile(r"[-+]?\d+\.\d+")
DIFFERENCE = re.compile(r"[-+]\d+\.\d{3}")  # signed, three decimals
WORDS = {"n/a", "(floor)", "not evaluated", "not simulated"}


@pytest.fixture(scope="module")
def pair_card():
    rs = merge_results([PAIR / "results-synthetic.json", PAIR / "results-states.json"])
    return build_card(rs, figures_dir=None, speculate=read_speculate(PAIR / "speculate.json", rs))


@pytest.fixture(scope="module")
def tiny_card():
    return build_card(merge_results([TINY]), figures_dir=None)


def _differences(card) -> dict[str, list[str]]:
    """Each difference column (a gap or a loss against bf16) of every table: its cells' text."""
    return {
        f"{table.key}: {column}": [row[i].text for row in table.rows]
        for table in tables(card).values()
        for i, column in enumerate(table.columns)
        if re.search(r"\b(gap|loss)\b", column)
    }


@pytest.mark.parametrize("which", ["pair_card", "tiny_card"])
def test_every_difference_is_signed_with_one_number_of_decimals(which, request):
    columns = _differences(request.getfixturevalue(which))
    assert len(columns) >= 4
    for name, cells in columns.items():
        numbers = [n for text in cells if text not in WORDS for n in NUMBER.findall(text)]
        assert numbers, name
        for n in numbers:
            assert DIFFERENCE.fullmatch(n), f"{name}: {n}"


def test_the_ceiling_gap_reads_the_same_in_both_tables(pair_card):
    """The ceiling table's gap (variant minus bf16) and the calibration table's ceiling loss
    (bf16 minus variant) are one number: the same digits, opposite signs, named apart."""
    t = tables(pair_card)
    ceiling, calibration = t["ceiling_greedy"], t["calibration"]
    gap = ceiling.columns.index("gauss gap to bf16")
    loss = calibration.columns.index("ceiling loss, gauss")
    gaps = {row[0].text: row[gap].text for row in ceiling.rows}
    for row in calibration.rows:
        flipped = row[loss].text.translate(str.maketrans("+-", "-+"))
        assert flipped == gaps[row[0].text], row[0].text
    assert not any("ceiling gap" in c for c in calibration.columns)


def test_the_model_parameter_count_says_what_it_counts(pair_card):
    (model,) = [r[1].text for r in tables(pair_card)["evaluation"].rows if r[0].text == "model"]
    assert "1,652,289 parameters" in model
    assert "embed_tokens it borrows from the target" in model and "lm_head" in model


def test_the_checkpoint_parameter_count_says_it_counts_its_files():
    facts = CheckpointFacts(Path("draft-fp8"), "fp8", 1000, 1_259_073, 995_328)
    (summary,) = [
        p for p in quantization_parts(facts) if getattr(p, "key", "") == "quantized_draft-fp8"
    ]
    label, value = summary.rows[0][0].text, summary.rows[0][1].text
    assert value == "995,328 / 1,259,073 (79.1%)"
    assert "in its files" in label and "borrowed" in label
