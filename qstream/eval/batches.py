"""The drafting work of one regime, batch by batch: batches of whole streams, the aux states each
batch reads (the synthetic regimes' drawn from noise, qstream/regimes.py, each stream's from a
generator seeded by (seed, regime, stream index), so any subset of streams can be regenerated
alone), the shared race noise, and one batch drafted by one model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from qstream.arch.interface import AuxChunks, DraftConfig, DraftModel, Rollout
from qstream.arch.markov import draft_vocab_size
from qstream.arch.registry import architecture_of
from qstream.bounded import Recorded, Store, Trimmed
from qstream.errors import QStreamError
from qstream.eval.corpus import AnchorPlan, Corpus
from qstream.eval.settings import Sampling
from qstream.eval.states import CapturedStates
from qstream.regimes import Regime

# Aux states are handed over in bf16, as a bf16 target's hidden states are; the reference and
# every variant read the same rounded values.
AUX_DTYPE = torch.bfloat16
# Per-batch memory budgets: aux states [S, T, A] and logits [n, B, V] (float32 elements); a
# batch keeps up to seven [n, B, V] tensors alive at once: 0.9 GB at this budget.
AUX_BUDGET = 1 << 26
LOGITS_BUDGET = 1 << 25
# ... except that a batch may always hold this many aux positions: at K3's width (A = 35840)
# the budget alone would allow a dozen one-block streams, and the FP32 reference would upcast
# every weight once per dozen blocks.
MIN_AUX_POSITIONS = 8192
# Aux states kept in memory between the reference and the variants of one regime (AuxStates).
AUX_CACHE_BYTES = 1 << 30
# A batch's aux states bigger than this are never held whole (AuxStates.get).
LAZY_AUX_BYTES = 1 << 30
# Batches stop growing when their padded aux positions exceed the used ones by this factor
# (plus a floor, so that short streams still batch together).
PAD_SLACK = 1.25
MIN_BATCH_POSITIONS = 4096


# heavy: shaped as SmolLM2-135M-Instruct's captured states are where a draft reads them
# (docs/calibration.md, "The regimes against SmolLM2's states"; massive activations: Sun et al.,
# "Massive Activations in Large Language Models", 2024).  Noise times fixed per-channel scales:
HEAVY_SIGMA = 0.5  # lognormal spread of channel RMS (real: log-sd 0.26-0.55 without position 0)
HEAVY_OUTLIERS = 3  # channels far above the rest, the same indices in every aux layer (real: 1-4)
HEAVY_OUTLIER_RANGE = (20.0, 40.0)  # their RMS over the layer's median channel (real: 23-39x)
# and each stream's position 0 an attention sink (real: the first token, |h| = 2.48e4 in one
# channel, its RMS ~1,044 against 7-12 for other tokens): the first outlier channel alone holds
# this many times a typical token's RMS
HEAVY_SINK = 125.0


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


def heavy_scales(config: DraftConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy's per-channel scales [A] and position 0's sink channels [A] (zero elsewhere)."""
    L, D = config.num_target_layers, config.target_hidden_size
    scales = torch.exp(torch.randn(L, D, generator=gen) * HEAVY_SIGMA)  # [L, D]
    outliers = torch.randperm(D, generator=gen)[:HEAVY_OUTLIERS]
    low, high = HEAVY_OUTLIER_RANGE
    factor = low + (high - low) * torch.rand(L, HEAVY_OUTLIERS, generator=gen)
    scales[:, outliers] = scales.median(dim=1, keepdim=True).values * factor
    sink = torch.zeros(L, D)
    token_rms = scales.square().mean(dim=1).sqrt()  # a noise token's expected RMS, per layer
    sink[:, outliers[0]] = HEAVY_SINK * token_rms * D**0.5  # one channel: RMS = value / sqrt(D)
    return scales.flatten(), sink.flatten()


