"""The block drafter kind (docs/model.md, "Architectures"): one non-causal pass drafts a block
of B tokens (``draft`` -> :class:`Blocks`), then vLLM's DSparkMarkovHead and
DSparkConfidenceHead roll it out (DFlash has no Markov head): greedy, sampled (vLLM's full
softmax of ``logits / T`` by an exponential race, docs/eval-drift.md) or teacher-forced.
:data:`BLOCK_DRAFTER` is the kind's ``Drafter``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from qstream.arch.interface import Blocks, DraftConfig, Rollout
from qstream.arch.weights import ComputeWeights, embedding, held_fp32


class HeadModel(Protocol):
    """What the heads read: a draft model or a :class:`Head`."""

    @property
    def w(self) -> Mapping[str, torch.Tensor]: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def config(self) -> DraftConfig: ...


@dataclass(frozen=True)
class Head:
    """A model's heads kept apart from it: on the host, where the verifiers run
    (qstream/eval/batches.py), or the FP32 reference's Markov head (no config; its final sum
    stays fp32)."""

    w: Mapping[str, torch.Tensor]
    dtype: torch.dtype = torch.float32
    config: Any = None
    d2t: torch.Tensor | None = None


_HOST_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Head


def draft_to_target(model: object) -> torch.Tensor | None:
    """A reduced-vocabulary draft's map [Vd] draft id -> target id (``d + d2t[d]``), else None:
    vLLM emits, and feeds back to ``markov_w1``, the target id (``map_draft_to_target`` in
    vllm/model_executor/models/qwen3_dspark.py)."""
    return getattr(model, "d2t", None)


def draft_vocab_size(config: Any) -> int:
    """The draft's output vocabulary (lm_head's rows): ``draft_vocab_size``, else the target's."""
    return getattr(config, "draft_vocab_size", None) or config.vocab_size


def in_target_vocab(
    logits: torch.Tensor, to_target: torch.Tensor | None, vocab_size: int
) -> torch.Tensor:
    """Draft logits [..., Vd] scattered into the target vocabulary [..., V], -inf elsewhere
    (``to_target``: :func:`draft_to_target`'s map; None: ``logits`` as given), as vLLM's DSpark
    speculator hands them to the rejection sampler (vllm/v1/worker/gpu/spec_decode/dspark/
    speculator.py, ``_sample_logits``): its softmax is the draft's, zero off the draft vocabulary,
    and the argmax is the mapped draft argmax (docs/acceptance.md, "Reduced vocabulary")."""
    if to_target is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], vocab_size), -torch.inf)
    return out.index_copy_(-1, to_target.to(logits.device), logits)


MARKOV_TABLE = "markov_head.markov_w2.weight"
MARKOV_EMBED = "markov_head.markov_w1.weight"


def markov_table(model: HeadModel) -> torch.Tensor | None:
    """markov_w2 [V, r] in the model's dtype, read once per rollout (an upcast one lives in the
    weights' reused buffer until their next product); None without a Markov head (DFlash)."""
    w = model.w
    if MARKOV_TABLE not in w:
        return None
    return w.borrow(MARKOV_TABLE) if isinstance(w, ComputeWeights) else w[MARKOV_TABLE]


