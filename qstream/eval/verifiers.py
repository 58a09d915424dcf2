"""What the verifiers accept of one regime's drafted blocks: the FP32 reference on each variant's
own drafted prefixes (``--acceptance``), the captured target on its own stream (``--states``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qstream.arch.family import D2T, borrow_from_target
from qstream.arch.interface import LM_HEAD, DraftConfig, Drafter, Rollout
from qstream.arch.markov import in_target_vocab, sampling_probs
from qstream.arch.weights import ComputeWeights
from qstream.bounded import Store
from qstream.eval.acceptance import (
    AcceptanceAccumulator,
    accept_probabilities,
    greedy_accepts,
    greedy_draft_probabilities,
    greedy_draft_stream_weights,
    paired_loss,
    stream_weights,
    token_probs,
)
from qstream.eval.batches import Batch
from qstream.eval.corpus import AnchorPlan
from qstream.eval.estimates import pooled_proportion
from qstream.eval.settings import DriftSettings
from qstream.eval.states import CapturedStates
from qstream.eval.vocabulary import FLOOR, VERIFIERS
from qstream.verification import (
    CARD_MODE,
    GREEDY,
    GREEDY_BLOCK,
    PROBABILISTIC_STANDARD,
    SAMPLING_MODES,
    VLLM_DEFAULT_MODE,
)


class RegimeAcceptance:
    """One regime's verifiers (a no-op when neither applies).  With ``--acceptance`` what the
    drafter keeps of the reference's state (the block drafter's U [N, B, Vd] float32, the chain
    drafter's chain starts) is held in a Store (:meth:`close` frees it); per variant only [N, B]
    values.  A reduced-vocabulary draft's logits are scattered into the target vocabulary before
    either verifier reads them, as vLLM verifies them (qstream/arch/markov.py, in_target_vocab)."""

    def __init__(
        self,
        drafter: Drafter,
        weights: Mapping[str, torch.Tensor],
        plan: AnchorPlan,
        captured: CapturedStates | None,
        *,
        settings: DriftSettings,
        config: DraftConfig,
    ):
        self.drafter, self.sampling, self.B = drafter, settings.sampling, config.block_size
        self.vocab_size, d2t = config.vocab_size, weights.get(D2T)
        self.to_target = None if d2t is None else torch.arange(len(d2t)) + d2t.long()
        self.adaptive, self.seed = settings.adaptive, settings.seed
        self.states, self.against_reference = captured, settings.acceptance
        self.active = self.against_reference or self.states is not None
        self.variants: dict[str, dict[str, AcceptanceAccumulator]] = {}
        self.reference_target = self._accumulator()
        self.diagnostics: dict[str, list] = {
            "stream_is_target_top1": [],
            "stream_outside_target_nucleus": [],
        }
        self.kept: Store | None = None  # the kept parts of each batch, by (batch, part)
        self.kept_parts = 0
        if not self.active:
            return
        self.head = drafter.reference_head(weights, config)
        if self.states is not None:
            # the target's lm_head [V, H]: the draft's own unless its vocabulary is reduced
            head = weights[LM_HEAD]
            if self.to_target is not None:
                shape, model = (self.vocab_size, head.shape[1]), Path(str(settings.model))
                head = borrow_from_target(
                    model, settings.target, [LM_HEAD], shape, "target lm_head"
                )[LM_HEAD]
            self.lm_head = ComputeWeights({LM_HEAD: head}, torch.float32)
            self.plan = plan
            # [N, B] the stream's own tokens p+1..p+B of every block
            self.stream_tokens = torch.stack(
                [
                    self.states.streams[s][p + 1 : p + 1 + self.B]
                    for s, p in zip(plan.stream.tolist(), plan.anchor.tolist())
                ]
            )
        if self.against_reference:  # last: nothing after it can fail and leave it open
            N, V = plan.anchor.numel(), weights[LM_HEAD].shape[0]
            # the block drafter keeps U [N, B, Vd] float32
            self.kept = Store(settings.scratch_dir, total_bytes=4 * N * self.B * V)

    def _in_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, B, Vd] over the target vocabulary [n, B, V] (unchanged at Vd = V)."""
        return in_target_vocab(logits, self.to_target, self.vocab_size)

    def close(self) -> None:
        if self.kept is not None:
            self.kept.close()

    def _verifier_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The verifier's distribution: tempered, then its top-k and top-p."""
        s = self.sampling
        return sampling_probs(logits, s.temperature, s.top_p, s.top_k)

    def _drafter_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's: the full tempered softmax, as vLLM's DSpark drafter samples."""
        return sampling_probs(logits, self.sampling.temperature, self.sampling.draft_top_p)

    def _add_target(
        self, acc: AcceptanceAccumulator, state: Any, batch: Batch, greedy: Rollout, record: bool
    ) -> None:
        """Acceptance by the target on its own stream: importance weights for the sampling
        verifier, the run of top-1 agreement for the greedy one; adaptive trimming for the
        greedy draft only (a probabilistic draft's depends on drafts the stream does not
        sample; docs/acceptance.md)."""
        assert self.states is not None  # only called with captured states
        idx = batch.blocks
        hidden = self.states.target_hidden(self.plan.stream[idx], self.plan.anchor[idx], self.B)
        target_logits, stream = self.lm_head.linear(LM_HEAD, hidden), self.stream_tokens[idx]
        forced = self._in_target(self.drafter.teacher_forced(state, stream).logits)
        p_tok = token_probs(self._verifier_probs(target_logits), stream)
        q_tok = token_probs(self._drafter_probs(forced), stream)
        drafted_is_stream = forced.argmax(-1) == stream
        for mode in SAMPLING_MODES:
            if mode.probabilistic:
                acc.add(mode, stream_weights(p_tok, q_tok, mode.block))
            else:
                weights = greedy_draft_stream_weights(p_tok, drafted_is_stream, mode.block)
                acc.add(mode, weights, outcomes=True)
        target_top1 = target_logits.argmax(-1)
        acc.add(GREEDY, greedy_accepts(forced.argmax(-1), target_top1), outcomes=True)
        acc.add_confidence(False, greedy.confidence)
        if record:
            self.diagnostics["stream_is_target_top1"].append(stream == target_top1)
            self.diagnostics["stream_outside_target_nucleus"].append(p_tok == 0)

    def add_reference(self, batch: Batch, state: Any, greedy: Rollout) -> None:
        """The reference's drafts of one batch (what the verifier keeps; their acceptance by
        the target)."""
        if self.kept is not None:
            parts = self.drafter.keep(state)
            for part, kept in enumerate(parts):
                self.kept.put((batch, part), kept)
            self.kept_parts = len(parts)
        if self.states is not None:
            self._add_target(self.reference_target, state, batch, greedy, record=True)

    def variant(self, name: str) -> dict[str, AcceptanceAccumulator]:
        on = (self.against_reference, self.states is not None)
        self.variants[name] = {v: self._accumulator() for v, o in zip(VERIFIERS, on) if o}
        return self.variants[name]

    def _accumulator(self) -> AcceptanceAccumulator:
        return AcceptanceAccumulator(self.sampling.temperature, self.adaptive, self.seed)

    def add_variant(
        self,
        accs: dict[str, AcceptanceAccumulator],
        batch: Batch,
        state: Any,
        greedy: Rollout,
        sampled: Rollout,
    ) -> None:
        """One batch of a variant's drafts: its greedy and sampled rollouts verified by the
        reference on the variant's own drafted prefixes (its argmax, the greedy verifier, and its
        sampling distribution against both drafts), and its acceptance by the target."""
        if self.against_reference:
            acc = accs["reference"]
            assert self.kept is not None  # kept whenever the reference verifies
            kept = tuple(self.kept.get((batch, part)) for part in range(self.kept_parts))
            p_greedy = self._in_target(self.drafter.replay(self.head, kept, greedy))
            acc.add(GREEDY, greedy_accepts(greedy.tokens, p_greedy.argmax(-1)), outcomes=True)
            p_greedy_tok = token_probs(self._verifier_probs(p_greedy), greedy.tokens)
            p_sampled = self._in_target(self.drafter.replay(self.head, kept, sampled))
            p_tok = token_probs(self._verifier_probs(p_sampled), sampled.tokens)
            q_tok = token_probs(
                self._drafter_probs(self._in_target(sampled.logits)), sampled.tokens
            )
            for mode in SAMPLING_MODES:
                if mode.probabilistic:
                    acc.add(mode, accept_probabilities(p_tok, q_tok, mode.block))
                else:
                    acc.add(mode, greedy_draft_probabilities(p_greedy_tok, mode.block))
            acc.add_confidence(False, greedy.confidence)
            acc.add_confidence(True, sampled.confidence)
        if self.states is not None:
            self._add_target(accs["target"], state, batch, greedy, record=False)

    def finish(self, out: dict, floor: str = FLOOR) -> None:
        """Write each variant's ``acceptance`` (with its paired loss against ``floor``) into the
        regime's results ``out``, and the reference draft's acceptance by the target."""
        if not self.active:
            return
        for name, entry in out["variants"].items():
            entry["acceptance"] = {}
            for verifier, acc in self.variants[name].items():
                block = acc.to_json()
                base = self.variants.get(floor, {}).get(verifier)
                block["loss_vs_bf16"] = (
                    None
                    if base is None or name == floor
                    else {
                        mode.name: paired_loss(base.emitted(mode), acc.emitted(mode), self.B)
                        for mode in acc.modes()
                        if mode in base.modes()
                    }
                )
                entry["acceptance"][verifier] = block
        if self.states is not None:
            share = {
                k: pooled_proportion(torch.cat(v)).to_json() for k, v in self.diagnostics.items()
            }
            out["reference_draft"] = {
                "acceptance": {"target": self.reference_target.to_json()},
                "stream": share,
            }


# What the results' top-level "acceptance" field says (docs/acceptance.md has the full text).
ACCEPTANCE_DEFINITIONS = {
    "emitted": "expected tokens emitted per block: accepted drafted tokens plus the one "
    "resampled or bonus token (1..B+1)",
    "estimator": "per block, 1 + sum_k P(tau >= k | drafted prefix): exact given the drafted "
    "block, averaged over blocks (95% Student-t interval; 0/1 outcomes (a greedy verifier, "
    "a greedy draft against the target's stream): Wilson on the design-effect sample size)",
    "mode": "each entry's mode, keyed DRAFT/VERIFIER[+adaptive]: draft (vLLM "
    "draft_sample_method), verification (vLLM rejection_sample_method: standard (token-wise) "
    "or block; or greedy: a verifier at temperature 0), temperature, adaptive, and the vLLM "
    "settings that select it",
    "modes": {
        VLLM_DEFAULT_MODE.name: "vLLM 0.32's default: the drafter's argmax at any "
        "temperature, a one-hot draft (q = 1) to token-wise rejection sampling at the "
        "request's temperature: P(tau >= k) = prod_{j<=k} p_j(x_j)",
        GREEDY_BLOCK.name: "a greedy draft under block verification: with a one-hot q "
        "the rule reduces to the token-wise law",
        PROBABILISTIC_STANDARD.name: "probabilistic draft, Leviathan et al. 2023 / Chen et "
        "al. 2023 rejection sampling",
        CARD_MODE.name: "probabilistic draft, Sun et al. 2024 block verification (vLLM "
        "rejection_sample_method 'block'); the mode a published DSpark card reports",
        GREEDY.name: "greedy drafting against a greedy verifier (temperature 0): matched "
        "prefix + 1",
        "*+adaptive": "adaptive verification (vLLM enable_adaptive_verification) over the base "
        "mode: blocks verified adaptive.requests at a time as one batch's requests sharing a "
        "budget of adaptive.budget_share of their drafted tokens (a setting: vLLM sizes it from "
        "profiled step costs), the slots ranked by the running product of the drafter's "
        "confidence scores as vLLM ranks them; verified: mean drafted tokens kept per block; "
        "estimated_emitted: 1 + the survival of the kept positions, what vLLM's budget rule "
        "expects. Against the target only the greedy draft's is simulated",
    },
    "sampled": "drafter q: the full softmax(logits / temperature), as vLLM's DSpark drafter "
    "samples (draft top-p 1 unless set); verifier p: softmax(logits / temperature) "
    "cut to its top-k and top-p and renormalised (see the results' sampling block)",
    "rules": {
        "standard": "token-wise: Leviathan et al. 2023 / Chen et al. 2023 rejection sampling",
        "block": "Sun et al. 2024 block verification (vLLM rejection_sample_method 'block')",
    },
    "greedy": "greedy drafting against a greedy verifier: matched prefix + 1",
    "reference": "verifier: the FP32 reference on the variant's own drafted prefixes",
    "target": "verifier: the captured target, on its own stream (importance weights; exact "
    "when the streams are the target's samples at this temperature and top-p)",
    "loss_vs_bf16": "mean over blocks of bf16's emitted tokens minus the variant's, same "
    "blocks and noise",
}
