"""Activation calibration (docs/eval-drift.md, "Serving configurations"): the FP32 reference run
over a calibration set, recording the amax of what flows through named observation points, as
llm-compressor's static observers record it before compressed-tensors turns it into a scale
(``calculate_qparams``, ``generate_gparam``).  Two points: each quantized linear's input by
module (``LINEAR_INPUTS``) and what each attention's KV cache stores (``KV_CACHE``).

>>> observer = Observer()
>>> model = arch.build(config, weights, REFERENCE_VARIANT, "cpu", observer.served())
>>> ... run the model over the calibration set ...
>>> Calibration(observer.amax, source).input_amax("layers.0.mlp.gate_proj")

eval-drift's set (:func:`calibrate_regime`): blocks of the regime drawn with
:func:`calibration_seed`, none of them an evaluated block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qstream.arch.registry import architecture_of
from qstream.arch.weights import ServedLinears
from qstream.errors import QStreamError
from qstream.eval.batches import AuxStates, make_batches, propose
from qstream.eval.corpus import AnchorPlan, Corpus, sample_anchors
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
        """One more tensor at ``point`` for ``key``: QStreamError naming them if not finite."""
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
    amax: dict[str, dict[str, torch.Tensor]]  # Observer.amax
    source: dict  # how the set was drawn and how big it is (the results record it)

    def input_amax(self, module: str) -> torch.Tensor:
        """The amax of ``module``'s input (QStreamError when the set never reached it)."""
        seen = self.amax.get(LINEAR_INPUTS, {})
        if module not in seen:
            raise QStreamError(f"calibration: no input of {module} was observed")
        return seen[module]


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
    blocks: int = CALIBRATION_BLOCKS,
) -> Calibration:
    """The reference drafting calibration blocks of ``regime`` over ``corpus`` (aux states
    drawn with the calibration seed; boot's made by a reference that is not observed)."""
    s, seed = settings, calibration_seed(settings.seed)
    plan = calibration_plan(corpus, evaluated, min(blocks, s.blocks), config, seed)
    arch = architecture_of(config)
    maker = arch.build(config, weights, REFERENCE_VARIANT, s.device) if regime.causal else None

    def feed(model: Any) -> None:
        aux = AuxStates(regime, corpus, config, seed, s.scratch_dir)
        try:
            for batch in make_batches(plan, corpus, config):
                propose(model, aux.get(batch, maker), batch)
        finally:
            aux.close()

    source = {
        "regime": regime.name,
        "seed": seed,
        "blocks": int(plan.anchor.numel()),
        "drawn": "as the evaluated blocks, with the calibration seed; evaluated blocks left out",
    }
    return calibrate(config, weights, s.device, feed, source)


def calibrate(
    config: DraftConfig, weights: Any, device: Any, feed: Callable[[Any], Any], source: dict
) -> Calibration:
    """The FP32 reference built with its linears observed, run by ``feed(model)``."""
    observer = Observer()
    model = architecture_of(config).build(
        config, weights, REFERENCE_VARIANT, device, observer.served()
    )
    feed(model)
    return Calibration(observer.amax, source)
