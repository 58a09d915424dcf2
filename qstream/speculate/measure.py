"""What speculative decoding measures (docs/speculate.md, "Measured acceptance"): per draft
variant, the mean acceptance length (tokens emitted per verification: the accepted drafts plus
the bonus or correction token), the share of verifications that accept at least k drafted
tokens, and tokens per target forward, each with a 95% interval over prompts (the prompts are
the independent units; the verifications within one are not), and each variant's loss against
bf16, paired over the same prompts.

>>> study = acceptance_study(target, {"bf16": bf16_draft, "nvfp4": nvfp4_draft}, prompts, 64)
>>> study["nvfp4"]["mean_acceptance_length"]["value"]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from qstream.errors import QStreamError
from qstream.eval.estimates import Estimate, pooled_proportion, t_interval
from qstream.progress import Progress
from qstream.speculate.decode import Decoded, speculative_decode


def acceptance_study(
    target,
    drafts: Mapping[str, Any],
    prompts: list[list[int]],
    new_tokens: int,
    rule: str = "greedy",
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, dict]:
    """Each draft decodes every prompt (:func:`decode_prompts`) and is summarised by
    :func:`summarise`."""
    return {
        name: summarise(
            decode_prompts(target, draft, prompts, new_tokens, rule, temperature, seed),
            draft.config.block_size,
        )
        for name, draft in drafts.items()
    }


def decode_prompts(
    target,
    draft,
    prompts: list[list[int]],
    new_tokens: int,
    rule: str = "greedy",
    temperature: float = 1.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[Decoded]:
    """Every prompt decoded by ``draft``, prompt i with seed ``seed + i`` (the same for every
    draft, so that variants differ only by their drafts), each reported to ``progress``."""
    runs = []
    for i, p in enumerate(prompts):
        try:
            run = speculative_decode(target, draft, p, new_tokens, rule, temperature, seed + i)
        except QStreamError as exc:  # which prompt: the decode knows only the position
            raise QStreamError(f"prompt {i}: {exc}") from None
        runs.append(run)
        if progress is not None:
            progress.advance("", 1)
    return runs


def summarise(runs: list[Decoded], block_size: int) -> dict:
    """JSON-ready: ``mean_acceptance_length`` (1..B+1), ``accepted_at_least`` (k = 1..B),
    ``tokens_per_target_forward`` (the prefill included) and the counts."""
    steps = [torch.tensor(r.accepted, dtype=torch.float64) for r in runs]
    emitted, n_steps = _emitted_per_verification(runs)
    if not bool((n_steps > 0).all()):
        raise ValueError("every prompt needs at least one verification (more new tokens)")
    forwards = torch.tensor([float(r.forwards) for r in runs], dtype=torch.float64)
    tokens = torch.tensor([float(len(r.tokens)) for r in runs], dtype=torch.float64)
    width = int(n_steps.max())
    padded = torch.full((len(runs), width), -1.0, dtype=torch.float64)
    for i, s in enumerate(steps):
        padded[i, : len(s)] = s
    counted = padded >= 0
    return {
        "prompts": len(runs),
        "verifications": int(n_steps.sum()),
        "mean_acceptance_length": ratio_estimate(emitted, n_steps).to_json(),
        "accepted_at_least": [
            pooled_proportion(padded >= k, counted).to_json() for k in range(1, block_size + 1)
        ],
        "tokens_per_target_forward": ratio_estimate(tokens, forwards).to_json(),
    }


def ratio_estimate(y: torch.Tensor, m: torch.Tensor) -> Estimate:
    """``sum(y) / sum(m)`` over independent units i (y_i, m_i > 0), with a Student-t 95%
    interval from the ratio estimator's linearised variance."""
    return _influence_estimate(*_influence(y, m))


def paired_loss(base: list[Decoded], runs: list[Decoded]) -> Estimate:
    """``base``'s mean acceptance length minus ``runs``', both decoded from the same prompts in
    the same order, with a Student-t 95% interval from the linearised variance of the
    difference of the two ratio estimates, per prompt (the pairing cancels what the prompts
    share: a hard prompt is hard for both)."""
    if len(base) != len(runs):
        raise ValueError(f"paired over the same prompts: {len(base)} and {len(runs)} runs")
    r_base, z_base = _influence(*_emitted_per_verification(base))
    r_runs, z_runs = _influence(*_emitted_per_verification(runs))
    return _influence_estimate(r_base - r_runs, z_base - z_runs)


def _emitted_per_verification(runs: list[Decoded]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt, in float64: tokens its verifications emitted (accepted + 1 each), and how many."""
    y = [float(sum(a + 1 for a in r.accepted)) for r in runs]
    m = [float(len(r.accepted)) for r in runs]
    return torch.tensor(y, dtype=torch.float64), torch.tensor(m, dtype=torch.float64)


def _influence(y: torch.Tensor, m: torch.Tensor) -> tuple[float, torch.Tensor]:
    """r = ``sum(y) / sum(m)`` and each unit's zero-mean influence (y_i - r m_i) / mean(m)."""
    r = float(y.sum() / m.sum())
    return r, (y - r * m) / float(m.mean())


def _influence_estimate(value: float, z: torch.Tensor) -> Estimate:
    """``value`` with a Student-t 95% interval from zero-mean influences ``z`` of n units."""
    n = z.numel()
    if n < 2:
        return Estimate(value, math.nan, math.nan, n)
    return Estimate(value, *t_interval(value, n, math.sqrt(float((z**2).sum()) / (n * (n - 1)))), n)
