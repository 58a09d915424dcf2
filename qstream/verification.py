"""vLLM 0.32.0's verification modes (docs/acceptance.md, "Modes"): the one place a mode's name is
spelled, in eval-drift's results (``acceptance.VERIFIER.MODE``), speculate's ``--rule`` and
results, and the card; code asks the object (``mode.greedy_verifier``, ``mode.probabilistic``,
``mode.block``).  No torch: --help reads it.

A mode is three of vLLM's settings (vllm/config/speculative.py, ``SpeculativeConfig``):
``draft_sample_method`` (``DraftSampleMethod``: "greedy", the default, or "probabilistic"); the
verifier: ``rejection_sample_method`` (``RejectionSampleMethod``: "standard", the default,
token-wise, or "block"; read in vllm/v1/worker/gpu/spec_decode/rejection_sampler.py
``RejectionSampler.__init__``), or a request at temperature 0, which takes the kernel's
``is_greedy`` branch under either (rejection_sampler_utils.py ``_rejection_kernel``); and
``enable_adaptive_verification`` (default false).  Its name is ``DRAFT/VERIFIER[+adaptive]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class VerificationMode:
    draft: str  # draft_sample_method: "greedy" (the argmax at any temperature), "probabilistic"
    verifier: str  # rejection_sample_method ("standard", "block"), or "greedy": temperature 0
    adaptive: bool = False  # enable_adaptive_verification: drafts trimmed by confidence scores

    @property
    def name(self) -> str:
        return f"{self.draft}/{self.verifier}" + ("+adaptive" if self.adaptive else "")

    @property
    def probabilistic(self) -> bool:  # the rejection sampler reads q; a greedy draft is one-hot
        return self.draft == "probabilistic"

    @property
    def greedy_verifier(self) -> bool:
        return self.verifier == "greedy"

    @property
    def block(self) -> bool:  # Sun et al. 2024 block verification, else token-wise or greedy
        return self.verifier == "block"

    @property
    def base(self) -> VerificationMode:  # the same mode without adaptive verification
        return replace(self, adaptive=False)

    @property
    def label(self) -> str:  # a table's mode column: ``greedy draft × token-wise``
        draft = "greedy draft" if self.draft == "greedy" else "probabilistic"
        verify = {"standard": "token-wise", "block": "block", "greedy": "greedy (T=0)"}
        return f"{draft} × {verify[self.verifier]}" + (", adaptive" if self.adaptive else "")

    @property
    def verification(self) -> str:
        """The words before "verification" in a sentence: ``greedy``, or the label."""
        return "greedy" if self.greedy_verifier else self.label

    @property
    def vllm(self) -> str:  # the vLLM settings that select the mode
        vllm = f"draft_sample_method={self.draft}"
        if self.greedy_verifier:
            vllm += ", temperature=0 (either rejection_sample_method)"
        else:
            vllm += f", rejection_sample_method={self.verifier}"
        return vllm + (", enable_adaptive_verification=true" if self.adaptive else "")

    def to_json(self, temperature: float, adaptive: Mapping | None = None) -> dict:
        """The mode in the results: its parts and the vLLM settings that select it."""
        return {
            "draft": self.draft,
            "verification": self.verifier,
            "temperature": 0.0 if self.greedy_verifier else temperature,
            "adaptive": dict(adaptive) if self.adaptive and adaptive is not None else None,
            "label": self.label,
            "vllm": self.vllm,
        }


# vLLM 0.32's default (draft_sample_method "greedy", rejection_sample_method "standard") and the
# mode a published DSpark card reports; tables lead with these two.
VLLM_DEFAULT_MODE = VerificationMode("greedy", "standard")
CARD_MODE = VerificationMode("probabilistic", "block")
GREEDY_BLOCK = VerificationMode("greedy", "block")
PROBABILISTIC_STANDARD = VerificationMode("probabilistic", "standard")
GREEDY = VerificationMode("greedy", "greedy")
# In the order results list them.
MODES: dict[str, VerificationMode] = {m.name: m for m in (
    VLLM_DEFAULT_MODE, CARD_MODE, GREEDY_BLOCK, PROBABILISTIC_STANDARD, GREEDY,
    replace(VLLM_DEFAULT_MODE, adaptive=True), replace(CARD_MODE, adaptive=True))}  # fmt: skip
HEADLINE_MODES = (VLLM_DEFAULT_MODE, CARD_MODE)
ADAPTIVE_MODES = tuple(m for m in MODES.values() if m.adaptive)
# A sampling verifier's modes, which eval-drift simulates by rule (docs/acceptance.md, "Rules").
SAMPLING_MODES = tuple(m for m in MODES.values() if not (m.adaptive or m.greedy_verifier))
# What speculate decodes by (its --rule, greedy first: the default): adaptive verification's
# budget is a batch's, which one decoded prompt does not have.
SPECULATE_MODES = (GREEDY.name, *(n for n, m in MODES.items() if not m.adaptive and m != GREEDY))

# The names the modes had before they took vLLM's: eval-drift results' keys (schema
# qstream.eval-drift/2) and speculate's --rule values (schema qstream.speculate/1). The card
# reads those results by them; --rule still takes its old values, with a warning.
LEGACY_NAMES: dict[str, VerificationMode] = {
    **dict(zip(("greedy_draft_token_wise", "sampled_block", "greedy_draft_block",
                "sampled_token_wise", "greedy", "greedy_draft_token_wise_adaptive",
                "sampled_block_adaptive"), MODES.values(), strict=True)),  # in MODES order
    "greedy-sampling": VLLM_DEFAULT_MODE, "probabilistic": PROBABILISTIC_STANDARD,
    "block": CARD_MODE,
}  # fmt: skip
