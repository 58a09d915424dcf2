"""The aux states of the synthetic regimes (qstream/regimes.py, docs/eval-drift.md): each stream's
noise from a generator seeded by (seed, regime, stream index), so any subset of streams can be
regenerated alone; boot's are the reference's own (qstream/eval/batches.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from qstream.arch.interface import DraftConfig
from qstream.errors import QStreamError
from qstream.regimes import Regime

# heavy: a few channels come out tens to hundreds of times larger than the median, as the massive
# activations of real LLMs do (Sun et al., "Massive Activations in Large Language Models", 2024)
HEAVY_SIGMA = 1.5  # log-scale spread of per-channel magnitudes in the heavy regime


def _generator(seed: int, regime: Regime, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(
        ((seed * 1_000_003 + regime.salt) * 65_537 + stream) % 2**64  # torch's range
    )


def check_boot_compatible(config: DraftConfig) -> None:
    if config.target_hidden_size != config.hidden_size:
        raise QStreamError(
            f"the boot regime stands the draft's layers of width {config.hidden_size} in for "
            f"target layers of width {config.target_hidden_size}; the widths differ, use gauss "
            "or heavy"
        )


class SyntheticAuxChunks:
    """gauss / heavy aux states [S, pad_to, A] for the given corpus streams, zero past each stream's
    end, drawn in float32 and rounded to ``dtype``, a range of positions at a time.  Each stream's
    states come from its own generator, from position 0 on, so they never depend on how streams are
    batched, and a range continues the previous one: ranges give the rows of one whole draw (torch's
    CPU normal sampler works in groups of 16 values and A is a multiple of 16 in every preset and
    real model; tests/test_sensitivity_context.py checks).  A batch too big to hold (a long-context
    bucket at K3 width: one 131,072-token stream is 9.4 GB of bf16) is handed to a model's
    ``context`` this way (``qstream.arch.interface.AuxChunks``); ``rows(0, pad_to)``: all at once."""

    def __init__(
        self,
        regime: Regime,
        config: DraftConfig,
        stream_ids: list[int],
        stream_lengths: list[int],
        pad_to: int,
        seed: int,
        dtype: torch.dtype,
    ):
        if not regime.synthetic:
            raise ValueError(f"SyntheticAuxChunks handles gauss and heavy, not {regime.name!r}")
        self.shape = (len(stream_ids), pad_to, config.aux_size)
        self._lengths, self._dtype = stream_lengths, dtype
        self._generators = [_generator(seed, regime, s) for s in stream_ids]
        self._scales: torch.Tensor | None = None  # heavy's [A], fixed for a seed, for all streams
        if regime.channel_scales:
            gen = _generator(seed, regime, -1)
            self._scales = torch.exp(torch.randn(config.aux_size, generator=gen) * HEAVY_SIGMA)
        self._next = 0

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        if t0 != self._next:
            raise RuntimeError(f"aux rows must be taken in order: asked {t0}, next {self._next}")
        self._next = t1
        out = torch.zeros(self.shape[0], t1 - t0, self.shape[2], dtype=self._dtype)

        def draw(row: int) -> None:
            gen, length = self._generators[row], self._lengths[row]
            if min(t1, length) > t0:
                states = torch.randn(min(t1, length) - t0, self.shape[2], generator=gen)
                out[row, : states.shape[0]] = (
                    states if self._scales is None else states * self._scales
                )

        # torch's CPU sampler runs on one core; each stream has its own generator, so streams
        # are drawn side by side on all of them, the same values in any order
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            list(pool.map(draw, range(self.shape[0])))
        return out
