"""The chain drafter kind (docs/eagle3.md, "Drafting"): EAGLE-3 drafts one token per step, each
step reading the token the step before drew and the state it handed on, through the draft's own
KV cache, as vLLM 0.32.0's EAGLE proposer chains them (vllm/v1/spec_decode/eagle.py,
``EagleProposer.propose``).  :data:`CHAIN_DRAFTER` is qstream/arch/interface.py's ``Drafter``.

At an anchor p (the block drafters' convention: context j < p, ``first_token`` = ids[p]) the
prefill pairs the target's aux states at t with the token at t + 1 for t < p, so its step at
p - 1 reads ids[p] and gives the first token's logits; step j then runs at position p - 1 + j.
The reference and every variant run their own chain on their own drafted tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from qstream.arch.eagle3.model import Chain, ChainStart, Eagle3Draft
from qstream.arch.interface import Rollout
from qstream.arch.markov import sample, sampling_probs


@dataclass(frozen=True)
class Chained:
    """The chain drafter's state of one batch (opaque outside qstream/arch/)."""

    model: Eagle3Draft
    start: ChainStart  # where each block's chain starts
    first_token: torch.Tensor  # [N] ids[p], the token the first step read


class ChainDrafter:
    """qstream/arch/interface.py's ``Drafter`` for a draft that chains one token per step."""

    def propose(
        self, model: Eagle3Draft, aux: Any, stream, anchor, first_token, ids=None
    ) -> Chained:
        """Chains at anchor[n] of stream[n]: the prefill over aux [S, T, A] beside ``ids``
        [S, >= T+1] (the streams' tokens), the chain starting at its step p - 1."""
        if ids is None:
            raise ValueError("a chain drafter's prefill reads the streams' tokens (ids)")
        stream, anchor = torch.as_tensor(stream).long(), torch.as_tensor(anchor).long()
        first_token = torch.as_tensor(first_token).long()
        T = aux.shape[1]
        if stream.numel() and bool((anchor < 1).any() or (anchor > T).any()):
            raise ValueError(f"every anchor p must satisfy 1 <= p <= {T} (the aux positions)")
        ids = torch.as_tensor(ids)  # the prefill reads ids[:, 1 : T + 1] beside aux rows 0..T-1
        if ids.dim() != 2 or ids.shape[1] < T + 1:
            raise ValueError(
                f"ids must be [S, >= {T + 1}] beside {T} aux positions, got {list(ids.shape)}"
            )
        ids = ids[:, 1 : T + 1].long()
        if not torch.equal(ids[stream, anchor - 1], first_token):
            raise ValueError("first_token must be each stream's token at its anchor")
        rows = aux if isinstance(aux, torch.Tensor) else aux.rows(0, T)  # one layer: held whole
        with torch.no_grad():
            pre = model.prefill(ids, rows, logits=False)
            start = model.start(pre, stream, anchor - 1)
        return Chained(model, start, first_token.to(model.device))

    def rollout(
        self, state: Chained, noise=None, temperature: float = 1.0, top_p: float = 1.0
    ) -> Rollout:
        """Greedy, or each step's token drawn by the race of ``noise`` [N, k, Vd] (markov.py's
        ``sample``, as the block drafters draw), mapped to a target id and fed back."""
        model = state.model
        N, k, Vd = state.first_token.numel(), model.config.block_size, model.config.draft_vocab_size
        if noise is not None and tuple(noise.shape) != (N, k, Vd):
            raise ValueError(f"noise must be [{N}, {k}, {Vd}], got {list(noise.shape)}")
        race = None if noise is None else noise.to(model.device)

        def choose(j: int, logits: torch.Tensor) -> torch.Tensor:
            if race is None:
                return model.to_target(logits.argmax(-1))
            return model.to_target(sample(sampling_probs(logits, temperature, top_p), race[:, j]))

        with torch.no_grad():
            return self._rollout(state, model.run(state.start, k, choose))

    def teacher_forced(self, state: Chained, tokens: torch.Tensor) -> Rollout:
        """The chain fed ``tokens`` [N, k] (target ids) instead of its own draws."""
        rolled = self._rollout(state, _forced(state.model, state.start, tokens))
        return Rollout(tokens, rolled.prev.cpu(), rolled.logits.cpu(), None)

    @staticmethod
    def _rollout(state: Chained, chain: Chain) -> Rollout:
        prev = torch.cat((state.first_token[:, None], chain.tokens[:, :-1]), 1)
        return Rollout(chain.tokens, prev, chain.logits, None)

    def on_host(self, state: Chained) -> Chained:
        """Unchanged: its rollouts run where the model is and hand their tensors to the host."""
        return state

    # The FP32 reference verifier: the reference's chain starts are kept, and a reference model
    # built on the host replays the chain on another rollout's tokens (bit-exact on its own).
    def keep(self, state: Chained) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(state.start, f.name) for f in fields(ChainStart))

    def reference_head(self, weights: Mapping[str, torch.Tensor], config: Any) -> Eagle3Draft:
        return Eagle3Draft(config, weights)

    def replay(
        self, head: Eagle3Draft, kept: tuple[torch.Tensor, ...], drafted: Rollout
    ) -> torch.Tensor:
        start = ChainStart(*(t.to(head.device) for t in kept))
        return _forced(head, start, drafted.tokens).logits.cpu()


def _forced(model: Eagle3Draft, start: ChainStart, tokens: torch.Tensor) -> Chain:
    given = tokens.to(model.device)
    with torch.no_grad():
        return model.run(start, given.shape[1], lambda j, _: given[:, j])


CHAIN_DRAFTER = ChainDrafter()


class CausalRows:
    """The boot regime's aux states as ``AuxChunks`` (qstream/arch/interface.py): the midlayer's
    causal pass (:meth:`Eagle3Draft.causal_hidden`) over ids [S, T] made whole on the first
    request (one layer: its states are the size of the aux states they stand for), then served a
    range of positions at a time in ``dtype``, flattened to [S, t, depth·H]."""

    def __init__(self, model: Eagle3Draft, ids: torch.Tensor, dtype: torch.dtype, depth=None):
        self.model, self.ids, self.dtype, self.depth = model, ids, dtype, depth or 1
        self.shape = (ids.shape[0], ids.shape[1], self.depth * model.config.hidden_size)
        self._rows: torch.Tensor | None = None

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        if self._rows is None:
            with torch.no_grad():
                hidden = self.model.causal_hidden(self.ids, self.depth)
            self._rows = hidden.flatten(2).to(self.dtype).cpu()
        return self._rows[:, t0:t1]
