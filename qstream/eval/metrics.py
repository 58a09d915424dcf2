"""Drift metrics (docs/eval-drift.md, "Metrics"; intervals: estimates.py): pure functions over one
batch of drafted blocks, and the accumulator the evaluator feeds batch by batch.  Teacher-forced
logits are [n, B, V], both on the reference's prefix (log-probabilities work too); confidences
and each rollout mode's tokens [n, B].  Per-token results are kept as float64 [n, B]; the
[n, B, V] work runs in float64 chunks of blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from qstream.eval.estimates import (
    Estimate,
    json_number,
    mean_estimate,
    pearson_r,
    per_position,
    percentiles,
    pooled_mean,
    pooled_proportion,
    scaled,
)
from qstream.eval.vocabulary import CONFIDENCE_NOTE, PREFIX_KEYS

# The percentiles llama.cpp's perplexity --kl-divergence report gives (besides the mean).
KL_PERCENTILES = {"median": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p99_9": 0.999, "max": 1.0}

# float64 elements per [c, B, V] temporary in token_divergences (32 MiB); about five are alive at
# once, so a chunk costs ~160 MiB whatever V and the batch size are.
_CHUNK_ELEMENTS = 1 << 22


class TokenDivergence(NamedTuple):
    """Per-position comparison of two teacher-forced distributions, each ``[n, B]``."""

    top1_match: torch.Tensor  # bool: argmax equal (greedy agree)
    one_minus_tv: torch.Tensor  # float64: 1 − TV = Σ min(p, q)
    kl: torch.Tensor  # float64: KL(ref ‖ var)
    reverse_kl: torch.Tensor  # float64: KL(var ‖ ref)


def _check_pair(name: str, ref: torch.Tensor, var: torch.Tensor, ndim: int) -> None:
    if ref.ndim != ndim or ref.shape != var.shape:
        raise ValueError(
            f"{name}: reference {tuple(ref.shape)} and variant {tuple(var.shape)} "
            f"must have the same {ndim}-D shape"
        )


def _kl(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Σ_v p (log p − log q), with 0·log 0 = 0 so that tokens impossible under p add nothing."""
    terms = torch.where(p > 0, p * (log_p - log_q), 0.0)
    return terms.sum(dim=-1).clamp_min(0.0)


def _divergence_chunk(ref_logits: torch.Tensor, var_logits: torch.Tensor):
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)  # [c, B, V]
    log_q = torch.log_softmax(var_logits.double(), dim=-1)
    p, q = log_p.exp(), log_q.exp()
    one_minus_tv = (1 - 0.5 * (p - q).abs().sum(dim=-1)).clamp(0.0, 1.0)
    return one_minus_tv, _kl(p, log_p, log_q), _kl(q, log_q, log_p)