class SyntheticAuxChunks:
    """gauss / heavy aux states [S, pad_to, A] (``AuxChunks``), zero past each stream's end, drawn
    in float32 and rounded to ``dtype``, a range of positions at a time, in order: each stream from
    its own generator, so ranges give the rows of one whole draw however streams are batched
    (torch's CPU normal sampler works in groups of 16 and A is a multiple of 16)."""

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
        self.shape = (len(stream_ids), pad_to, config.aux_size)
        self._lengths, self._dtype = stream_lengths, dtype
        self._generators = [_generator(seed, regime, s) for s in stream_ids]
        self._heavy: tuple[torch.Tensor, torch.Tensor] | None = None
        if regime.channel_scales:
            self._heavy = heavy_scales(config, _generator(seed, regime, -1))
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
                if self._heavy is not None:
                    scales, sink = self._heavy
                    states *= scales
                    if t0 == 0:  # the sink channel of position 0 is replaced, the rest kept
                        states[0] = torch.where(sink != 0, sink, states[0])
                out[row, : states.shape[0]] = states

        # torch's CPU sampler runs on one core: streams are drawn side by side
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            list(pool.map(draw, range(self.shape[0])))
        return out


@dataclass(frozen=True, eq=False)
class Batch:
    """Blocks of whole streams, so a stream's context is computed once per batch; a batch is its
    own key (by identity) in the stores that keep its outputs between passes."""

    blocks: torch.Tensor  # [n] indices into the plan
    streams: list[int]  # corpus stream ids in this batch
    local_stream: torch.Tensor  # [n] row of each block's stream within ``streams``
    anchor: torch.Tensor  # [n]
    first_token: torch.Tensor  # [n]
    context_length: int  # positions of aux needed: max anchor in the batch
    ids: torch.Tensor  # [len(streams), context_length + 1] the streams' tokens (zero padded)


def batch_flops(config: DraftConfig, batch: Batch, causal: bool = False) -> float:
    """The FLOPs of drafting ``batch`` once, padded context included; ``causal`` (boot): also
    the reference's causal pass that makes the batch's aux states."""
    arch, S, T = architecture_of(config), len(batch.streams), batch.context_length
    context = S * T * arch.context_flops(config)
    made = S * arch.causal_flops(config, max(T, 1)) if causal else 0
    return arch.drafted_flops(config, batch.anchor) + context + made


