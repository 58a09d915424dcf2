"""Activation calibration (docs/eval-drift.md, "Serving configurations"): the FP32 reference run
over a calibration set, recording the amax of what flows through named observation points, as
llm-compressor's static observers record it before compressed-tensors turns it into a scale
(``calculate_qparams``, ``generate_gparam``).  Two points: each quantized linear's input by
module (``LINEAR_INPUTS``) and what each attention's KV cache stores (``KV_CACHE``).
eval-drift's set is :func:`calibrate_regime`'s, quantize's :class:`CalibrationSet`'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qstream.arch.registry import architecture_of, load_config
from qstream.arch.weights import ServedLinears
from qstream.errors import QStreamError
from qstream.eval.batches import AuxStates, check_boot_compatible, make_batches, propose
from qstream.eval.corpus import AnchorPlan, Corpus, load_run_corpus, sample_anchors
from qstream.eval.states import read_states
from qstream.regimes import AUX_REGIMES, REGIMES, STATES
from qstream.serving import REFERENCE_VARIANT

if TYPE_CHECKING:
    from qstream.arch.interface import DraftConfig
    from qstream.eval.settings import DriftSettings
    from qstream.regimes import Regime

LINEAR_INPUTS = "linear_inputs"  # observation point: a linear's input, keyed by module
# observation point: what an attention's KV cache stores, keyed f"{attention}.k" and ".v"
# (attention: the checkpoint's module, "layers.0.self_attn"): Qwen3 K after k_norm and RoPE,
# and V; the K3 MLA's one entry, the latent and the rotated k_pe, under ".k" only
KV_CACHE = "kv_cache"
CALIBRATION_BLOCKS = 32  # blocks of a regime eval-drift calibrates on
CALIBRATION_SALT = 0xCA1B  # the calibration seed is the run's seed moved by this


def calibration_seed(seed: int) -> int:
    """The seed of a run's calibration set: reproducible from ``--seed``, never equal to it."""
    return (seed * 1_000_003 + CALIBRATION_SALT) % 2**63


