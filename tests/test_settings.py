"""eval-drift's settings are one frozen object per concern (qstream/eval/settings.py), each
checked once, when it is built, with the message the command prints for the same mistake: a
library caller who skips the command line gets the same words, and nothing downstream checks
again."""

import math
from dataclasses import FrozenInstanceError, replace

import pytest

from qstream.errors import QStreamError
from qstream.eval.settings import (
    AdaptiveBudget,
    DriftSettings,
    Sampling,
    Scratch,
    Verification,
)

# (the object built with one bad field, the whole message)
MISTAKES = [
    (lambda: Sampling(temperature=0), "--temperature must be finite and > 0, got 0"),
    (lambda: Sampling(temperature=math.inf), "--temperature must be finite and > 0, got inf"),
    (lambda: Sampling(top_p=0), "--top-p must be in (0, 1], got 0"),
    (lambda: Sampling(top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
    (lambda: Sampling(draft_top_p=0), "--draft-top-p must be in (0, 1], got 0"),
    (lambda: Sampling(top_k=0), "--top-k must be >= 1 (or off), got 0"),
    (lambda: AdaptiveBudget(requests=0), "--adaptive-requests must be at least 1, got 0"),
    (lambda: AdaptiveBudget(budget_share=1.5), "--adaptive-budget must be in [0, 1], got 1.5"),
    (lambda: AdaptiveBudget(budget_share=math.nan), "--adaptive-budget must be in [0, 1], got nan"),
]


@pytest.mark.parametrize("build, message", MISTAKES, ids=[m for _, m in MISTAKES])
def test_each_concern_refuses_a_bad_value_when_built(build, message):
    with pytest.raises(QStreamError) as exc:
        build()
    assert str(exc.value) == message


def test_the_run_holds_one_object_per_concern_with_the_commands_defaults():
    settings = DriftSettings()
    assert settings.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=None, draft_top_p=1.0)
    assert settings.verification == Verification(False, AdaptiveBudget(8, 0.5))
    assert settings.scratch == Scratch(None)
    with pytest.raises(FrozenInstanceError):
        settings.sampling.top_p = 0.5  # type: ignore[misc]


def test_a_changed_run_keeps_its_concerns_as_built():
    sampling = Sampling(temperature=0.7, top_p=0.95, top_k=40)
    settings = DriftSettings(sampling=sampling, scratch=Scratch("/tmp"))
    plain = replace(settings, sensitivity=False, context_lengths=())
    assert plain.sampling is sampling and plain.scratch == Scratch("/tmp")


def test_the_results_sampling_block_names_each_side():
    block = Sampling(temperature=0.7, top_p=0.9, top_k=20, draft_top_p=0.8).to_json()
    assert block["temperature"] == 0.7
    assert block["verifier"] == {"top_p": 0.9, "top_k": 20}
    assert block["drafter"]["top_p"] == 0.8 and block["drafter"]["top_k"] is None
    assert block["drafter"]["distribution"] == "softmax(logits / temperature), top-p cut"
