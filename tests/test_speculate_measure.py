"""The measures of qstream/speculate/decode.py on hand-made decodes (docs/speculate.md,
"Measured acceptance"): the mean acceptance length and the loss against bf16, paired over the
same prompts, against scipy's own estimators where the two coincide."""

from __future__ import annotations

import random

import pytest
from scipy import stats

from qstream.speculate.decode import Decoded, paired_loss, summarise


def decodes(seed: int, steps, block: int = 7) -> list[Decoded]:
    """One Decoded per prompt, ``steps[i]`` verifications each accepting 0..block drafts."""
    rng = random.Random(seed)
    out = []
    for n in steps:
        accepted = [rng.randint(0, block) for _ in range(n)]
        out.append(Decoded(tokens=[0] * sum(a + 1 for a in accepted), accepted=accepted,
                           forwards=n + 1))  # fmt: skip
    return out


def mean_length(runs: list[Decoded]) -> float:
    return summarise(runs, 7)["mean_acceptance_length"]["value"]


def test_the_loss_is_the_difference_of_the_two_means():
    base, other = decodes(0, [5, 9, 3, 12, 7]), decodes(1, [6, 4, 8, 10, 2])
    loss = paired_loss(base, other)
    assert loss.value == pytest.approx(mean_length(base) - mean_length(other), abs=1e-12)
    assert loss.lo < loss.value < loss.hi and loss.n == 5


def test_with_equal_verifications_per_prompt_it_is_the_paired_t_interval():
    """With the same number of verifications in every prompt the ratio estimates are plain
    means of per-prompt means, and the linearised interval is exactly the paired t-test's."""
    base, other = decodes(2, [6] * 9), decodes(3, [6] * 9)
    per_base = [sum(a + 1 for a in r.accepted) / 6 for r in base]
    per_other = [sum(a + 1 for a in r.accepted) / 6 for r in other]
    expected = stats.ttest_rel(per_base, per_other).confidence_interval(0.95)
    loss = paired_loss(base, other)
    assert (loss.lo, loss.hi) == pytest.approx((expected.low, expected.high), abs=1e-12)


def test_a_variant_against_itself_loses_nothing():
    base = decodes(4, [3, 8, 5])
    loss = paired_loss(base, base)
    assert (loss.value, loss.lo, loss.hi) == (0.0, 0.0, 0.0)


def test_pairing_needs_the_same_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        paired_loss(decodes(0, [3, 4]), decodes(1, [3]))