def make_batches(plan: AnchorPlan, corpus: Corpus, config: DraftConfig) -> tuple[Batch, ...]:
    """The plan in batches of whole streams, taken by the context they need (so padding stays
    small); a batch closes at the memory budgets or when padding would exceed ``PAD_SLACK``."""
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
        if group and (
            n_blocks > max_blocks
            or streams * longest > max(AUX_BUDGET // config.aux_size, MIN_AUX_POSITIONS)
            or streams * longest > PAD_SLACK * max(used, 1) + MIN_BATCH_POSITIONS
        ):
            batches.append(_batch(group, blocks_of, plan, corpus))
            group = []
        group.append(s)
    if group:
        batches.append(_batch(group, blocks_of, plan, corpus))
    return tuple(batches)


def _batch(
    streams: list[int], blocks_of: dict[int, list[int]], plan: AnchorPlan, corpus: Corpus
) -> Batch:
    idx = torch.tensor([b for s in streams for b in sorted(blocks_of[s])])
    row = {s: i for i, s in enumerate(streams)}
    anchor = plan.anchor[idx]
    first = torch.stack(
        [corpus.streams[s][p] for s, p in zip(plan.stream[idx].tolist(), anchor.tolist())]
    )
    local = torch.tensor([row[s] for s in plan.stream[idx].tolist()])
    T = int(anchor.max())
    ids = torch.zeros(len(streams), T + 1, dtype=torch.int64)
    for r, s in enumerate(streams):
        tokens = corpus.streams[s][: T + 1]
        ids[r, : tokens.numel()] = tokens
    return Batch(idx, list(streams), local, anchor, first, T, ids)


class AuxStates:
    """Aux states [S, T, A] (AUX_DTYPE) of each batch of one regime: captured, drawn (gauss,
    heavy), or the reference's causal layer outputs (boot, made on the reference pass).  Kept for
    the later passes up to AUX_CACHE_BYTES; beyond, gauss and heavy are drawn again and boot's
    spill to ``scratch_dir``.  Close after the regime."""

    def __init__(
        self,
        regime: Regime,
        corpus: Corpus,
        config: DraftConfig,
        seed: int,
        scratch_dir: str | None = None,
    ):
        self.regime, self.corpus, self.config, self.seed = regime, corpus, config, seed
        self.captured = corpus if isinstance(corpus, CapturedStates) else None
        self._kept = Store(scratch_dir, memory_bytes=AUX_CACHE_BYTES, spill=regime.causal)
        self._ranges = Store(scratch_dir, memory_bytes=0)  # boot's, never held whole
        self._recorded: dict[Batch, Recorded] = {}

    def get(self, batch: Batch, reference: DraftModel | None = None) -> torch.Tensor | AuxChunks:
        """The batch's aux states (boot: ``reference`` the first time); over LAZY_AUX_BYTES, as
        :class:`AuxChunks` (boot's streamed once to the scratch file), the heap trimmed after
        each range."""
        T = max(batch.context_length, 1)
        lazy = len(batch.streams) * T * self.config.aux_size * AUX_DTYPE.itemsize > LAZY_AUX_BYTES
        if self.captured is not None:
            chunks = self.captured.aux_chunks(batch.streams, T, AUX_DTYPE)
            return Trimmed(chunks) if lazy else chunks.rows(0, T)
        if batch in self._kept:
            return self._kept.get(batch)
        if batch in self._recorded:
            if not self._recorded[batch].complete:
                raise RuntimeError(
                    "boot aux states must be taken whole by the reference pass first"
                )
            return Trimmed(self._recorded[batch])
        if self.regime.causal:
            if reference is None:
                raise RuntimeError("boot aux states must come from the reference pass first")
            ids = batch.ids[:, :T]
            if lazy:
                stream = architecture_of(self.config).causal_stream(
                    reference, ids, AUX_DTYPE, self.config.num_target_layers
                )
                self._recorded[batch] = Recorded(stream, self._ranges)
                return Trimmed(self._recorded[batch])
            depth = self.config.num_target_layers  # one step per aux layer
            aux = reference.causal_hidden(ids, depth).flatten(2).to(AUX_DTYPE).cpu()  # [S,T,A]
        else:
            lengths = [int(self.corpus.streams[s].numel()) for s in batch.streams]
            args = (self.regime, self.config, batch.streams, lengths, T, self.seed, AUX_DTYPE)
            if lazy:
                return Trimmed(SyntheticAuxChunks(*args))
            aux = SyntheticAuxChunks(*args).rows(0, T)
        self._kept.put(batch, aux)
        return aux

    def close(self) -> None:
        self._kept.close()
        self._ranges.close()
        self._recorded.clear()


def race_noise(batch_index: int, n_blocks: int, config: DraftConfig, seed: int) -> torch.Tensor:
    """Exp(1) variates [n, B, Vd] for one batch's sampled rollouts, the same for the reference and
    every variant, drawn as ``-log(U)``, U uniform on [0, 1) (U = 0: +inf, a race it cannot win)."""
    gen = torch.Generator().manual_seed(((seed * 7919 + 17) * 1_000_003 + batch_index) % 2**64)
    shape = (n_blocks, config.block_size, draft_vocab_size(config))  # one per draft logit
    return torch.empty(shape).uniform_(generator=gen).log_().neg_()


def propose(model: DraftModel, aux: torch.Tensor | AuxChunks, batch: Batch) -> Any:
    drafter = architecture_of(model.config).drafter
    at = (batch.local_stream, batch.anchor, batch.first_token)
    return drafter.propose(model, aux, *at, ids=batch.ids)


class Drafts(NamedTuple):
    state: Any  # the drafter kind's, on the host
    greedy: Rollout
    sampled: Rollout


def draft_batch(
    model: DraftModel,
    aux: torch.Tensor | AuxChunks,
    batch: Batch,
    batch_index: int,
    seed: int,
    sampling: Sampling = Sampling(),
) -> Drafts:
    """One batch drafted by ``model``, on the host: its proposal state, greedy rollout, and
    sampled rollout on the race noise (as vLLM's ``draft_sample_method: probabilistic``)."""
    state, drafter = propose(model, aux, batch), architecture_of(model.config).drafter
    noise = race_noise(batch_index, len(batch.blocks), model.config, seed)
    sampled = drafter.rollout(state, noise, sampling.temperature, sampling.draft_top_p)
    greedy = drafter.rollout(state)
    if model.device.type == "cpu":
        return Drafts(state, greedy, sampled)
    greedy, sampled = (
        Rollout(r.tokens.cpu(), r.prev.cpu(), r.logits.cpu(),
                None if r.confidence is None else r.confidence.cpu())
        for r in (greedy, sampled)
    )  # fmt: skip
    return Drafts(drafter.on_host(state), greedy, sampled)
