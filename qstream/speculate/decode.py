"""Speculative decoding with the target in the loop (docs/speculate.md): the draft proposes a
block from the target's hidden states, the target (a transformers causal LM with its KV cache)
verifies it in one forward under one of vLLM 0.32.0's verification modes (qstream/verification.py;
vLLM's ``rejection_sampler``), and what it measures (docs/speculate.md, "Measured acceptance")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from qstream.arch.markov import draft_to_target, draft_vocab_size, in_target_vocab, sampling_probs
from qstream.arch.registry import architecture_of
from qstream.capture.target import LayerTap, cache_keyword
from qstream.errors import QStreamError
from qstream.eval.estimates import Estimate, pooled_proportion, t_interval
from qstream.progress import Progress
from qstream.verification import GREEDY, VerificationMode


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)  # emitted after the prompt, in order
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per verification
    forwards: int = 0  # target forwards, the prefill included
    # anchor p of each verification (prompt included)
    anchors: list[int] = field(default_factory=list)


def target_pass(target, ids: torch.Tensor, layer_ids: tuple[int, ...], kv=None, start: int = 0):
    """The target over ids [1, T] (positions start..) after those cached in ``kv``: (aux [1, T, A],
    logits [T, V]), refused unless finite (NaN would be decoded and counted as acceptance)."""
    inner = target.model
    with torch.no_grad(), LayerTap(inner.layers, inner.norm, layer_ids) as tap:
        out = target(input_ids=ids.to(target.device), use_cache=kv is not None, **(kv or {}))
    aux, logits = tap.aux(), out.logits[0].float().cpu()
    for what, rows in (("hidden states", aux[0]), ("logits", logits)):
        bad = (~torch.isfinite(rows)).any(dim=-1).nonzero()
        if len(bad):
            raise QStreamError(
                f"the target's {what} at position {start + int(bad[0])} are not finite (NaN or Inf)"
            )
    return aux, logits


def new_cache(target) -> dict:
    from transformers import DynamicCache

    return {cache_keyword(target): DynamicCache()}


def target_greedy(target, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy continuation, one full forward per token (the oracle)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([ids], device=target.device), use_cache=False)
        ids.append(int(logits.logits[0, -1].float().argmax()))
    return ids[len(prompt) :]


def speculative_decode(
    target,
    draft,
    prompt: list[int],
    new_tokens: int,
    mode: VerificationMode = GREEDY,
    temperature: float = 1.0,
    seed: int = 0,
    cache: bool = True,
) -> Decoded:
    """``new_tokens`` tokens after ``prompt``: the target's first, then draft-and-verify steps;
    ``cache=False`` reruns the target over the whole sequence each step (same tokens, slower)."""
    if mode.adaptive:  # its budget is a batch's (docs/acceptance.md), not one prompt's
        raise QStreamError(f"speculate does not decode with adaptive verification ({mode.name})")
    config = draft.config
    gen = torch.Generator().manual_seed(seed)
    ids, out, layer_ids = list(prompt), Decoded(), config.target_layer_ids
    kv = new_cache(target) if cache else None
    aux, logits = target_pass(target, torch.tensor([ids]), layer_ids, kv)
    out.forwards += 1
    ids.append(_pick(logits[-1], mode, temperature, gen))
    while len(ids) - len(prompt) < new_tokens:
        p = len(ids) - 1  # the anchor: the newest token, which the target has not yet read
        drafted, q = _draft(draft, aux[:, :p], ids[: p + 1], mode, temperature, seed + len(ids))
        if kv is None:
            aux, logits = target_pass(target, torch.tensor([ids + drafted]), layer_ids)
        else:  # the cache holds positions 0..p-1: read the anchor and the block only
            block = torch.tensor([ids[p:] + drafted])
            new_aux, logits = target_pass(target, block, layer_ids, kv, p)
        out.forwards += 1
        emitted = _verify(logits[-len(drafted) - 1 :], drafted, q, mode, temperature, gen)
        if kv is not None:  # keep the anchor and the accepted drafts: positions 0..p + accepted
            aux = torch.cat([aux[:, :p], new_aux[:, : len(emitted)]], dim=1)
            rejected = len(drafted) + 1 - len(emitted)  # read by the forward, not kept
            if rejected:  # (transformers 4 reads crop(0) as "crop to length 0")
                (past,) = kv.values()
                past.crop(-rejected)
        out.accepted.append(len(emitted) - 1)
        out.anchors.append(p)
        ids.extend(emitted)
    out.tokens = ids[len(prompt) : len(prompt) + new_tokens]
    return out


def _pick(logits: torch.Tensor, mode: VerificationMode, temperature: float, gen) -> int:
    if mode.greedy_verifier:
        return int(logits.argmax())
    return int(torch.multinomial(sampling_probs(logits, temperature), 1, generator=gen))


def _draft(draft, aux, ids: list[int], mode: VerificationMode, temperature: float, seed: int):
    """One block at anchor p = aux's length: its tokens (target ids) and the drafter's q [B, V]
    over the target vocabulary (None for a greedy draft)."""
    drafter, config = architecture_of(draft.config).drafter, draft.config
    at = (torch.tensor([0]), torch.tensor([aux.shape[1]]), torch.tensor([ids[-1]]))
    state = drafter.propose(draft, aux, *at, ids=torch.tensor([ids]))
    if not mode.probabilistic:
        return drafter.rollout(state).tokens[0].tolist(), None
    shape = (1, config.block_size, draft_vocab_size(config))  # one race entry per draft logit
    noise = torch.empty(shape).exponential_(generator=torch.Generator().manual_seed(seed))
    rolled = drafter.rollout(state, noise, temperature)
    logits = in_target_vocab(rolled.logits[0], draft_to_target(draft), config.vocab_size)
    return rolled.tokens[0].tolist(), sampling_probs(logits, temperature)


def _verify(logits, drafted: list[int], q, mode: VerificationMode, temperature: float, gen):
    """The accepted drafts, then the correction or bonus token; ``logits`` [B + 1, V]."""
    if mode.block:
        return _verify_block(logits, drafted, q, mode, temperature, gen)
    for k, d in enumerate(drafted):
        if mode.greedy_verifier:
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
    return drafted + [_pick(logits[len(drafted)], mode, temperature, gen)]


def _verify_block(logits, drafted: list[int], q, mode, temperature: float, gen) -> list[int]:
    """Block verification as vLLM 0.32.0's kernels run it (docs/speculate.md): every position
    draws u_k and the last k with u_k ≤ h_k is kept."""
    probs = sampling_probs(logits, temperature)  # [B + 1, V]: p_1 .. p_B and the bonus p
    B = len(drafted)
    if q is None:  # _compute_global_residual_mass's one-hot draft: q(x_k) = 1
        q = torch.zeros_like(probs[:B])
        q[torch.arange(B), torch.tensor(drafted)] = 1.0
    P = [1.0]  # P_0 .. P_B
    for k, d in enumerate(drafted):
        P.append(min(1.0, P[-1] * float(probs[k, d]) / max(float(q[k, d]), 1e-30)))
    tau = 0
    for k in range(1, B + 1):
        if k == B:
            h = P[B]
        else:
            mass = float((P[k] * probs[k] - q[k]).clamp(min=0.0).sum())  # Z_{k+1}
            denom = mass + 1.0 - P[k]
            h = mass / denom if denom > 0 else 1.0
        if float(torch.rand((), generator=gen)) <= h:
            tau = k
    if tau == B:
        return drafted + [_pick(logits[B], mode, temperature, gen)]
    residual = (P[tau] * probs[tau] - q[tau]).clamp(min=0.0)
    residual = residual if float(residual.sum()) > 0 else probs[tau]
    return drafted[:tau] + [int(torch.multinomial(residual, 1, generator=gen))]


def acceptance_study(
    target,
    drafts: Mapping[str, Any],
    prompts: list[list[int]],
    new_tokens: int,
    mode: VerificationMode = GREEDY,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, dict]:
    return {
        name: summarise(
            decode_prompts(target, draft, prompts, new_tokens, mode, temperature, seed),
            draft.config.block_size,
        )
        for name, draft in drafts.items()
    }


def decode_prompts(
    target,
    draft,
    prompts: list[list[int]],
    new_tokens: int,
    mode: VerificationMode = GREEDY,
    temperature: float = 1.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[Decoded]:
    """Every prompt decoded by ``draft``, prompt i with seed ``seed + i`` (for every draft)."""
    runs = []
    for i, p in enumerate(prompts):
        try:
            run = speculative_decode(target, draft, p, new_tokens, mode, temperature, seed + i)
        except QStreamError as exc:  # which prompt: the decode knows only the position
            raise QStreamError(f"prompt {i}: {exc}") from None
        runs.append(run)
        if progress is not None:
            progress.advance("", 1)
    return runs


def summarise(runs: list[Decoded], block_size: int) -> dict:
    """JSON-ready: ``mean_acceptance_length`` (1..B+1), ``accepted_at_least`` (k = 1..B),
    ``tokens_per_target_forward`` (the prefill included) and the counts."""
    steps = [torch.tensor(r.accepted, dtype=torch.float64) for r in runs]
    emitted, n_steps = _emitted_per_verification(runs)
    if not bool((n_steps > 0).all()):
        raise ValueError("every prompt needs at least one verification (more new tokens)")
    forwards = torch.tensor([float(r.forwards) for r in runs], dtype=torch.float64)
    tokens = torch.tensor([float(len(r.tokens)) for r in runs], dtype=torch.float64)
    padded = pad_sequence(steps, batch_first=True, padding_value=-1.0)
    counted = padded >= 0
    return {
        "prompts": len(runs),
        "verifications": int(n_steps.sum()),
        "mean_acceptance_length": _influence_estimate(*_influence(emitted, n_steps)).to_json(),
        "accepted_at_least": [
            pooled_proportion(padded >= k, counted).to_json() for k in range(1, block_size + 1)
        ],
        "tokens_per_target_forward": _influence_estimate(*_influence(tokens, forwards)).to_json(),
    }


def paired_loss(base: list[Decoded], runs: list[Decoded]) -> Estimate:
    """``base``'s mean acceptance length minus ``runs``' over the same prompts, with a 95%
    interval from the linearised variance of the per-prompt difference."""
    if len(base) != len(runs):
        raise ValueError(f"paired over the same prompts: {len(base)} and {len(runs)} runs")
    r_base, z_base = _influence(*_emitted_per_verification(base))
    r_runs, z_runs = _influence(*_emitted_per_verification(runs))
    return _influence_estimate(r_base - r_runs, z_base - z_runs)


def _emitted_per_verification(runs: list[Decoded]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt: tokens its verifications emitted (accepted + 1 each), and how many."""
    y = [float(sum(a + 1 for a in r.accepted)) for r in runs]
    m = [float(len(r.accepted)) for r in runs]
    return torch.tensor(y, dtype=torch.float64), torch.tensor(m, dtype=torch.float64)


def _influence(y: torch.Tensor, m: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The ratio r = ``sum(y) / sum(m)`` over independent units and each unit's zero-mean
    influence (y_i - r m_i) / mean(m)."""
    r = float(y.sum() / m.sum())
    return r, (y - r * m) / float(m.mean())


def _influence_estimate(value: float, z: torch.Tensor) -> Estimate:
    n = z.numel()
    if n < 2:
        return Estimate(value, math.nan, math.nan, n)
    return Estimate(value, *t_interval(value, n, math.sqrt(float((z**2).sum()) / (n * (n - 1)))), n)
