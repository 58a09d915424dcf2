"""Drift of each variant against the FP32 reference (DESIGN.md section 6), regime by regime.

For one regime: the reference (fp32 weights, fp32 compute) drafts every block once; its
teacher-forced logits, rollouts and confidences are kept (float32, exact).  Then each variant is
built, run on the same aux states, anchors and noise, compared, and dropped before the next one
is built, so only one variant's weights sit beside the reference's outputs.

>>> settings = DriftSettings(regimes=("heavy",), formats=("bf16", "fp8"), n_blocks=256)
>>> results = evaluate_drift("DRAFT_DIR", settings, corpus_path="gsm8k/test.jsonl")
>>> results["regimes"]["heavy"]["variants"]["fp8"]["metrics"]["rollouts"]["greedy"]["ceiling"]
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import qstream
from qstream.errors import QStreamError
from qstream.eval.acceptance import ACCEPTANCE_DEFINITIONS, RegimeAcceptance
from qstream.eval.context_sweep import context_sweep
from qstream.eval.corpus import AnchorPlan, Corpus, sample_anchors
from qstream.eval.metrics import DriftAccumulator
from qstream.eval.regimes import REGIMES, check_boot_compatible, synthetic_aux
from qstream.eval.sensitivity import evaluate_sensitivity, sensitivity_format
from qstream.eval.states import read_states
from qstream.eval.vocabulary import (
    ALLOWED_FORMATS,
    FLOOR,
    REFERENCE,
    SCHEMA,
    STATES_REGIME,
    VARIANT_FORMATS,
)
from qstream.formats import FORMATS, snr_db, snr_sums
from qstream.model.config import DSparkConfig
from qstream.model.dspark import LM_HEAD, DSpark, rollout, teacher_forced
from qstream.model.load import QUANTIZE_INCLUDE, load_config, load_weights, simulate_format

# Aux states are handed over in bf16, as a bf16 target's hidden states are; the reference and
# every variant read the same rounded values.
AUX_DTYPE = torch.bfloat16
# Per-batch memory budgets: aux states [S, T, A] and logits [n, B, V] (float32 elements).
AUX_BUDGET = 1 << 26
LOGITS_BUDGET = 1 << 26
# Synthetic aux states kept between the reference and the variants of one regime.
AUX_CACHE_BYTES = 1 << 30
# Batches stop growing when their padded aux positions exceed the used ones by this factor
# (plus a floor, so that short streams still batch together).
PAD_SLACK = 1.25
MIN_BATCH_POSITIONS = 4096


@dataclass(frozen=True)
class DriftSettings:
    regimes: tuple[str, ...] = ("heavy",)
    formats: tuple[str, ...] = VARIANT_FORMATS  # simulated variants; FLOOR (bf16) is the floor
    variant_dirs: tuple[tuple[str, str], ...] = ()  # (name, quantized checkpoint directory)
    include: tuple[str, ...] = QUANTIZE_INCLUDE  # modules the simulated formats quantize
    ignore: tuple[str, ...] = ()
    n_blocks: int = 1024
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    # Simulated acceptance (qstream/eval/acceptance.py): the FP32 reference verifies each
    # variant's drafts, token-wise and by block verification
    acceptance: bool = False
    states: str | None = None  # captured target states (qstream/eval/states.py): the "states" regime
    # Per-module sensitivity (qstream/eval/sensitivity.py): one format, one module kind at a
    # time, then cumulatively; None picks nvfp4 or the first 4-bit format of ``formats``.
    sensitivity: bool = False
    sensitivity_format: str | None = None
    tolerance: float = 0.1  # tokens of greedy ceiling below the bf16 floor the include list may lose
    # Long-context sweep (qstream/eval/context_sweep.py): bucket edges in tokens; () = no sweep
    context_lengths: tuple[int, ...] = ()
    context_blocks: int = 256  # blocks per context bucket (each bucket is a full evaluation)

    def __post_init__(self) -> None:
        for regime in self.regimes:
            if regime not in REGIMES:
                raise QStreamError(f"unknown regime {regime!r}; choose from {', '.join(REGIMES)} "
                                   "or all")
        for fmt in self.formats:
            if fmt not in ALLOWED_FORMATS:
                raise QStreamError(f"unknown format {fmt!r}; choose from "
                                   f"{', '.join(ALLOWED_FORMATS)}")
        names = [*self.formats, *(name for name, _ in self.variant_dirs)]
        if len(set(names)) != len(names):
            raise QStreamError(f"variant names must be unique, got {', '.join(names)}")
        if self.n_blocks < 1:
            raise QStreamError(f"--blocks must be at least 1, got {self.n_blocks}")
        if not self.regimes and self.states is None:
            raise QStreamError("nothing to evaluate: no regime and no --states file")
        if self.sensitivity_format is not None and self.sensitivity_format not in FORMATS:
            raise QStreamError(f"--sensitivity-format {self.sensitivity_format!r}: choose from "
                               f"{', '.join(FORMATS)}")
        if not self.tolerance >= 0:
            raise QStreamError(f"--tolerance must be >= 0 tokens, got {self.tolerance}")
        edges = self.context_lengths
        if edges and (len(edges) < 2 or edges[0] < 1
                      or any(a >= b for a, b in zip(edges, edges[1:]))):
            raise QStreamError("--context-lengths needs at least two increasing bucket edges "
                               f">= 1, got {','.join(map(str, edges))}")
        if self.context_blocks < 1:
            raise QStreamError(f"--context-blocks must be at least 1, got {self.context_blocks}")


# ---------------------------------------------------------------------------------------------
# Batches: groups of whole streams, so a stream's context is computed once per batch


@dataclass(frozen=True)
class Batch:
    blocks: torch.Tensor  # [n] indices into the plan
    streams: list[int]  # corpus stream ids in this batch
    local_stream: torch.Tensor  # [n] row of each block's stream within ``streams``
    anchor: torch.Tensor  # [n]
    first_token: torch.Tensor  # [n]
    context_length: int  # positions of aux needed: max anchor in the batch


def make_batches(plan: AnchorPlan, corpus: Corpus, config: DSparkConfig) -> list[Batch]:
    """Split the plan into batches of whole streams.  Streams are taken in order of the context
    they need (their largest anchor), so a batch pads every stream to nearly the same length;
    a batch closes at the memory budgets or when padding would exceed ``PAD_SLACK``."""
    max_blocks = max(1, LOGITS_BUDGET // (config.block_size * config.vocab_size))
    need: dict[int, int] = {}
    blocks_of: dict[int, list[int]] = {}
    for block, (s, p) in enumerate(zip(plan.stream.tolist(), plan.anchor.tolist())):
        need[s] = max(need.get(s, 0), p)
        blocks_of.setdefault(s, []).append(block)
    batches: list[Batch] = []
    group: list[int] = []
    for s in sorted(need, key=lambda s: (need[s], s)):
        streams, longest = len(group) + 1, max(need[s], 1)
        used = sum(need[g] for g in group) + need[s]
        n_blocks = sum(len(blocks_of[g]) for g in group) + len(blocks_of[s])
        if group and (n_blocks > max_blocks or streams * longest * config.aux_size > AUX_BUDGET
                      or streams * longest > PAD_SLACK * max(used, 1) + MIN_BATCH_POSITIONS):
            batches.append(_batch(group, blocks_of, plan, corpus))
            group = []
        group.append(s)
    if group:
        batches.append(_batch(group, blocks_of, plan, corpus))
    return batches


def _batch(streams: list[int], blocks_of: dict[int, list[int]], plan: AnchorPlan,
           corpus: Corpus) -> Batch:
    idx = torch.tensor([b for s in streams for b in sorted(blocks_of[s])])
    row = {s: i for i, s in enumerate(streams)}
    anchor = plan.anchor[idx]
    first = torch.stack([corpus.streams[s][p] for s, p in zip(plan.stream[idx].tolist(),
                                                              anchor.tolist())])
    local = torch.tensor([row[s] for s in plan.stream[idx].tolist()])
    return Batch(idx, list(streams), local, anchor, first, int(anchor.max()))


# ---------------------------------------------------------------------------------------------
# The reference pass


@dataclass
class ReferenceOutputs:
    """What every variant is compared with, for the blocks of one regime (plan order)."""

    logits: torch.Tensor  # [N, B, V] float32: teacher-forced = its own greedy rollout's
    greedy_tokens: torch.Tensor  # [N, B]
    sampled_tokens: torch.Tensor  # [N, B]
    confidence: torch.Tensor  # [N, B] (zeros when the model has no confidence head)


def _aux_for(regime: str, batch: Batch, corpus: Corpus, config: DSparkConfig, seed: int,
             reference: DSpark | None, cache: dict[int, torch.Tensor]) -> torch.Tensor:
    """Aux states [S, T, A] (AUX_DTYPE) of one batch.  boot needs the reference model the first
    time and is cached (the states are the reference's own causal layer outputs); gauss and
    heavy are cached while the cache holds under AUX_CACHE_BYTES (drawing them again for every
    variant costs as much as a bf16 forward), else drawn again (they are deterministic)."""
    T = max(batch.context_length, 1)
    if regime == STATES_REGIME:  # captured: the file's own aux states (qstream/eval/states.py)
        return corpus.aux(batch.streams, T).to(AUX_DTYPE)
    key = id(batch)
    if regime != "boot":
        if key in cache:
            return cache[key]
        lengths = [int(corpus.streams[s].numel()) for s in batch.streams]
        aux = synthetic_aux(regime, config, batch.streams, lengths, T, seed).to(AUX_DTYPE)
        held = sum(t.numel() * t.element_size() for t in cache.values())
        if held + aux.numel() * aux.element_size() <= AUX_CACHE_BYTES:
            cache[key] = aux
        return aux
    if key not in cache:
        if reference is None:
            raise RuntimeError("boot aux states must come from the reference pass first")
        ids = torch.zeros(len(batch.streams), T, dtype=torch.int64)
        for row, s in enumerate(batch.streams):
            tokens = corpus.streams[s][:T]
            ids[row, : tokens.numel()] = tokens
        cache[key] = reference.causal_hidden(ids).flatten(2).to(AUX_DTYPE)  # [S, T, L*H]
    return cache[key]


def _draft(model: DSpark, aux: torch.Tensor, batch: Batch):
    ctx = model.context(aux)  # bf16 aux: the model converts once to its own dtype (exact)
    return model.draft(ctx, batch.local_stream, batch.anchor, batch.first_token)


def _drafts(model: DSpark, aux: torch.Tensor, batch: Batch, number: int,
            settings: "DriftSettings"):
    """One batch drafted by ``model``: its blocks, greedy rollout, and sampled rollout on the
    batch's shared race noise (the same for the reference and every variant)."""
    blocks = _draft(model, aux, batch)
    noise = race_noise(number, len(batch.blocks), model.config, settings.seed)
    return (blocks, rollout(model, blocks),
            rollout(model, blocks, noise, settings.temperature, settings.top_p))


def race_noise(batch_index: int, n_blocks: int, config: DSparkConfig, seed: int) -> torch.Tensor:
    """Exp(1) variates [n, B, V] for the sampled rollouts of one batch, shared by the reference
    and every variant (common random numbers): the same generator seed for the same batch, as
    one vLLM request seed gives the same draws."""
    gen = torch.Generator().manual_seed((seed * 7919 + 17) * 1_000_003 + batch_index)
    shape = (n_blocks, config.block_size, config.vocab_size)
    return torch.empty(shape).exponential_(generator=gen)


# ---------------------------------------------------------------------------------------------
# Variants


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "fp32", "bf16", "simulated" or "checkpoint"
    source: str  # the format, or the checkpoint directory
    include: tuple[str, ...] | None = None  # simulated: own patterns (sensitivity steps);
    # None: the settings' include list


def variant_weights(variant: Variant, reference_weights: dict[str, torch.Tensor],
                    config: DSparkConfig, settings: DriftSettings, target: str | None):
    """The variant's weights and the names of the tensors its format changed."""
    if variant.kind in ("fp32", "bf16"):
        return reference_weights, []
    if variant.kind == "simulated":
        # Shapes a block format cannot hold stay bf16, as --skip-incompatible writes them; the
        # results list which tensors were quantized (quantized_tensors, weight_snr.tensors).
        include = settings.include if variant.include is None else variant.include
        weights = simulate_format(reference_weights, variant.source, include=include,
                                  ignore=settings.ignore, skip_incompatible=True)
    else:
        other = load_config(variant.source)
        if other != config:
            raise QStreamError(f"variant {variant.name}: {variant.source} is a different "
                               "architecture than the reference model (config.json differs)")
        weights = load_weights(variant.source, target, other)
    changed = [k for k, v in weights.items()
               if k != LM_HEAD and not torch.equal(v.to(reference_weights[k].dtype), reference_weights[k])]
    return weights, changed


def _snr(weights, reference_weights, changed: list[str]) -> dict:
    """Weight SNR over the tensors a format changed (bf16: over every draft tensor)."""
    names = changed or [k for k in reference_weights if k != LM_HEAD]
    sums = [snr_sums(reference_weights[n], weights[n].to(torch.bfloat16)) for n in names]
    signal, noise = sum(s for s, _ in sums), sum(e for _, e in sums)
    finite = [snr_db(*pair) for pair in sums if pair[1] > 0]
    return {"tensors": len(names),
            "overall_db": None if noise == 0 else snr_db(signal, noise),
            "worst_db": min(finite) if finite else None}


# ---------------------------------------------------------------------------------------------
# The evaluation


def config_hash(model_dir: str | Path) -> str:
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def evaluate_drift(model_dir: str | Path, settings: DriftSettings, corpus: Corpus,
                   target: str | None = None,
                   progress: Callable[[str, int], None] | None = None) -> dict:
    """Run every regime of ``settings``; returns the JSON-ready results (schema in docs/)."""
    config = load_config(model_dir)
    if "boot" in settings.regimes:
        check_boot_compatible(config)
    weights = load_weights(model_dir, target, config)
    states = read_states(settings.states, config) if settings.states is not None else None
    plan = sample_anchors(corpus, settings.n_blocks, config.block_size, settings.seed,
                          max_context=config.max_position_embeddings - config.block_size)
    batches = make_batches(plan, corpus, config)
    variants = [Variant(f, f if f in (REFERENCE, FLOOR) else "simulated", f)
                for f in settings.formats]
    variants += [Variant(name, "checkpoint", path) for name, path in settings.variant_dirs]
    tick = progress or (lambda what, n: None)

    results = {
        "schema": SCHEMA,
        "qstream_version": qstream.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "model": {"path": str(model_dir), "config_sha256": config_hash(model_dir),
                  "architecture": config.to_json().get("architectures", ["?"])[0],
                  "parameters": sum(v.numel() for k, v in weights.items() if k != LM_HEAD)},
        "target": str(target) if target else None,
        "corpus": corpus.identity(),
        "seed": settings.seed,
        "blocks": settings.n_blocks,
        "block_size": config.block_size,
        "anchors": plan.to_json(),
        "sampling": {"temperature": settings.temperature, "top_p": settings.top_p,
                     "noise": "common random numbers: exponential race (Gumbel-max), the same "
                              "Exp(1) variate per block, position and token for every model"},
        "reference": "fp32 weights, fp32 compute",
        "variant_compute": "bf16 weights and activations; fp32 matmul accumulation, norms, softmax",
        "aux_dtype": "bf16",
        "selection": {"include": list(settings.include), "ignore": list(settings.ignore)},
        "variants": {v.name: {"kind": v.kind, "source": v.source} for v in variants},
        "regimes": {},
    }
    for regime in settings.regimes:
        results["regimes"][regime] = _evaluate_regime(
            regime, config, weights, corpus, plan, batches, variants, settings, target, tick)
        if settings.context_lengths:
            plain = replace(settings, sensitivity=False, context_lengths=())

            def at_lengths(streams: Corpus, bucket_plan: AnchorPlan, regime=regime) -> dict:
                return _evaluate_regime(regime, config, weights, streams, bucket_plan,
                                        make_batches(bucket_plan, streams, config), variants,
                                        plain, target, tick)
            results["regimes"][regime]["context_sweep"] = context_sweep(
                config, corpus, settings, at_lengths)
    if states is not None:
        states_plan = sample_anchors(states, settings.n_blocks, config.block_size, settings.seed,
                                     max_context=config.max_position_embeddings - config.block_size)
        results["states"] = {**states.identity(), "anchors": states_plan.to_json()}
        results["regimes"][STATES_REGIME] = _evaluate_regime(
            STATES_REGIME, config, weights, states, states_plan,
            make_batches(states_plan, states, config), variants, settings, target, tick)
    if settings.acceptance or states is not None:
        results["acceptance"] = ACCEPTANCE_DEFINITIONS
    return results


def _evaluate_regime(regime, config, weights, corpus, plan, batches, variants, settings,
                     target, tick) -> dict:
    boot_cache: dict[int, torch.Tensor] = {}
    probe = RegimeAcceptance(weights, plan, corpus, against_reference=settings.acceptance,
                             temperature=settings.temperature, top_p=settings.top_p,
                             block_size=config.block_size)
    reference = DSpark(config, weights, torch.float32)
    ref = _reference_pass(regime, reference, corpus, plan, batches, settings, boot_cache, tick,
                          probe)
    del reference
    out = {"variants": {}}

    def measure(variant: Variant, acceptance: bool = True) -> dict:
        """One variant against this regime's reference: its results entry.  ``acceptance``
        False skips the acceptance probe (sensitivity steps report drift only)."""
        var_weights, changed = variant_weights(variant, weights, config, settings, target)
        model = DSpark(config, var_weights,
                       torch.float32 if variant.kind == "fp32" else torch.bfloat16)
        acc = DriftAccumulator(config.block_size)
        accepted = probe.variant(variant.name) if acceptance else None
        for number, batch in enumerate(batches):
            aux = _aux_for(regime, batch, corpus, config, settings.seed, None, boot_cache)
            blocks, greedy, sampled = _drafts(model, aux, batch, number, settings)
            idx = batch.blocks
            forced = teacher_forced(model, blocks, ref.greedy_tokens[idx])
            acc.add_teacher_forced(ref.logits[idx], forced.logits)
            if forced.confidence is not None:
                acc.add_confidence(ref.confidence[idx], forced.confidence)
            acc.add_rollout("greedy", ref.greedy_tokens[idx], greedy.tokens)
            acc.add_rollout("sampled", ref.sampled_tokens[idx], sampled.tokens)
            if accepted is not None:
                probe.add_variant(accepted, batch, model, blocks, greedy, sampled)
            tick(f"{regime}: {variant.name}", len(idx))
        result = {
            "kind": variant.kind, "quantized_tensors": changed,
            "weight_snr": _snr(var_weights, weights, changed),
            "metrics": acc.result().to_json(),
        }
        del model, var_weights
        return result

    for variant in variants:
        out["variants"][variant.name] = measure(variant)
    probe.finish(out)
    if settings.sensitivity:
        fmt = sensitivity_format(settings)

        def step(name: str, include: tuple[str, ...]) -> dict:  # no include: the bf16 floor
            return measure(Variant(name, "simulated", fmt, include) if include
                           else Variant(name, "bf16", "bf16"), acceptance=False)
        out["sensitivity"] = evaluate_sensitivity(weights, fmt, settings, step)
    return out


def _reference_pass(regime, reference, corpus, plan, batches, settings, boot_cache,
                    tick, probe: RegimeAcceptance) -> ReferenceOutputs:
    c = reference.config
    N, B, V = plan.anchor.numel(), c.block_size, c.vocab_size
    ref = ReferenceOutputs(torch.empty(N, B, V), torch.empty(N, B, dtype=torch.int64),
                           torch.empty(N, B, dtype=torch.int64), torch.zeros(N, B))
    for number, batch in enumerate(batches):
        aux = _aux_for(regime, batch, corpus, c, settings.seed, reference, boot_cache)
        blocks, greedy, sampled = _drafts(reference, aux, batch, number, settings)
        idx = batch.blocks
        ref.logits[idx] = greedy.logits
        ref.greedy_tokens[idx] = greedy.tokens
        ref.sampled_tokens[idx] = sampled.tokens
        probe.add_reference(batch, reference, blocks)
        if greedy.confidence is not None:
            ref.confidence[idx] = greedy.confidence
        tick(f"{regime}: reference", len(idx))
    return ref
