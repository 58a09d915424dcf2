"""quantize's calibration set, ``--calibration SOURCE`` (docs/quantize.md, "Calibration"): the
inputs the FP32 reference drafts while qstream/calibration.py observes it, for the static
scales a checkpoint stores.  A regime draws its blocks over the built-in GSM8K corpus as
eval-drift draws its calibration blocks at the same ``--seed`` (``calibration_plan``); captured
target states give their first rows, each drafted at its last anchor so that the whole row
runs through the context.

>>> calibration = CalibrationSet("heavy", blocks=32, seed=0).run("draft/")
>>> calibration.source  # {"regime": "heavy", "seed": ..., "blocks": 32, "tokens": ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qstream.arch.registry import architecture_of, load_config
from qstream.calibration import (
    CALIBRATION_BLOCKS,
    Calibration,
    calibrate_blocks,
    calibration_plan,
    calibration_seed,
)
from qstream.errors import QStreamError
from qstream.eval.batches import check_boot_compatible
from qstream.eval.corpus import AnchorPlan, Corpus
from qstream.eval.states import CapturedStates, read_states
from qstream.regimes import AUX_REGIMES, REGIMES, STATES, Regime

NO_BLOCKS = AnchorPlan(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


@dataclass(frozen=True)
class CalibrationSet:
    """What ``--calibration`` names; :meth:`run` measures it only when a static scheme needs
    it, after quantize has checked the input and the options."""

    source: str  # a regime (qstream.regimes.AUX_REGIMES) or captured states: a file or directory
    blocks: int = CALIBRATION_BLOCKS  # a regime's blocks; captured states' rows (one block each)
    seed: int = 0  # a regime's: the blocks and aux states of eval-drift --seed's calibration
    target: str | None = None  # lm_head (and embed_tokens) from here, as eval-drift --target

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise QStreamError(f"--calibration-blocks {self.blocks}: must be at least 1")

    def options(self) -> dict[str, str]:
        """The options that name this set, for quantize's recorded command line."""
        options = {"calibration": self.source, "calibration_blocks": str(self.blocks)}
        if self.source in AUX_REGIMES:
            options["seed"] = str(self.seed)
        if self.target is not None:
            options["target"] = self.target
        return options

    def run(self, model_dir: str | Path) -> Calibration:
        """The FP32 reference of ``model_dir`` over the set, on the CPU (so the bytes written
        do not depend on ``--device``); a non-finite activation is a QStreamError naming it."""
        config = load_config(model_dir)
        if self.source in AUX_REGIMES:
            regime, corpus, plan, source = self._regime(model_dir, config)
        else:
            regime, corpus, plan, source = self._states(config)
        weights = architecture_of(config).load_weights(model_dir, self.target, config)
        seed = source.get("seed", 0)  # captured states draw no noise
        return calibrate_blocks(regime, corpus, plan, config, weights, "cpu", seed, source)

    def _regime(self, model_dir: str | Path, config) -> tuple[Regime, Corpus, AnchorPlan, dict]:
        """eval-drift's default corpus (the draft's tokenizer, else ``target``'s) and its
        calibration draw at ``seed``."""
        # here: qstream.eval.drift imports qstream.quant (the sensitivity's selection)
        from qstream.eval.drift import load_run_corpus

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
        return regime, corpus, plan, source

    def _states(self, config) -> tuple[Regime, CapturedStates, AnchorPlan, dict]:
        if not Path(self.source).exists():
            raise QStreamError(
                f"--calibration {self.source}: neither a regime ({', '.join(AUX_REGIMES)}) nor "
                "captured states (a file or directory, docs/states.md)"
            )
        states = read_states(self.source, config, target=self.target)
        plan = first_rows(states, self.blocks, config.block_size,
                          config.max_position_embeddings - config.block_size)  # fmt: skip
        rows = int(plan.stream.numel())
        source = {
            "states": self.source,
            "sha256": states.sha256,
            "rows": rows,
            "drawn": "the first rows, each drafted at its last anchor",
        }
        return STATES, states, plan, source


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
