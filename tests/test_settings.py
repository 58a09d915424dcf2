"""eval-drift's and speculate's settings (qstream/eval/settings.py) are frozen objects whose
fields are the commands' options by name, each value checked once, when the object is built,
with the message the command prints for the same mistake: a library caller who skips the
command line gets the same words, and nothing downstream checks again."""

import math
from dataclasses import FrozenInstanceError, replace

import pytest

from qstream.errors import QStreamError
from qstream.eval.settings import AdaptiveBudget, DriftSettings, Sampling, Selection

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


def test_the_settings_take_the_command_s_options_by_name(tmp_path):
    """What eval-drift's command line gives, as click names it, builds the settings as it is."""
    import click

    from qstream.commands.eval_drift import eval_drift

    ctx = eval_drift.make_context("eval-drift", ["--variant", f"disk={tmp_path}"])
    options = {k: v for k, v in ctx.params.items() if k not in ("json_path", "wide")}
    settings = DriftSettings(**options)
    assert settings == DriftSettings(variant=(f"disk={tmp_path}",), states_format="auto")
    assert settings.variant_dirs == (("disk", str(tmp_path)),)
    assert isinstance(ctx, click.Context)


def test_the_run_holds_one_object_per_concern_with_the_commands_defaults():
    settings = DriftSettings()
    assert settings.regimes == ("heavy",) and settings.blocks == 1024
    assert settings.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=None, draft_top_p=1.0)
    assert settings.adaptive == AdaptiveBudget(8, 0.5)
    assert (settings.acceptance, settings.scratch_dir) == (False, None)
    with pytest.raises(FrozenInstanceError):
        settings.sampling.top_p = 0.5  # type: ignore[misc]


def test_a_changed_run_keeps_its_concerns_as_built():
    settings = DriftSettings(temperature=0.7, top_p=0.95, top_k=40, scratch_dir="/tmp")
    plain = replace(settings, sensitivity=False, context_lengths=())
    assert plain.sampling == Sampling(temperature=0.7, top_p=0.95, top_k=40)
    assert plain.scratch_dir == "/tmp"


@pytest.mark.parametrize(
    "regime, states, regimes",
    [(None, None, ("heavy",)), (None, "s.pt", ()), ("all", None, ("gauss", "heavy", "boot")),
     ("boot", None, ("boot",)), (("gauss", "boot"), None, ("gauss", "boot"))],
)  # fmt: skip
def test_the_regime_option_names_the_regimes(regime, states, regimes):
    assert DriftSettings(regime=regime, states=states).regimes == regimes


def test_a_bad_value_of_the_whole_run_is_refused_with_the_command_s_words(tmp_path):
    with pytest.raises(QStreamError, match="--temperature must be finite and > 0, got 0"):
        DriftSettings(temperature=0)
    with pytest.raises(QStreamError, match=r"--adaptive-budget must be in \[0, 1\], got 2"):
        DriftSettings(adaptive_budget=2)
    with pytest.raises(QStreamError, match="--blocks must be at least 1, got 0"):
        DriftSettings(blocks=0)
    with pytest.raises(QStreamError, match=f"--variant x: {tmp_path / 'no'} is not a directory"):
        DriftSettings(variant=(f"x={tmp_path / 'no'}",))
    with pytest.raises(QStreamError, match="--context-lengths needs at least two increasing"):
        DriftSettings(context_lengths="64,32")
    assert DriftSettings(context_lengths="32,64").context_lengths == (32, 64)
    assert DriftSettings(context_lengths="default").edges == ()


def test_speculate_shares_the_selection_not_the_drift_settings():
    from qstream.speculate.run import SpeculateSettings

    s = SpeculateSettings(target="T", model="D", formats=("bf16",), include_layers=("mlp.up_proj",))
    assert isinstance(s, Selection) and not isinstance(s, DriftSettings)
    with pytest.raises(QStreamError, match="variant names must be unique, got bf16, bf16"):
        SpeculateSettings(target="T", model="D", formats=("bf16", "bf16"))


def test_the_results_sampling_block_names_each_side():
    block = Sampling(temperature=0.7, top_p=0.9, top_k=20, draft_top_p=0.8).to_json()
    assert block["temperature"] == 0.7
    assert block["verifier"] == {"top_p": 0.9, "top_k": 20}
    assert block["drafter"]["top_p"] == 0.8 and block["drafter"]["top_k"] is None
    assert block["drafter"]["distribution"] == "softmax(logits / temperature), top-p cut"
