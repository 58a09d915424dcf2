"""One regime's evaluation (the ``regimes.REGIME`` block of docs/eval-drift.md): the FP32
reference drafts every block once, then each variant is built, drafts the same blocks on the same
aux states and noise, is compared, and is dropped before the next is built; the one place eval
meets bounded memory (docs/eval-drift.md, "Memory")."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from qstream.arch.interface import DraftConfig
from qstream.arch.markov import draft_vocab_size
from qstream.arch.registry import architecture_of
from qstream.bounded import Store, heap_hygiene
from qstream.calibration import Calibration, calibrate_regime
from qstream.checkpoint.safetensors_io import drop_resident_pages
from qstream.device import exact_math
from qstream.eval.batches import AuxStates, Batch, batch_flops, draft_batch
from qstream.eval.corpus import AnchorPlan, Corpus
from qstream.eval.metrics import DriftAccumulator
from qstream.eval.sensitivity import evaluate_sensitivity, sensitivity_variant, step_variant
from qstream.eval.settings import REFERENCE, STEPS, VARIANTS, DriftSettings
from qstream.eval.variants import Weights, served_linears, variant_weights, weight_snr
from qstream.eval.verifiers import RegimeAcceptance
from qstream.progress import Progress
from qstream.regimes import Regime
from qstream.serving import DEFAULTS, REFERENCE_VARIANT, Variant


@dataclass(frozen=True)
class RegimeRun:
    """Everything one regime's evaluation reads, fixed for the regime."""

    regime: Regime  # qstream/regimes.py: an aux regime or captured states
    config: DraftConfig
    weights: Weights  # the checkpoint's weights: the reference's, and every variant's source
    corpus: Corpus  # token streams (CapturedStates: the captured file's streams and states)
    plan: AnchorPlan  # the blocks to draft
    batches: tuple[Batch, ...]  # the plan in batches of whole streams (make_batches)
    variants: tuple[Variant, ...]
    settings: DriftSettings
    target: str | None  # checkpoint the draft borrows lm_head (and embed_tokens) from
    progress: Progress


@dataclass
class ReferenceOutputs:
    """What every variant is compared with (tokens, confidence in plan order; logits by batch)."""

    logits: Store  # [n, B, V] float32 per batch: teacher-forced = its own greedy rollout's
    greedy_tokens: torch.Tensor  # [N, B]
    sampled_tokens: torch.Tensor  # [N, B]
    confidence: torch.Tensor  # [N, B] (zeros when the model has no confidence head)


def evaluate_regime(run: RegimeRun) -> dict:
    """The regime's JSON-ready results entry: every variant against the reference, the
    verifiers' acceptance and the sensitivity steps."""
    s = run.settings
    with ExitStack() as kept:  # the stored per-block outputs are freed when the regime ends
        aux = AuxStates(run.regime, run.corpus, run.config, s.seed, s.scratch_dir)
        kept.callback(aux.close)
        probe = RegimeAcceptance(
            architecture_of(run.config).drafter, run.weights, run.plan, aux.captured, settings=s,
            config=run.config,
        )  # fmt: skip
        kept.callback(probe.close)
        N, B, V = run.plan.anchor.numel(), run.config.block_size, draft_vocab_size(run.config)
        logits = kept.enter_context(Store(s.scratch_dir, total_bytes=4 * N * B * V))
        with exact_math():  # the reference stays FP32 on a GPU; variants accumulate in fp32
            with heap_hygiene(reuse_freed=True):  # its fp32 temporaries reused, trimmed per batch
                ref = reference_pass(run, aux, probe, logits)
            probed: tuple[Variant, ...] = (sensitivity_variant(s),) if s.sensitivity else ()
            calibration = None  # on blocks of the regime not evaluated (docs/eval-drift.md)
            if any(v.calibrated for v in (*run.variants, *probed)):
                plan = (run.regime, run.corpus, run.plan, run.config, run.weights, s)
                calibration = calibrate_regime(*plan)
            out = {
                "variants": {
                    v.name: measure_variant(run, v, aux, ref, probe, calibration)
                    for v in run.variants
                }
            }
            if calibration is not None:
                out["calibration"] = calibration.source
        probe.finish(out)
        if s.sensitivity:  # the per-module steps, drift only
            # quantize --calibration takes a regime's name or the captured states' path
            source = str(s.states) if run.regime.captured else run.regime.name

            def step(name: str, include: tuple[str, ...]) -> dict:  # no include: the bf16 floor
                variant = step_variant(probed[0], name, include)
                return measure_variant(run, variant, aux, ref, None, calibration)

            out["sensitivity"] = evaluate_sensitivity(
                run.weights, probed[0], run.config, s, step, source
            )
    return out


