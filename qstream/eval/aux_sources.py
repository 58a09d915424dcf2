"""The aux regimes of docs/eval-drift.md: what stands in for the target's hidden states.

The aux states are the only input shared between the reference and a variant; everything after
them (context projection, context K/V) each model computes itself.

- ``gauss``: iid N(0, 1).
- ``heavy``: N(0, 1) times a fixed per-channel lognormal scale, exp(N(0, HEAVY_SIGMA^2)): a few
  channels come out tens to hundreds of times larger than the median, as the massive activations
  of real LLMs do (Sun et al., "Massive Activations in Large Language Models", 2024).
- ``boot``: the draft's own layers run causally over the real token stream (the reference model,
  fp32); each layer's output stands in for one target layer, so the aux states carry the real
  token correlation of the corpus.  A draft with fewer layers than the target has aux layers
  runs its stack again on its own output until there is one output per aux layer
  (``qstream.arch.interface.causal_layers``).

Every regime is deterministic for a seed: gauss/heavy draw each stream's noise from a generator
seeded by (seed, regime, stream index), so any subset of streams can be regenerated alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from qstream.arch.interface import DraftConfig
from qstream.errors import QStreamError

REGIMES = ("gauss", "heavy", "boot")
DEFAULT_REGIME = "heavy"  # the pessimistic one (massive activation channels)
HEAVY_SIGMA = 1.5  # log-scale spread of per-channel magnitudes in the heavy regime
_REGIME_SALT = {"gauss": 101, "heavy": 202, "boot": 303}


def _generator(seed: int, regime: str, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(
        ((seed * 1_000_003 + _REGIME_SALT[regime]) * 65_537 + stream) % 2**64  # torch's range
    )


def channel_scales(config: DraftConfig, seed: int) -> torch.Tensor:
    """[A] per-channel scales of the heavy regime (fixed for a seed, shared by all streams)."""
    gen = _generator(seed, "heavy", -1)
    return torch.exp(torch.randn(config.aux_size, generator=gen) * HEAVY_SIGMA)


def check_boot_compatible(config: DraftConfig) -> None:
    if config.target_hidden_size != config.hidden_size:
        raise QStreamError(
            f"the boot regime stands the draft's layers of width {config.hidden_size} in for "
            f"target layers of width {config.target_hidden_size}; the widths differ, use gauss "
            "or heavy"
        )


def synthetic_aux(
    regime: str,
    config: DraftConfig,
    stream_ids: list[int],
    stream_lengths: list[int],
    pad_to: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """gauss / heavy aux states [S, pad_to, A] in ``dtype`` for the given corpus streams, zero
    past each stream's end: :class:`SyntheticAuxChunks`'s rows, all at once."""
    chunks = SyntheticAuxChunks(regime, config, stream_ids, stream_lengths, pad_to, seed, dtype)
    return chunks.rows(0, pad_to)


class SyntheticAuxChunks:
    """gauss / heavy aux states [S, pad_to, A] for the given corpus streams, drawn in float32
    and rounded to ``dtype``, a range of positions at a time.  Each stream's states come from
    its own generator, from position 0 on, so they never depend on how streams are batched,
    and a range continues the previous one: ranges give the rows of one whole draw (torch's CPU
    normal sampler works in groups of 16 values and A is a multiple of 16 in every preset and
    real model; tests/test_sensitivity_context.py checks).  A batch too big to hold (a
    long-context bucket at K3 width: one 131,072-token stream is 9.4 GB of bf16) is handed to
    a model's ``context`` this way (``qstream.arch.interface.AuxChunks``); :func:`synthetic_aux`
    takes all rows at once."""

    def __init__(
        self,
        regime: str,
        config: DraftConfig,
        stream_ids: list[int],
        stream_lengths: list[int],
        pad_to: int,
        seed: int,
        dtype: torch.dtype,
    ):
        if regime not in ("gauss", "heavy"):
            raise ValueError(f"SyntheticAuxChunks handles gauss and heavy, not {regime!r}")
        self.shape = (len(stream_ids), pad_to, config.aux_size)
        self._lengths, self._dtype = stream_lengths, dtype
        self._generators = [_generator(seed, regime, s) for s in stream_ids]
        self._scales = channel_scales(config, seed) if regime == "heavy" else None
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