@torch.no_grad()
def token_divergences(ref_logits: torch.Tensor, var_logits: torch.Tensor) -> TokenDivergence:
    """Greedy match, 1−TV, KL and reverse KL per position of ``[n, B, V]`` logits: the argmax on
    the logits as given (the variant's own dtype), the distributions in float64 chunks."""
    _check_pair("logits", ref_logits, var_logits, ndim=3)
    n, width, vocab = ref_logits.shape
    if n == 0:
        raise ValueError("logits: a batch needs at least one block")
    step = max(1, _CHUNK_ELEMENTS // (width * vocab))
    chunks = [
        _divergence_chunk(ref_logits[i : i + step], var_logits[i : i + step])
        for i in range(0, n, step)
    ]
    one_minus_tv, kl, reverse_kl = (torch.cat(parts) for parts in zip(*chunks))
    top1_match = ref_logits.argmax(dim=-1) == var_logits.argmax(dim=-1)
    return TokenDivergence(top1_match, one_minus_tv, kl, reverse_kl)


def prefix_matches(ref_tokens: torch.Tensor, var_tokens: torch.Tensor) -> torch.Tensor:
    """``[n, B]`` bool: tokens 0..k of the two rollouts all equal (no mismatch at or before k)."""
    _check_pair("tokens", ref_tokens, var_tokens, ndim=2)
    return (ref_tokens != var_tokens).cumsum(dim=1) == 0


def sched_flips(
    ref_conf: torch.Tensor, var_conf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([n, B] flips, [n, B] decided)``: the above/below decision against the reference's
    per-block median confidence differs; positions exactly on the median decide nothing (counting
    them made any upward shift of 1e-6 flip one position in B)."""
    _check_pair("confidence", ref_conf, var_conf, ndim=2)
    ref, var = ref_conf.double(), var_conf.double()
    ordered = ref.sort(dim=1).values
    width = ref.shape[1]
    threshold = (ordered[:, (width - 1) // 2] + ordered[:, width // 2]).unsqueeze(1) / 2  # [n, 1]
    decided = ref != threshold
    return ((ref > threshold) != (var > threshold)) & decided, decided


@dataclass(frozen=True)
class KLSummary:
    """Mean (with interval) and llama.cpp's percentiles of per-token KL values."""

    mean: Estimate
    median: float
    p90: float
    p95: float
    p99: float
    p99_9: float
    max: float

    def to_json(self) -> dict:
        out: dict[str, Any] = {"mean": self.mean.to_json()}
        out.update({name: json_number(getattr(self, name)) for name in KL_PERCENTILES})
        return out


def kl_summary(values: torch.Tensor) -> KLSummary:
    return KLSummary(
        pooled_mean(values, bounds=(0.0, math.inf)), **percentiles(values, KL_PERCENTILES)
    )


@dataclass(frozen=True)
class RolloutMetrics:
    """Agreement of two free-running rollouts of ``B`` tokens per block."""

    seq_agree: tuple[Estimate, ...]  # per k: P(token k equal)
    prefix_agree: tuple[Estimate, ...]  # per k: P(tokens 0..k all equal)
    matched_prefix: Estimate  # mean matched prefix length, 0..B
    mode: str = "greedy"  # names the matched prefix in JSON (vocabulary.PREFIX_KEYS)

    @property
    def ceiling(self) -> Estimate:
        if self.mode != "greedy":
            raise AttributeError(f"a {self.mode} rollout has a matched prefix, not a ceiling")
        return self.matched_prefix

    def to_json(self) -> dict:
        return {
            "seq_agree": [e.to_json() for e in self.seq_agree],
            "prefix_agree": [e.to_json() for e in self.prefix_agree],
            PREFIX_KEYS[self.mode]: self.matched_prefix.to_json(),
        }


def rollout_metrics(
    ref_tokens: torch.Tensor, var_tokens: torch.Tensor, mode: str = "greedy"
) -> RolloutMetrics:
    """seq agree[k], prefix agree[k] and the mean matched prefix (B × the pooled prefix-agree
    share, with its interval) of ``[n, B]`` rollout tokens."""
    if mode not in PREFIX_KEYS:
        raise ValueError(f"unknown rollout mode {mode!r}; choose from {', '.join(PREFIX_KEYS)}")
    prefix = prefix_matches(ref_tokens, var_tokens)
    return RolloutMetrics(
        seq_agree=per_position(ref_tokens == var_tokens),
        prefix_agree=per_position(prefix),
        matched_prefix=scaled(pooled_proportion(prefix), float(prefix.shape[1])),
        mode=mode,
    )


@dataclass(frozen=True)
class DriftMetrics:
    """Every drift metric of one variant against the reference (docs/eval-drift.md)."""

    n_blocks: int
    block_size: int
    greedy_agree: tuple[Estimate, ...]  # per k, teacher-forced top-1 match
    greedy_agree_overall: Estimate  # over all positions
    one_minus_tv: tuple[Estimate, ...]  # per k
    one_minus_tv_overall: Estimate
    kl: KLSummary  # KL(ref ‖ var) per token
    reverse_kl: KLSummary  # KL(var ‖ ref) per token
    confidence_r: Estimate | None  # None: a draft without a confidence head (DFlash)
    sched_flip_rate: Estimate | None
    rollouts: dict[str, RolloutMetrics]  # by rollout mode, e.g. "greedy", "sampled"

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = [e.to_json() for e in v]
            elif isinstance(v, dict):
                v = {mode: m.to_json() for mode, m in v.items()}
            elif hasattr(v, "to_json"):
                v = v.to_json()
            out[f.name] = v
        out["confidence_head"] = CONFIDENCE_NOTE  # what confidence_r and sched_flip_rate describe
        return out


class DriftAccumulator:
    """One variant's per-token results, batch by batch of whole blocks; :meth:`result` checks
    every stream covers the same blocks and summarises them."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._divergence: list[TokenDivergence] = []
        self._confidence: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rollouts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _check_width(self, name: str, t: torch.Tensor) -> None:
        if t.ndim < 2 or t.shape[1] != self.block_size:
            raise ValueError(f"{name}: expected [n, {self.block_size}, ...], got {tuple(t.shape)}")

    def add_teacher_forced(self, ref_logits: torch.Tensor, var_logits: torch.Tensor) -> None:
        self._check_width("logits", ref_logits)
        self._divergence.append(
            TokenDivergence(*(t.cpu() for t in token_divergences(ref_logits, var_logits)))
        )

    def add_confidence(self, ref_conf: torch.Tensor, var_conf: torch.Tensor) -> None:
        self._check_width("confidence", ref_conf)
        _check_pair("confidence", ref_conf, var_conf, ndim=2)
        self._confidence.append(
            (ref_conf.detach().double().cpu(), var_conf.detach().double().cpu())
        )

    def add_rollout(self, mode: str, ref_tokens: torch.Tensor, var_tokens: torch.Tensor) -> None:
        self._check_width(f"{mode} tokens", ref_tokens)
        _check_pair(f"{mode} tokens", ref_tokens, var_tokens, ndim=2)
        self._rollouts.setdefault(mode, []).append((ref_tokens.cpu(), var_tokens.cpu()))

    def result(self) -> DriftMetrics:
        if not self._divergence:
            raise ValueError("no teacher-forced blocks were added")
        tf = TokenDivergence(*(torch.cat(parts) for parts in zip(*self._divergence)))
        ref_conf, var_conf = (
            (torch.cat(parts) for parts in zip(*self._confidence))
            if self._confidence
            else (torch.empty(0, self.block_size),) * 2
        )
        rollouts = {
            mode: tuple(torch.cat(parts) for parts in zip(*pairs))
            for mode, pairs in self._rollouts.items()
        }
        n = tf.kl.shape[0]
        head = bool(self._confidence)  # False: a draft without a confidence head
        counts = {
            **({"confidence": ref_conf.shape[0]} if head else {}),
            **{f"{m} rollout": r[0].shape[0] for m, r in rollouts.items()},
        }
        for name, count in counts.items():
            if count != n:
                raise ValueError(f"{name} covers {count} blocks but the teacher-forced pass {n}")
        return DriftMetrics(
            n_blocks=n,
            block_size=self.block_size,
            greedy_agree=per_position(tf.top1_match),
            greedy_agree_overall=pooled_proportion(tf.top1_match),
            one_minus_tv=tuple(
                mean_estimate(tf.one_minus_tv[:, k], bounds=(0.0, 1.0))
                for k in range(self.block_size)
            ),
            one_minus_tv_overall=pooled_mean(tf.one_minus_tv, bounds=(0.0, 1.0)),
            kl=kl_summary(tf.kl),
            reverse_kl=kl_summary(tf.reverse_kl),
            confidence_r=pearson_r(ref_conf, var_conf) if head else None,
            sched_flip_rate=pooled_proportion(*sched_flips(ref_conf, var_conf)) if head else None,
            rollouts={
                mode: rollout_metrics(ref, var, mode) for mode, (ref, var) in rollouts.items()
            },
        )
