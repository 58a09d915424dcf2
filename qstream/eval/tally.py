"""Acceptance per mode (``vocabulary.ACCEPTANCE_MODES``), tallied over the batches of one regime
for one drafter and one verifier, and summarised for the results: expected tokens emitted per
block and ``P(τ ≥ k)`` per position with their intervals, the adaptive modes derived from the
drafts' confidence scores (qstream/eval/adaptive.py), and the paired loss against bf16."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qstream.eval.adaptive import admitted_drafts, estimated_emitted, request_batches, truncated
from qstream.eval.estimates import (
    Estimate,
    mean_estimate,
    pooled_proportion,
    proportion,
    scaled,
)
from qstream.eval.settings import AdaptiveBudget
from qstream.eval.vocabulary import ACCEPTANCE_MODES


@dataclass(frozen=True)
class AcceptanceSummary:
    """Expected tokens emitted per block (accepted + one resampled or bonus token, 1..B+1) and
    P(τ ≥ k) per position, each a mean over blocks with its 95% interval."""

    emitted: Estimate
    prefix_accept: tuple[Estimate, ...]

    def to_json(self) -> dict:
        return {
            "emitted": self.emitted.to_json(),
            "prefix_accept": [e.to_json() for e in self.prefix_accept],
        }


def summarise(accept: torch.Tensor, outcomes: bool = False) -> AcceptanceSummary:
    """``[n, B]`` per-block P(τ ≥ k) -> :class:`AcceptanceSummary` (Student t over blocks).
    ``outcomes``: the values are 0/1 outcomes (greedy), which get Wilson intervals instead —
    per position over blocks, and for the emitted tokens ``1 + B ·`` the pooled share on the
    design-effect sample size — so that a run where every block is accepted does not report
    the zero-width interval Student t gives there."""
    B = accept.shape[1]
    if outcomes:
        hits = accept > 0.5
        return AcceptanceSummary(
            emitted=scaled(pooled_proportion(hits), B, offset=1.0),
            prefix_accept=tuple(proportion(hits[:, k]) for k in range(B)),
        )
    return AcceptanceSummary(
        emitted=mean_estimate(1 + accept.sum(dim=1), bounds=(1.0, B + 1.0)),
        prefix_accept=tuple(mean_estimate(accept[:, k], bounds=(0.0, 1.0)) for k in range(B)),
    )


class AcceptanceAccumulator:
    """Per-block acceptance of one drafter against one verifier, batch by batch, per mode
    (``vocabulary.ACCEPTANCE_MODES``), and the drafter's confidence scores per draft method, from
    which the adaptive modes are derived when the results are read (their batches span the
    whole evaluation; ``adaptive``'s batches are shuffled by ``seed``).  :meth:`emitted` gives
    the per-block values for paired comparisons."""

    def __init__(self, temperature: float, adaptive: AdaptiveBudget, seed: int) -> None:
        self.temperature, self.adaptive, self.seed = temperature, adaptive, seed
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._confidence: dict[str, list[torch.Tensor]] = {}
        self._outcomes: set[str] = set()  # modes whose values are 0/1 outcomes
        self._admitted: dict[str, torch.Tensor] = {}

    def add(self, mode: str, accept: torch.Tensor, outcomes: bool = False) -> None:
        """One batch's ``[n, B]`` P(τ ≥ k) of a non-adaptive mode; ``outcomes``: they are 0/1."""
        if ACCEPTANCE_MODES[mode].adaptive:
            raise ValueError(f"{mode} is derived from its base mode, not added")
        self._parts.setdefault(mode, []).append(accept.double().cpu())
        if outcomes:
            self._outcomes.add(mode)

    def add_confidence(self, draft: str, confidence: torch.Tensor | None) -> None:
        """One batch's ``[n, B]`` confidence scores of the drafts made by ``draft`` (None: the
        model has no confidence head, and no adaptive mode is simulated)."""
        if confidence is not None:
            self._confidence.setdefault(draft, []).append(confidence.float().cpu())

    def modes(self) -> list[str]:
        """The modes held, in ACCEPTANCE_MODES order; an adaptive one when its base mode and its
        draft's confidence scores are both there."""
        return [key for key in ACCEPTANCE_MODES if self._holds(key)]

    def _holds(self, key: str) -> bool:
        mode = ACCEPTANCE_MODES[key]
        if not mode.adaptive:
            return key in self._parts
        return mode.base in self._parts and mode.draft in self._confidence

    def admitted(self, mode: str) -> torch.Tensor:
        """``[n]`` drafted tokens each block verifies under an adaptive ``mode``."""
        if mode not in self._admitted:
            confidence = torch.cat(self._confidence[ACCEPTANCE_MODES[mode].draft])
            batches = request_batches(confidence.shape[0], self.adaptive.requests, self.seed)
            self._admitted[mode] = admitted_drafts(confidence, batches, self.adaptive.budget_share)
        return self._admitted[mode]

    def accept(self, mode: str) -> torch.Tensor:
        spec = ACCEPTANCE_MODES[mode]
        if spec.adaptive:
            return truncated(self.accept(spec.base), self.admitted(mode))
        return torch.cat(self._parts[mode])

    def emitted(self, mode: str) -> torch.Tensor:
        """``[n]`` expected tokens emitted per block, in the order the batches were added."""
        return 1 + self.accept(mode).sum(dim=1)

    def to_json(self) -> dict:
        return {mode: self._mode_json(mode) for mode in self.modes()}

    def _mode_json(self, mode: str) -> dict:
        spec = ACCEPTANCE_MODES[mode]
        accept = self.accept(mode)
        B = accept.shape[1]
        out = {
            "mode": spec.to_json(self.temperature, self.adaptive.to_json()),
            **summarise(accept, outcomes=spec.base in self._outcomes).to_json(),
        }
        if spec.adaptive:
            admitted = self.admitted(mode)
            confidence = torch.cat(self._confidence[spec.draft])
            out["verified"] = admitted.double().mean().item()
            out["estimated_emitted"] = mean_estimate(
                estimated_emitted(confidence, admitted), bounds=(1.0, B + 1.0)
            ).to_json()
        return out


def paired_loss(floor: torch.Tensor, other: torch.Tensor, block_size: int) -> dict:
    """Mean per-block loss ``floor − other`` of emitted tokens (same blocks, same noise), with a
    Student-t 95% interval over blocks: the loss against bf16."""
    return mean_estimate(floor - other, bounds=(-block_size, block_size)).to_json()
