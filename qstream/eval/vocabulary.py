"""The results vocabulary of ``qstream eval-drift`` (docs/eval-drift.md): every name the results
JSON uses that the evaluator writes and the card and commands read, and the labels built from a
run's own settings."""

from __future__ import annotations

from collections.abc import Mapping

from qstream.formats import FORMATS
from qstream.serving import FLOOR

SCHEMA = "qstream.eval-drift/3"  # the "schema" field of every results file

# Variants: the reference and the floor (qstream/serving.py), and the formats.
VARIANT_FORMATS = (FLOOR, *FORMATS)  # the default set of simulated variants

# Rollout modes of ``metrics.rollouts``: free-running greedy, and sampled on common random numbers.
ROLLOUT_MODES = ("greedy", "sampled")

# Who verifies the drafts (``acceptance.VERIFIER``), with the words a caption uses for it.
VERIFIERS = {"reference": "the FP32 reference", "target": "the captured target"}


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


def verifier_label(sampling: Mapping | None) -> str:
    """The verifier's sampling: ``T=1.0, top-p 0.95, top-k off``."""
    s = sampling or {}
    v = s.get("verifier") or {"top_p": s.get("top_p"), "top_k": None}
    top_k = "off" if v.get("top_k") is None else v.get("top_k")
    return f"T={s.get('temperature')}, top-p {v.get('top_p')}, top-k {top_k}"


def rollout_label(mode: str, sampling: Mapping | None) -> str:
    """The words for a rollout mode in a table or figure; the sampled one names the drafter's
    temperature and top-p, read from the results' ``sampling`` block, never assumed."""
    if mode == "greedy":
        return "greedy rollout"
    if mode == "sampled":
        s = sampling or {}
        drafter = s.get("drafter")
        if drafter is None:  # results written before the drafter and verifier were told apart
            return f"sampled rollout (T={s.get('temperature')}, top-p {s.get('top_p')})"
        top_p = drafter.get("top_p")
        shown = "full softmax" if top_p == 1 else f"top-p {top_p}"
        return f"sampled rollout (T={s.get('temperature')}, {shown})"
    raise ValueError(f"unknown rollout mode {mode!r}; choose from {', '.join(ROLLOUT_MODES)}")
