"""``qstream eval-drift`` as one library call, :func:`evaluate_drift` (docs/eval-drift.md), and
the long-context sweep's buckets (docs/context-sweep.md); one regime's work is passes.py."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

import qstream
from qstream.arch.family import load_noting_embed
from qstream.arch.interface import LM_HEAD, DraftConfig
from qstream.arch.registry import architecture_of, load_config
from qstream.checkpoint.files import sha256_file
from qstream.device import describe_device, resolve_device
from qstream.errors import QStreamError
from qstream.eval.batches import Batch, batch_flops, check_boot_compatible, make_batches
from qstream.eval.corpus import (
    AnchorPlan,
    Corpus,
    builtin_model_dir,
    load_run_corpus,
    read_anchor_plan,
    sample_anchors,
)
from qstream.eval.passes import RegimeRun, evaluate_regime
from qstream.eval.sensitivity import module_kinds, sensitivity_variant
from qstream.eval.settings import DEFAULT_EDGES, REFERENCE, STEPS, VARIANTS, DriftSettings
from qstream.eval.states import read_states
from qstream.eval.variants import check_variants_derived, refuse_quantized_model, settings_variants
from qstream.eval.verifiers import ACCEPTANCE_DEFINITIONS
from qstream.eval.vocabulary import CONFIDENCE_NOTE, SCHEMA
from qstream.progress import Progress, Silent
from qstream.regimes import REGIMES, STATES, Regime
from qstream.serving import DEFAULTS

__all__ = ["DriftSettings", "evaluate_drift"]

Batched = dict[int, tuple[Batch, ...]]  # id of a plan the run holds -> its batches
Buckets = list[tuple[int, int, Corpus, AnchorPlan]]  # bucket_plans


def _plan(corpus: Corpus, settings: DriftSettings, config: DraftConfig) -> AnchorPlan:
    B, top = config.block_size, config.max_position_embeddings - config.block_size
    return sample_anchors(corpus, settings.blocks, B, settings.seed, max_context=top)


def _resolved(
    settings: DriftSettings, corpus: Corpus | None, say: Callable[[str], None] | None
) -> tuple[DriftSettings, DraftConfig, Corpus]:
    """The settings with the built-in draft (announced through ``say``), the default context
    buckets and the shipped include list resolved; the config; the corpus, read unless given."""
    s, model = settings, settings.model
    if model is None:
        model = str(builtin_model_dir(say))
        where = " on the GSM8K test split shipped with qstream." if s.corpus is None else "."
        if say is not None:
            say(f"No --model given: evaluating the built-in synthetic tiny draft ({model}){where}")
    config = load_config(model)
    edges = default_edges(config) if s.context_lengths == DEFAULT_EDGES else s.context_lengths
    if corpus is None:
        corpus = load_run_corpus(model, s.corpus, s.tokenizer, config, s.target)
    include = s.include_layers or architecture_of(config).quantize_include
    return replace(s, model=model, context_lengths=edges, include_layers=include), config, corpus


def evaluate_drift(
    settings: DriftSettings,
    corpus: Corpus | None = None,
    say: Callable[[str], None] | None = None,
    progress: Progress | None = None,
) -> dict:
    """The JSON-ready results of every regime of ``settings`` (``corpus``: already loaded)."""
    resolve_device(settings.device)  # before any work: one line when there is no such GPU
    settings, config, corpus = _resolved(settings, corpus, say)
    model_dir, target = str(settings.model), settings.target
    progress = progress or Silent()
    progress.start(settings.planned_blocks())
    if any(REGIMES[r].causal for r in settings.regimes):
        check_boot_compatible(config)
    refuse_quantized_model(model_dir)
    progress.advance("loading the draft", 0)
    weights, embed = load_noting_embed(architecture_of(config), model_dir, target, config)
    variants = check_variants_derived(
        settings_variants(settings), model_dir, weights, settings.allow_foreign_variant
    )
    states = _read_states(settings, config, target)
    plan = _plan(corpus, settings, config)
    states_plan = _states_plan(states, settings, config)
    steps = _sensitivity_steps(weights, config, settings)
    buckets = bucket_plans(config, corpus, settings) if settings.context_lengths else []
    sets = [(corpus, plan), (states, states_plan), *[(s, p) for _, _, s, p in buckets]]
    # each set of blocks batched once: the passes run the batches the progress planned on
    batched = {id(p): make_batches(p, s, config) for s, p in sets if s and p}
    progress.start(*_planned(config, settings, steps, batched, plan, states_plan, buckets))
    results = _run_description(config, weights, corpus, plan, settings, variants, embed)

    def run(regime: Regime, streams: Corpus, blocks: AnchorPlan) -> RegimeRun:
        batches, fixed = batched[id(blocks)], (variants, settings, target, progress)
        return RegimeRun(regime, config, weights, streams, blocks, batches, *fixed)

    for name in settings.regimes:
        out = results["regimes"][name] = evaluate_regime(run(REGIMES[name], corpus, plan))
        if settings.context_lengths:
            out["context_sweep"] = context_sweep(run(REGIMES[name], corpus, plan), buckets, batched)
    if states is not None and states_plan is not None:
        anchors = states_plan.to_json()
        if settings.states_anchors is not None:  # named blocks, not drawn ones
            path = Path(settings.states_anchors)
            anchors.update(file=str(path), file_sha256=sha256_file(path))
        results["states"] = {**states.identity(), "anchors": anchors}
        results["regimes"][STATES.name] = evaluate_regime(run(STATES, states, states_plan))
    if settings.acceptance or states is not None:
        results["acceptance"] = ACCEPTANCE_DEFINITIONS
    return results


def _states_plan(states: Corpus | None, settings: DriftSettings, config: DraftConfig):
    if states is None or settings.states_anchors is None:
        return None if states is None else _plan(states, settings, config)
    return read_anchor_plan(settings.states_anchors, states, config.block_size)


def _sensitivity_steps(weights: Mapping, config: DraftConfig, settings: DriftSettings) -> int:
    """Sensitivity passes per regime: the floor, each kind alone, each kind added."""
    if not settings.sensitivity:
        return 0
    fmt = sensitivity_variant(settings).source
    return 1 + 2 * len(module_kinds(weights, fmt, config, settings.ignore_layers))


def _planned(config, settings, steps, batched, plan, states_plan, buckets):
    """Blocks and FLOPs per kind of pass of every pass the run will make (a bucket counts at its
    length: at K3 a 16k-token block's context costs as much as ~200 corpus blocks)."""
    blocks, work = 0, dict.fromkeys((REFERENCE, VARIANTS, STEPS), 0.0)

    def add(anchors: AnchorPlan, regime: Regime, steps: int) -> None:
        nonlocal blocks
        for b in batched[id(anchors)]:
            blocks += b.blocks.numel() * (1 + settings.n_variants + steps)
            work[REFERENCE] += batch_flops(config, b, regime.causal)
            work[VARIANTS] += settings.n_variants * batch_flops(config, b)
            work[STEPS] += steps * batch_flops(config, b)

    for regime in (REGIMES[name] for name in settings.regimes):
        add(plan, regime, steps)
        for _, _, _, anchors in buckets:
            add(anchors, regime, 0)
    if states_plan is not None:
        add(states_plan, STATES, steps)
    return blocks, work


def _read_states(settings: DriftSettings, config: DraftConfig, target: str | None):
    if settings.states is None:
        return None
    s = settings
    states = read_states(
        settings.states,
        config,
        format=s.states_format,
        layer_convention=s.states_layer_convention,
        layer_ids=s.states_layer_ids,
        target=target,
    )
    # the states' target: capture.json's target.format (qstream capture --target-format)
    recorded = (states.details["manifest"] or {}).get("target")
    captured = recorded.get("format") if isinstance(recorded, dict) else None
    for v in settings.simulated:
        if v.target != DEFAULTS["target"] and v.target != captured:
            raise QStreamError(f"variant {v.name}: target={v.target}, but --states "
                               f"{settings.states} was captured from the {captured or 'unquantized'} "
                               "target (capture.json's target.format)")  # fmt: skip
    return states


def context_sweep(run: RegimeRun, buckets: Buckets, batched: Batched) -> dict:
    """The regime's context sweep (docs/context-sweep.md): each bucket a full evaluation without
    sensitivity or sweep."""
    config, plain = run.config, replace(run.settings, sensitivity=False, context_lengths=())
    boundary = config.original_max_position_embeddings
    done = []
    for lo, hi, streams, plan in buckets:
        bucket = replace(run, corpus=streams, plan=plan, batches=batched[id(plan)], settings=plain)
        result = evaluate_regime(bucket)
        side = "below" if hi <= boundary else "above" if lo >= boundary else "straddles"
        done.append(
            {
                "lo": lo,
                "hi": hi,
                "side": side,
                "streams": streams.identity(),
                "anchors": plan.to_json(),
                "variants": result["variants"],
            }
        )
    return {
        "edges": list(run.settings.edges),
        "yarn_boundary": boundary,
        "max_position_embeddings": config.max_position_embeddings,
        "buckets_per": "context length p of the block (tokens before its anchor), lo <= p < hi",
        "buckets": done,
    }


def _run_description(config, weights, corpus, plan, settings, variants, embed) -> dict:
    """The results' top-level fields: how the numbers were measured (docs/eval-drift.md);
    ``embed``: how the draft's stored embed_tokens differ from the target's it serves with."""
    model_dir, target = str(settings.model), settings.target
    return {
        "schema": SCHEMA,
        "qstream_version": qstream.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "model": {
            "path": str(model_dir),
            "config_sha256": sha256_file(Path(model_dir) / "config.json"),
            "architecture": config.to_json().get("architectures", ["?"])[0],
            "parameters": sum(v.numel() for k, v in weights.items() if k != LM_HEAD),
            **({"embed_tokens": embed} if embed else {}),
        },
        "target": str(target) if target else None,
        "corpus": corpus.identity(),
        "seed": settings.seed,
        "blocks": settings.blocks,
        "block_size": config.block_size,
        "anchors": plan.to_json(),
        "sampling": settings.sampling.to_json(),
        "reference": "fp32 weights, fp32 compute",
        "variant_compute": "bf16 weights and activations; fp32 matmul accumulation, norms, "
        "softmax; final logits = bf16 sum of base logits and Markov bias",
        "confidence_head": CONFIDENCE_NOTE,
        "aux_dtype": "bf16",
        "compute": describe_device(torch.device(settings.device)),
        "selection": {
            "include": list(settings.include_layers),
            "ignore": list(settings.ignore_layers),
        },
        "variants": {
            v.name: {"kind": v.kind, "source": v.source, **v.served(), **v.checks()}
            for v in variants
        },
        "regimes": {},
    }


# Default bucket edges as multiples of original_max_position_embeddings, the YaRN boundary
# (capped at max_position_embeddings): two buckets below it, the rest above.
DEFAULT_MULTIPLES = (0.25, 0.5, 1, 2, 4, 8, 16, 32)


def default_edges(config: DraftConfig) -> tuple[int, ...]:
    orig, cap = config.original_max_position_embeddings, config.max_position_embeddings
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
    name = f"{corpus.name} (concatenated, EOS-separated, {length}-token streams)"
    return Corpus(name, digest, tuple(joined[: n * length].view(n, length)), corpus.tokenizer)


def bucket_plans(config: DraftConfig, corpus: Corpus, settings: DriftSettings) -> Buckets:
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
        n = settings.context_blocks
        plan = sample_anchors(streams, n, B, settings.seed, min_context=lo, max_context=top)
        buckets.append((lo, hi, streams, plan))
    return buckets
