"""The verification modes (qstream/verification.py) are vLLM 0.32.0's settings under vLLM's own
names, checked against vLLM's SpeculativeConfig in the vLLM lane; each name is one mode, usable
as a CLI value and a key of a dotted results path, and every former name maps to a mode."""

from __future__ import annotations

import re

import pytest

from qstream.verification import (
    LEGACY_NAMES,
    MODES,
    SAMPLING_MODES,
    SPECULATE_MODES,
    VLLM_DEFAULT_MODE,
)


def test_each_name_is_one_mode_and_every_former_name_maps_to_one():
    assert [m.name for m in MODES.values()] == list(MODES)
    assert len(set(MODES.values())) == len(MODES)
    # no "." (the card names a number by its dotted path), "," or "=" (option syntax)
    assert all(re.fullmatch(r"[a-z]+/[a-z]+(\+adaptive)?", name) for name in MODES), list(MODES)
    assert set(SPECULATE_MODES) == {n for n, m in MODES.items() if not m.adaptive}
    assert set(LEGACY_NAMES.values()) == set(MODES.values())
    assert not set(LEGACY_NAMES) & set(MODES)


@pytest.mark.vllm
def test_the_modes_are_vllms_settings():
    from typing import get_args

    from vllm.config.speculative import DraftSampleMethod, RejectionSampleMethod, SpeculativeConfig

    fields = SpeculativeConfig.__dataclass_fields__
    assert {m.draft for m in MODES.values()} == set(get_args(DraftSampleMethod))
    # every rejection method but "synthetic", which draws acceptance from set rates
    assert {m.verifier for m in SAMPLING_MODES} == set(get_args(RejectionSampleMethod)) - {
        "synthetic"
    }
    default = (fields["draft_sample_method"].default, fields["rejection_sample_method"].default)
    assert (VLLM_DEFAULT_MODE.draft, VLLM_DEFAULT_MODE.verifier) == default
    assert fields["enable_adaptive_verification"].default is VLLM_DEFAULT_MODE.adaptive
