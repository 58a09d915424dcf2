"""The results vocabulary of ``qstream eval-drift`` (docs/eval-drift.md): every name the results
JSON uses that the evaluator writes and the card and commands read, and the labels built from a
run's own settings.

>>> rollout_label("sampled", {"temperature": 0.7, "drafter": {"top_p": 1.0}})
'sampled rollout (T=0.7, full softmax)'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from qstream.formats import FORMATS
from qstream.serving import FLOOR, REFERENCE

SCHEMA = "qstream.eval-drift/2"  # the "schema" field of every results file

# Variants: the reference and the floor (qstream/serving.py), and the formats.
VARIANT_FORMATS = (FLOOR, *FORMATS)  # the default set of simulated variants
ALLOWED_FORMATS = (REFERENCE, *VARIANT_FORMATS)

# Rollout modes of ``metrics.rollouts``: free-running greedy, and sampled on common random numbers.
ROLLOUT_MODES = ("greedy", "sampled")

# Verification rules of a sampling verifier (docs/acceptance.md); vLLM's rejection_sample_method
# spells token-wise "standard".
RULES = ("token_wise", "block")
VLLM_RULES = {"token_wise": "standard", "block": "block"}
# How the drafter drafts: vLLM's draft_sample_method values ("greedy", its default: the argmax
# at any temperature; "probabilistic": the full tempered softmax).
DRAFT_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True)
class AcceptanceMode:
    """One way vLLM 0.32 serves a DSpark draft: a draft method, a verification rule ("greedy" is
    a verifier at temperature 0, whose argmax path vLLM takes under either rule) and whether
    adaptive verification trims the drafts by the confidence head's scores."""

    draft: str  # DRAFT_METHODS
    verification: str  # RULES, or "greedy"
    adaptive: bool = False

    @property
    def base(self) -> str:
        """The key of the same mode without adaptive verification."""
        return next(k for k, m in ACCEPTANCE_MODES.items() if m == replace(self, adaptive=False))

    @property
    def label(self) -> str:
        """Short words for a table's mode column: ``greedy draft × token-wise``."""
        draft = "greedy draft" if self.draft == "greedy" else "probabilistic"
        verify = {"token_wise": "token-wise", "block": "block", "greedy": "greedy (T=0)"}
        return f"{draft} × {verify[self.verification]}" + (", adaptive" if self.adaptive else "")

    def to_json(self, temperature: float, adaptive: Mapping | None = None) -> dict:
        """The mode in the results: qstream's words and the vLLM settings that select it."""
        vllm = f"draft_sample_method={self.draft}"
        if self.verification == "greedy":
            vllm += ", temperature=0 (either rejection_sample_method)"
        else:
            vllm += f", rejection_sample_method={VLLM_RULES[self.verification]}"
        if self.adaptive:
            vllm += ", enable_adaptive_verification=true"
        return {
            "draft": self.draft,
            "verification": self.verification,
            "temperature": 0.0 if self.verification == "greedy" else temperature,
            "adaptive": dict(adaptive) if self.adaptive and adaptive is not None else None,
            "label": self.label,
            "vllm": vllm,
        }


# The acceptance modes a results entry holds (``acceptance.VERIFIER.MODE``).  sampled_token_wise,
# sampled_block and greedy keep the keys they had before greedy drafts against a sampling
# verifier were simulated: "sampled" is the probabilistic draft.
ACCEPTANCE_MODES = {
    "greedy_draft_token_wise": AcceptanceMode("greedy", "token_wise"),
    "sampled_block": AcceptanceMode("probabilistic", "block"),
    "greedy_draft_block": AcceptanceMode("greedy", "block"),
    "sampled_token_wise": AcceptanceMode("probabilistic", "token_wise"),
    "greedy": AcceptanceMode("greedy", "greedy"),
    "greedy_draft_token_wise_adaptive": AcceptanceMode("greedy", "token_wise", adaptive=True),
    "sampled_block_adaptive": AcceptanceMode("probabilistic", "block", adaptive=True),
}
# vLLM 0.32's default (vllm/config/speculative.py: draft_sample_method "greedy",
# rejection_sample_method "standard") and the mode a published DSpark card reports; tables lead
# with these two.
VLLM_DEFAULT_MODE = "greedy_draft_token_wise"
CARD_MODE = "sampled_block"
HEADLINE_MODES = (VLLM_DEFAULT_MODE, CARD_MODE)
ADAPTIVE_MODES = tuple(k for k, m in ACCEPTANCE_MODES.items() if m.adaptive)
# Who verifies the drafts (``acceptance.VERIFIER``), with the words a caption uses for it.
VERIFIERS = {"reference": "the FP32 reference", "target": "the captured target"}


def acceptance_mode(draft: str, rule: str) -> str:
    """The key of drafting by ``draft`` verified by ``rule`` (not adaptive):
    ``("probabilistic", "block")`` -> ``sampled_block``."""
    for key, mode in ACCEPTANCE_MODES.items():
        if mode == AcceptanceMode(draft, rule):
            return key
    raise ValueError(
        f"no acceptance mode drafts {draft!r} and verifies by {rule!r}; drafts: "
        f"{', '.join(DRAFT_METHODS)}; rules: {', '.join(RULES)}, greedy"
    )


# The key of a rollout mode's mean matched prefix: under greedy drafting it is the ceiling on
# acceptance that survives the numerics; two sampled rollouts coupled on common noise can part
# where the verifier would still accept (acceptance there follows sum min(p, q)), so their matched
# prefix is a lower bound, reported under its own name (docs/eval-drift.md).
PREFIX_KEYS = {"greedy": "ceiling", "sampled": "matched_prefix"}
PREFIX_LABELS = {
    "greedy": "greedy ceiling",
    "sampled": "sampled matched prefix (coupling lower bound)",
}

# The confidence head's status in vLLM (docs/vllm.md); every confidence metric says it.
CONFIDENCE_NOTE = "head vLLM 0.32 runs in fp32 for adaptive verification"


def sampling_label(sampling: Mapping | None) -> str:
    """The drafter's sampling from the results' ``sampling`` block (the run's own settings):
    ``T=1.0, full softmax``, or ``T=1.0, top-p 0.9`` when a draft top-p was set."""
    s = sampling or {}
    drafter = s.get("drafter")
    if drafter is None:  # results written before the drafter and verifier were told apart
        return f"T={s.get('temperature')}, top-p {s.get('top_p')}"
    top_p = drafter.get("top_p")
    return f"T={s.get('temperature')}, " + ("full softmax" if top_p == 1 else f"top-p {top_p}")


def verifier_label(sampling: Mapping | None) -> str:
    """The verifier's sampling: ``T=1.0, top-p 0.95, top-k off``."""
    s = sampling or {}
    v = s.get("verifier") or {"top_p": s.get("top_p"), "top_k": None}
    top_k = "off" if v.get("top_k") is None else v.get("top_k")
    return f"T={s.get('temperature')}, top-p {v.get('top_p')}, top-k {top_k}"


def rollout_label(mode: str, sampling: Mapping | None) -> str:
    """The words for a rollout mode in a table or figure; the sampled one names the temperature
    and top-p it ran at, read from the results, never assumed."""
    if mode == "greedy":
        return "greedy rollout"
    if mode == "sampled":
        return f"sampled rollout ({sampling_label(sampling)})"
    raise ValueError(f"unknown rollout mode {mode!r}; choose from {', '.join(ROLLOUT_MODES)}")