def reference_pass(
    run: RegimeRun, aux: AuxStates, probe: RegimeAcceptance, logits: Store
) -> ReferenceOutputs:
    """The FP32 reference's drafts of every block (its logits into ``logits``, by batch)."""
    arch = architecture_of(run.config)
    reference = arch.build(run.config, run.weights, REFERENCE_VARIANT, run.settings.device)
    N, B = run.plan.anchor.numel(), run.config.block_size
    ref = ReferenceOutputs(
        logits,
        torch.empty(N, B, dtype=torch.int64),
        torch.empty(N, B, dtype=torch.int64),
        torch.zeros(N, B),
    )
    s = run.settings
    for number, batch in enumerate(run.batches):
        with heap_hygiene():  # the batch's freed temporaries leave the resident set
            state, greedy, sampled = draft_batch(
                reference, aux.get(batch, reference), batch, number, s.seed, s.sampling
            )
            idx = batch.blocks
            ref.logits.put(batch, greedy.logits)
            ref.greedy_tokens[idx] = greedy.tokens
            ref.sampled_tokens[idx] = sampled.tokens
            probe.add_reference(batch, state, greedy)
            if greedy.confidence is not None:
                ref.confidence[idx] = greedy.confidence
        work = batch_flops(run.config, batch, run.regime.causal)  # boot: + causal pass
        run.progress.advance(f"{run.regime.name}: reference", len(idx), work, REFERENCE)
    return ref


def measure_variant(
    run: RegimeRun,
    variant: Variant,
    aux: AuxStates,
    ref: ReferenceOutputs,
    probe: RegimeAcceptance | None,
    calibration: Calibration | None = None,
) -> dict:
    """One variant's results entry; ``probe`` None: drift only (a sensitivity step)."""
    s = run.settings
    kind = VARIANTS if probe is not None else STEPS  # a sensitivity step: drift only
    step = variant.weights.making
    if step:  # seconds to minutes at K3 scale: say so before the first block
        run.progress.advance(f"{run.regime.name}: {step} {variant.name}", 0, kind=kind)
    drop_resident_pages()  # the previous pass's weights; this one maps back what it reads
    var_weights, changed = variant_weights(variant, run.weights, run.config, s, run.target)
    snr = weight_snr(var_weights, run.weights, changed)
    if step:  # the variant is built (and its SNR taken): the time so far is that step's
        run.progress.advance(f"{run.regime.name}: {step} {variant.name}", 0, kind=kind)
    arch = architecture_of(run.config)
    served = served_linears(variant, run.weights, run.config, s, calibration)
    model = arch.build(run.config, var_weights, variant, s.device, served)
    acc = DriftAccumulator(run.config.block_size)
    accepted = probe.variant(variant.name) if probe is not None else None
    for number, batch in enumerate(run.batches):
        with heap_hygiene():
            state, greedy, sampled = draft_batch(
                model, aux.get(batch), batch, number, s.seed, s.sampling
            )
            idx = batch.blocks
            forced = arch.drafter.teacher_forced(state, ref.greedy_tokens[idx])
            acc.add_teacher_forced(ref.logits.get(batch), forced.logits)
            if forced.confidence is not None:
                acc.add_confidence(ref.confidence[idx], forced.confidence)
            acc.add_rollout("greedy", ref.greedy_tokens[idx], greedy.tokens)
            acc.add_rollout("sampled", ref.sampled_tokens[idx], sampled.tokens)
            if accepted is not None and probe is not None:
                probe.add_variant(accepted, batch, state, greedy, sampled)
        work = batch_flops(run.config, batch)
        run.progress.advance(f"{run.regime.name}: {variant.name}", len(idx), work, kind)
    served_as = variant.configuration()  # recorded when not the default (docs/eval-drift.md)
    return {
        "kind": variant.kind,
        **({"configuration": served_as} if served_as != DEFAULTS else {}),
        "quantized_tensors": changed,
        "weight_snr": snr,
        "metrics": acc.result().to_json(),
    }