def markov_logits(
    model: HeadModel,
    logits_base: torch.Tensor,
    prev: torch.Tensor,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``U_k + markov_w2 . markov_w1[prev_k]`` (logits_base [..., V], prev [...]) rounded to the
    model's dtype as vLLM adds two bf16 tensors, as fp32; ``U_k`` rounded without a Markov head.
    Every caller takes the same whole-table product, so a rollout, its teacher-forced replay and
    the verifier's recomputation agree bit for bit."""
    if MARKOV_TABLE not in model.w:
        return logits_base.to(model.dtype).float()
    emb = embedding(model.w, MARKOV_EMBED, prev)  # [..., r]
    bias = F.linear(emb, markov_table(model) if table is None else table)  # type: ignore[arg-type]
    return (logits_base.to(model.dtype) + bias.to(model.dtype)).float()


def confidence(model: HeadModel, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
    """``sigmoid(proj(x_k))`` per position, fp32 [...]; ``x_k = [hf_k ; markov_w1[prev_k]]``
    with ``confidence_head_with_markov``, else ``hf_k``; None without the head."""
    config = model.config
    if not config.enable_confidence_head:
        return None
    feats = hidden.to(model.dtype)  # [..., H]
    if config.confidence_head_with_markov:
        emb = embedding(model.w, MARKOV_EMBED, prev)  # [..., r]
        feats = torch.cat((feats, emb), dim=-1)  # [..., H + r], in the model's dtype
    # vLLM 0.32: DSparkConfidenceHead in vllm/model_executor/models/qwen3_dspark.py, which
    # K3DSparkModel (vllm/models/kimi_k3/nvidia/dspark_mla.py) builds: proj is a
    # ReplicatedLinear with params_dtype=torch.float32 and no quant config; forward
    # concatenates its two inputs in their own dtype and calls .float() on the result;
    # K3DSparkForCausalLM.compute_confidence takes the sigmoid.
    weight = held_fp32(model.w, "confidence_head.proj.weight")  # [1, H (+ r)]
    bias = held_fp32(model.w, "confidence_head.proj.bias")  # [1]
    return torch.sigmoid(F.linear(feats.float(), weight, bias)).squeeze(-1)


def sampling_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = None
) -> torch.Tensor:
    """softmax(logits / temperature), fp32 [..., V], cut to the top-k tokens then to the top-p
    nucleus (the top token always kept) and renormalised, in vLLM's order (docs/model.md)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p == 1 and (top_k is None or top_k >= probs.shape[-1]):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
        sorted_p = torch.where(rank < top_k, sorted_p, 0.0)
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    keep_sorted = ((sorted_p.cumsum(-1) - sorted_p) < top_p) & (sorted_p > 0)
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """``argmax(probs / race)``, ``race`` iid Exp(1) per token: an exact draw from ``probs``, as
    vLLM's sampler draws; a near-maximal coupling of two models given the same race
    (docs/model.md)."""
    return (probs / race).argmax(-1)


def rollout(
    model: HeadModel,
    blocks: Blocks,
    noise: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> Rollout:
    """Free-running rollout: prev_0 = ids[p]; d_k drawn from :func:`markov_logits` (argmax, or
    with ``noise`` [N, B, V] of iid Exp(1) by :func:`sample`) is fed back as prev_{k+1}.
    ``tokens`` and ``prev`` hold target ids (:func:`draft_to_target`), ``logits`` the draft's."""
    N, B, V = blocks.logits_base.shape
    if noise is not None and tuple(noise.shape) != (N, B, V):
        raise ValueError(f"noise must be [{N}, {B}, {V}], got {list(noise.shape)}")
    device = blocks.logits_base.device
    noise = None if noise is None else noise.to(device)
    prev = torch.empty(N, B, dtype=torch.int64, device=device)
    tokens = torch.empty(N, B, dtype=torch.int64, device=device)
    logits = torch.empty(blocks.logits_base.shape, dtype=torch.float32, device=device)
    token, to_target = blocks.first_token, draft_to_target(model)
    to_target = None if to_target is None else to_target.to(device)
    table = markov_table(model)
    for k in range(B):  # sequential by definition: step k needs d_{k-1}
        prev[:, k] = token
        logits[:, k] = markov_logits(model, blocks.logits_base[:, k], token, table)
        if noise is None:
            token = logits[:, k].argmax(-1)
        else:
            token = sample(sampling_probs(logits[:, k], temperature, top_p), noise[:, k])
        if to_target is not None:  # a draft id -> the target id vLLM emits and feeds back
            token = to_target[token]
        tokens[:, k] = token
    return Rollout(tokens, prev, logits, confidence(model, blocks.hidden, prev))


def teacher_forced(model: HeadModel, blocks: Blocks, tokens: torch.Tensor) -> Rollout:
    """The rollout of given tokens: prev = [ids[p], tokens[:, 0], ..., tokens[:, B-2]]."""
    prev = torch.cat((blocks.first_token[:, None], tokens[:, :-1]), dim=1)  # [N, B]
    return Rollout(
        tokens,
        prev,
        markov_logits(model, blocks.logits_base, prev),
        confidence(model, blocks.hidden, prev),
    )


@dataclass(frozen=True)
class Drafted:
    """The block drafter's state of one batch (opaque outside qstream/arch/)."""

    blocks: Blocks
    head: Any  # a DraftWithHeads, or its Head once on the host


class BlockDrafter:
    """qstream/arch/interface.py's ``Drafter``."""

    def propose(self, model: Any, aux: Any, stream, anchor, first_token, ids=None) -> Drafted:
        ctx = model.context(aux)  # bf16 aux: the model converts once to its own dtype (exact)
        return Drafted(model.draft(ctx, stream, anchor, first_token), model)

    def rollout(
        self, state: Drafted, noise=None, temperature: float = 1.0, top_p: float = 1.0
    ) -> Rollout:
        return rollout(state.head, state.blocks, noise, temperature, top_p)

    def teacher_forced(self, state: Drafted, tokens: torch.Tensor) -> Rollout:
        return teacher_forced(state.head, state.blocks, tokens)

    def on_host(self, state: Drafted) -> Drafted:
        b = state.blocks
        blocks = Blocks(b.logits_base.cpu(), b.hidden.cpu(), b.first_token.cpu())
        model = state.head  # itself on the CPU, else its heads' tensors on the host, copied once
        if model.device.type != "cpu" and model not in _HOST_HEADS:
            heads = ("markov_head.", "confidence_head.")  # (docs/model.md)
            stored = {k: v.cpu() for k, v in model.w.stored.items() if k.startswith(heads)}
            d2t = draft_to_target(model)
            _HOST_HEADS[model] = Head(
                ComputeWeights(stored, model.dtype),
                model.dtype,
                model.config,
                None if d2t is None else d2t.cpu(),
            )
        return Drafted(blocks, model if model.device.type == "cpu" else _HOST_HEADS[model])

    def keep(self, state: Drafted) -> tuple[torch.Tensor, ...]:
        return (state.blocks.logits_base,)

    def reference_head(self, weights: Mapping[str, torch.Tensor], config: Any) -> Head:
        present = [k for k in (MARKOV_EMBED, MARKOV_TABLE) if k in weights]  # none: DFlash
        return Head({k: weights[k].float().contiguous() for k in present})

    def replay(self, head: Head, kept: tuple[torch.Tensor, ...], drafted: Rollout) -> torch.Tensor:
        """Position by position as the reference's own rollout (verifying itself: bit-exact)."""
        (kept_u,), table = kept, markov_table(head)
        prev = drafted.prev
        return torch.stack(
            [markov_logits(head, kept_u[:, k], prev[:, k], table) for k in range(kept_u.shape[1])],
            dim=1,
        )


BLOCK_DRAFTER = BlockDrafter()
