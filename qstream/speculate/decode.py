"""Speculative decoding with the target in the loop (docs/speculate.md): the draft proposes a
block from the target's own hidden states, the target verifies it with one forward under one of
vLLM 0.32.0's rules, and the accepted tokens plus the target's bonus token are emitted.

>>> out = speculative_decode(target, draft, prompt_ids, new_tokens=64, rule="greedy")
>>> out.tokens, out.accepted          # emitted ids; drafted tokens accepted per target forward

The target is a transformers causal LM (``model.model.layers``, ``model.model.norm``); every
forward reruns the whole sequence (no KV cache: exact, and small at the sizes this is run at).
Rules (vLLM's ``rejection_sampler``; docs/acceptance.md): ``greedy`` — the draft's argmax,
accepted while it equals the target's argmax, then the target's argmax; ``greedy-sampling`` —
the draft's argmax against a sampling verifier (accepted with probability p(d), else a token
from p without d); ``probabilistic`` — a token drawn from the draft's full tempered softmax q,
accepted with probability min(1, p(d)/q(d)), else one from max(0, p − q) renormalised.  After a
whole accepted block the bonus token is the target's (argmax, or a draw from p).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qstream.arch.markov import sampling_probs
from qstream.arch.registry import architecture_of
from qstream.capture.hooks import LayerTap
from qstream.errors import QStreamError

RULES = ("greedy", "greedy-sampling", "probabilistic")


@dataclass
class Decoded:
    """One prompt's continuation."""

    tokens: list[int] = field(default_factory=list)  # emitted after the prompt, in order
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per verification
    forwards: int = 0  # target forwards, the prefill included
    anchors: list[int] = field(
        default_factory=list
    )  # anchor p of each verification (prompt included)


def target_pass(target, ids: torch.Tensor, layer_ids: tuple[int, ...]):
    """The target over ids [1, T]: (aux [1, T, A] of ``layer_ids``' outputs, logits [T, V])."""
    inner = target.model
    with torch.no_grad(), LayerTap(inner.layers, inner.norm, layer_ids) as tap:
        logits = target(input_ids=ids, use_cache=False).logits
    return tap.aux(), logits[0].float()


def target_greedy(target, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy continuation, one full forward per token (the oracle)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].float().argmax()))
    return ids[len(prompt) :]


def speculative_decode(
    target,
    draft,
    prompt: list[int],
    new_tokens: int,
    rule: str = "greedy",
    temperature: float = 1.0,
    seed: int = 0,
) -> Decoded:
    """``new_tokens`` tokens after ``prompt``: the target's first, then draft-and-verify steps
    (module docstring).  ``draft`` is a built draft model (``arch.build``)."""
    if rule not in RULES:
        raise QStreamError(f"unknown verification rule {rule!r}; choose one of {', '.join(RULES)}")
    config = draft.config
    if getattr(config, "reduced_vocab", False):
        raise QStreamError("speculative decoding with a reduced-vocabulary draft is not supported")
    gen = torch.Generator().manual_seed(seed)
    ids, out = list(prompt), Decoded()
    aux, logits = target_pass(target, torch.tensor([ids]), config.target_layer_ids)
    out.forwards += 1
    ids.append(_pick(logits[-1], rule, temperature, gen))
    while len(ids) - len(prompt) < new_tokens:
        p = len(ids) - 1  # the anchor: the newest token, which the target has not yet read
        drafted, q = _draft(draft, aux[:, :p], ids[p], rule, temperature, seed + len(ids))
        aux, logits = target_pass(target, torch.tensor([ids + drafted]), config.target_layer_ids)
        out.forwards += 1
        emitted = _verify(logits[p:], drafted, q, rule, temperature, gen)
        out.accepted.append(len(emitted) - 1)
        out.anchors.append(p)
        ids.extend(emitted)
    out.tokens = ids[len(prompt) : len(prompt) + new_tokens]
    return out


def _pick(logits: torch.Tensor, rule: str, temperature: float, gen: torch.Generator) -> int:
    """The target's own token: argmax under greedy verification, else a draw from p."""
    if rule == "greedy":
        return int(logits.argmax())
    return int(torch.multinomial(sampling_probs(logits, temperature), 1, generator=gen))


def _draft(draft, aux: torch.Tensor, anchor_token: int, rule: str, temperature: float, seed: int):
    """One block at anchor p = aux's length: its tokens and the drafter's distributions q
    [B, V] (None for a greedy draft)."""
    arch = architecture_of(draft.config)
    p = aux.shape[1]
    blocks = draft.draft(draft.context(aux), torch.tensor([0]), torch.tensor([p]),
                         torch.tensor([anchor_token]))  # fmt: skip
    if rule != "probabilistic":
        return arch.rollout(draft, blocks).tokens[0].tolist(), None
    shape = blocks.logits_base.shape
    noise = torch.empty(shape).exponential_(generator=torch.Generator().manual_seed(seed))
    rolled = arch.rollout(draft, blocks, noise, temperature)
    return rolled.tokens[0].tolist(), sampling_probs(rolled.logits[0], temperature)


def _verify(logits, drafted: list[int], q, rule: str, temperature: float, gen) -> list[int]:
    """The emitted tokens of one step: the accepted drafts, then the correction or bonus token.
    ``logits`` [B + 1, V]: the target's at the anchor and at each drafted position."""
    for k, d in enumerate(drafted):
        if rule == "greedy":
            top = int(logits[k].argmax())
            if d != top:
                return drafted[:k] + [top]
            continue
        probs = sampling_probs(logits[k], temperature)
        q_k = torch.zeros_like(probs) if q is None else q[k]
        if q is None:
            q_k[d] = 1.0  # a greedy draft is a one-hot proposal
        u = float(torch.rand((), generator=gen))
        if u < min(1.0, float(probs[d]) / max(float(q_k[d]), 1e-30)):
            continue
        residual = (probs - q_k).clamp(min=0.0)
        residual = residual if float(residual.sum()) > 0 else probs
        return drafted[:k] + [int(torch.multinomial(residual, 1, generator=gen))]
    return drafted + [_pick(logits[len(drafted)], rule, temperature, gen)]
