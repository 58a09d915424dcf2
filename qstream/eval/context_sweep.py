"""Long-context sweep: drift in buckets of context length on both sides of the
YaRN boundary (``original_max_position_embeddings``) up to ``max_position_embeddings``.

Each bucket draws its blocks from long streams (the corpus documents concatenated, EOS between
them; docs/context-sweep.md) and is a complete evaluation, run by the ``evaluate`` callable the
evaluator hands in.

>>> settings = DriftSettings(model="DRAFT_DIR", regime="heavy", formats=("bf16", "nvfp4"),
...                          context_lengths=default_edges(config), context_blocks=256)
>>> results = evaluate_drift(settings)
>>> [b["variants"]["nvfp4"]["metrics"]["rollouts"]["greedy"]["ceiling"]
...  for b in results["regimes"]["heavy"]["context_sweep"]["buckets"]]
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from qstream.arch.interface import DraftConfig
from qstream.errors import QStreamError
from qstream.eval.corpus import AnchorPlan, Corpus, sample_anchors
from qstream.eval.settings import DriftSettings

# Default bucket edges as multiples of original_max_position_embeddings (capped at
# max_position_embeddings): two buckets below the YaRN boundary, the rest above it.
DEFAULT_MULTIPLES = (0.25, 0.5, 1, 2, 4, 8, 16, 32)

Evaluate = Callable[[Corpus, AnchorPlan], dict]  # (streams, plan) -> {"variants": {...}}


def default_edges(config: DraftConfig) -> tuple[int, ...]:
    """Bucket edges (tokens of context) at DEFAULT_MULTIPLES x the YaRN boundary."""
    orig = config.original_max_position_embeddings
    cap = config.max_position_embeddings
    return tuple(sorted({min(cap, max(1, round(m * orig))) for m in DEFAULT_MULTIPLES}))


def long_streams(corpus: Corpus, eos_token_id: int, length: int) -> Corpus:
    """The corpus documents concatenated in order with ``eos_token_id`` after each, cut into
    consecutive streams of exactly ``length`` tokens (the remainder dropped)."""
    eos = torch.tensor([eos_token_id], dtype=torch.int64)
    joined = torch.cat([t for s in corpus.streams for t in (s, eos)])
    n = joined.numel() // length
    if n == 0:
        raise QStreamError(
            f"corpus {corpus.name} has {joined.numel()} tokens with separators, "
            f"fewer than one stream of {length} tokens"
        )
    digest = hashlib.sha256(f"{corpus.sha256}:{eos_token_id}:{length}".encode()).hexdigest()
    return Corpus(
        f"{corpus.name} (concatenated, EOS-separated, {length}-token streams)",
        digest,
        tuple(joined[: n * length].view(n, length)),
        corpus.tokenizer,
    )


def _side(lo: int, hi: int, boundary: int) -> str:
    if hi <= boundary:
        return "below"
    return "above" if lo >= boundary else "straddles"


def bucket_plans(
    config: DraftConfig, corpus: Corpus, settings: DriftSettings
) -> list[tuple[int, int, Corpus, AnchorPlan]]:
    """Each bucket [edge_i, edge_i+1) of ``settings.context_lengths``: (lo, hi, its long
    streams, its ``context_blocks`` anchors), checked against the config."""
    edges, B = settings.edges, config.block_size
    max_anchor = config.max_position_embeddings - B  # the block's positions stay inside the range
    if edges[-1] > config.max_position_embeddings:
        raise QStreamError(
            f"--context-lengths edge {edges[-1]} exceeds max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    if config.eos_token_id is None:
        raise QStreamError(
            "--context-lengths joins documents with the EOS token, but config.json "
            "has no eos_token_id"
        )
    buckets = []
    for lo, hi in zip(edges, edges[1:]):
        top = min(hi - 1, max_anchor)
        if top < lo:
            raise QStreamError(
                f"--context-lengths bucket [{lo}, {hi}): no anchor fits below "
                f"max_position_embeddings - block_size = {max_anchor}"
            )
        streams = long_streams(corpus, config.eos_token_id, top + B + 1)
        plan = sample_anchors(
            streams, settings.context_blocks, B, settings.seed, min_context=lo, max_context=top
        )
        buckets.append((lo, hi, streams, plan))
    return buckets


def context_sweep(
    config: DraftConfig,
    settings: DriftSettings,
    planned: list[tuple[int, int, Corpus, AnchorPlan]],
    evaluate: Evaluate,
) -> dict:
    """Evaluate each bucket of ``planned`` (:func:`bucket_plans`' buckets) (JSON-ready; the
    schema is in docs/eval-drift.md)."""
    boundary = config.original_max_position_embeddings
    buckets = []
    for lo, hi, streams, plan in planned:
        result = evaluate(streams, plan)
        buckets.append(
            {
                "lo": lo,
                "hi": hi,
                "side": _side(lo, hi, boundary),
                "streams": streams.identity(),
                "anchors": plan.to_json(),
                "variants": result["variants"],
            }
        )
    return {
        "edges": list(settings.edges),
        "yarn_boundary": boundary,
        "max_position_embeddings": config.max_position_embeddings,
        "buckets_per": "context length p of the block (tokens before its anchor), lo <= p < hi",
        "buckets": buckets,
    }