class Observer:
    """``amax[point][key]``: the float32 max of |x| over everything observed there."""

    def __init__(self) -> None:
        self.amax: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, point: str, key: str, x: torch.Tensor) -> None:
        """One more tensor at ``point`` for ``key``; QStreamError naming them if not finite."""
        amax = x.detach().abs().amax().float().cpu()  # amax propagates NaN
        if not bool(torch.isfinite(amax)):
            raise QStreamError(
                f"calibration: the {point.replace('_', ' ')} of {key} hold NaN or Inf "
                "(the calibration set drives the reference to non-finite activations)"
            )
        seen = self.amax.setdefault(point, {})
        seen[key] = amax if key not in seen else torch.maximum(seen[key], amax)

    def linear_input(self, name: str, x: torch.Tensor) -> None:
        self.add(LINEAR_INPUTS, name.removesuffix(".weight"), x)

    def kv_cache(self, attention: str, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.add(KV_CACHE, f"{attention}.k", k)
        if v is not None:
            self.add(KV_CACHE, f"{attention}.v", v)

    def served(self) -> ServedLinears:
        """A model's linears served as stored, each input observed, and its KV caches."""
        return ServedLinears(observe=self.linear_input, observe_cache=self.kv_cache)


@dataclass(frozen=True)
class Calibration:
    """What a calibration run measured, and on what: eval-drift's static activation scales and
    quantize's stored ones (docs/quantize.md, "Calibration") both ask it."""

    amax: dict[str, dict[str, torch.Tensor]]  # Observer.amax
    # what the set was and how big: {"regime", "seed"} or {"captured", "sha256", "rows"}, with
    # "blocks" and "tokens" (positions the reference ran through); recorded as it is
    source: dict

    def input_amax(self, module: str) -> torch.Tensor:
        """The amax of ``module``'s input (QStreamError when the set never reached it)."""
        seen = self.amax.get(LINEAR_INPUTS, {})
        if module not in seen:
            raise QStreamError(f"calibration: no input of {module} was observed")
        return seen[module]

    def kv_amax(self, attention: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K amax, V amax) of what ``attention``'s cache stores (``layers.0.self_attn``); V is
        None for a cache that stores none (MLA's latent ‖ k_pe is all under K)."""
        seen = self.amax.get(KV_CACHE, {})
        if f"{attention}.k" not in seen:
            raise QStreamError(f"calibration: no KV cache of {attention} was observed")
        return seen[f"{attention}.k"], seen.get(f"{attention}.v")


def calibration_plan(
    corpus: Corpus, evaluated: AnchorPlan, blocks: int, config: DraftConfig, seed: int
) -> AnchorPlan:
    """``blocks`` blocks drawn as eval-drift draws its own (``sample_anchors``) with ``seed``,
    less any that is also an evaluated block (so the set may hold fewer)."""
    drawn = sample_anchors(
        corpus, blocks, config.block_size, seed,
        max_context=config.max_position_embeddings - config.block_size,
    )  # fmt: skip
    taken = set(zip(evaluated.stream.tolist(), evaluated.anchor.tolist()))
    keep = torch.tensor(
        [(s, p) not in taken for s, p in zip(drawn.stream.tolist(), drawn.anchor.tolist())]
    )
    if not bool(keep.any()):
        raise QStreamError(
            f"corpus {corpus.name}: every calibration block is an evaluated one; "
            "give a longer corpus"
        )
    return AnchorPlan(drawn.stream[keep], drawn.anchor[keep])


def calibrate_regime(
    regime: Regime,
    corpus: Corpus,
    evaluated: AnchorPlan,
    config: DraftConfig,
    weights: Any,
    settings: DriftSettings,
) -> Calibration:
    """eval-drift's: the reference drafting CALIBRATION_BLOCKS blocks of ``regime`` over
    ``corpus`` drawn with the calibration seed, none of them an evaluated block."""
    s, seed = settings, calibration_seed(settings.seed)
    plan = calibration_plan(corpus, evaluated, min(CALIBRATION_BLOCKS, s.blocks), config, seed)
    source = {
        "regime": regime.name,
        "seed": seed,
        "drawn": "as the evaluated blocks, with the calibration seed; evaluated blocks left out",
    }
    return calibrate_blocks(
        regime, corpus, plan, config, weights, s.device, seed, source, s.scratch_dir
    )


def calibrate_blocks(
    regime: Regime,
    corpus: Corpus,
    plan: AnchorPlan,
    config: DraftConfig,
    weights: Any,
    device: Any,
    seed: int,
    source: dict,
    scratch_dir: str | None = None,
) -> Calibration:
    """The reference drafting ``plan``'s blocks of ``corpus`` under ``regime`` (aux states drawn
    with ``seed``; boot's made by a reference that is not observed); ``source`` gains the set's
    size: its blocks, and the tokens run through (each stream's context up to its last anchor,
    and every block's)."""
    arch = architecture_of(config)
    maker = arch.build(config, weights, REFERENCE_VARIANT, device) if regime.causal else None

    def feed(model: Any) -> None:
        aux = AuxStates(regime, corpus, config, seed, scratch_dir)
        try:
            for batch in make_batches(plan, corpus, config):
                propose(model, aux.get(batch, maker), batch)
        finally:
            aux.close()

    context: dict[int, int] = {}  # stream -> its last anchor
    for stream, anchor in zip(plan.stream.tolist(), plan.anchor.tolist()):
        context[stream] = max(context.get(stream, 0), anchor)
    blocks = int(plan.anchor.numel())
    size = {"blocks": blocks, "tokens": sum(context.values()) + blocks * config.block_size}
    return calibrate(config, weights, device, feed, {**source, **size})


def calibrate(
    config: DraftConfig, weights: Any, device: Any, feed: Callable[[Any], Any], source: dict
) -> Calibration:
    """The FP32 reference built with its linears observed, run by ``feed(model)``."""
    refuse_uncalibrated(config)
    observer = Observer()
    model = architecture_of(config).build(
        config, weights, REFERENCE_VARIANT, device, observer.served()
    )
    feed(model)
    return Calibration(observer.amax, source)


def refuse_uncalibrated(config: DraftConfig) -> None:
    """One line when ``config``'s architecture is not calibrated yet (``not_calibrated``)."""
    why = architecture_of(config).not_calibrated
    if why is not None:
        raise QStreamError(f"static activation or KV-cache scales: {why}")


NO_BLOCKS = AnchorPlan(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


@dataclass(frozen=True)
class CalibrationSet:
    """quantize's ``--calibration SOURCE`` (docs/quantize.md, "Calibration"): a regime's blocks
    over eval-drift's default corpus (the draft's tokenizer, else ``target``'s), drawn as
    eval-drift draws its calibration blocks at the same ``--seed`` (none left out), or the
    first rows of captured target states, each drafted at its last anchor so that the whole row
    runs through the context."""

    source: str  # a regime (qstream.regimes.AUX_REGIMES) or captured states: a file or directory
    blocks: int = CALIBRATION_BLOCKS  # a regime's blocks; captured states' rows (one block each)
    seed: int = 0  # a regime's: the blocks and aux states of eval-drift --seed's calibration
    target: str | None = None  # lm_head (and embed_tokens) from here, as eval-drift --target

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise QStreamError(f"--calibration-blocks {self.blocks}: must be at least 1")

    def run(self, model_dir: str | Path) -> Calibration:
        """The FP32 reference of ``model_dir`` over the set, on the CPU (so the bytes quantize
        writes do not depend on its ``--device``); its source records the options that name
        it; a non-finite activation is a QStreamError naming the module."""
        config = load_config(model_dir)
        refuse_uncalibrated(config)
        options = {"calibration": self.source, "calibration_blocks": str(self.blocks)}
        corpus: Corpus
        if self.source in AUX_REGIMES:
            regime = REGIMES[self.source]
            if regime.causal:
                check_boot_compatible(config)
            corpus = load_run_corpus(model_dir, None, None, config, self.target)
            seed = calibration_seed(self.seed)
            source = {
                "regime": regime.name,
                "seed": seed,
                "corpus": {"name": corpus.name, "sha256": corpus.sha256},
                "drawn": "as eval-drift's calibration blocks at --seed, none left out",
            }
            plan = calibration_plan(corpus, NO_BLOCKS, self.blocks, config, seed)
            options["seed"] = str(self.seed)
        elif Path(self.source).exists():
            regime, seed = STATES, 0  # captured states draw no noise
            corpus = read_states(self.source, config, target=self.target)
            max_anchor = config.max_position_embeddings - config.block_size
            plan = first_rows(corpus, self.blocks, config.block_size, max_anchor)
            source = {
                "captured": self.source,
                "sha256": corpus.sha256,
                "rows": int(plan.stream.numel()),
                "drawn": "the first rows, each drafted at its last anchor",
            }
        else:
            raise QStreamError(
                f"--calibration {self.source}: neither a regime ({', '.join(AUX_REGIMES)}) nor "
                "captured states (a file or directory, docs/states.md)"
            )
        weights = architecture_of(config).load_weights(model_dir, self.target, config)
        if self.target is not None:
            options["target"] = self.target
        source["options"] = options
        return calibrate_blocks(regime, corpus, plan, config, weights, "cpu", seed, source)


def first_rows(corpus: Corpus, rows: int, block_size: int, max_anchor: int) -> AnchorPlan:
    """One block in each of the first ``rows`` streams that hold one, at its last anchor (a
    valid anchor as ``sample_anchors`` draws them: ``1 <= p < len - block_size``, ``p <=
    max_anchor``)."""
    picked = []
    for stream, ids in enumerate(corpus.streams):
        anchor = min(int(ids.numel()) - block_size - 1, max_anchor)
        if anchor >= 1:
            picked.append((stream, anchor))
        if len(picked) == rows:
            break
    if not picked:
        raise QStreamError(
            f"--calibration {corpus.name}: no row holds a block of {block_size} tokens after "
            "its first"
        )
    streams, anchors = zip(*picked)
    return AnchorPlan(torch.tensor(streams), torch.tensor(anchors))
