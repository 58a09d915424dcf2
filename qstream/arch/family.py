"""What every DSpark-family architecture shares (docs/model.md, "Architectures"): the
descriptor calls that run vLLM's DSparkMarkovHead and DSparkConfidenceHead
(qstream/arch/markov.py), the confidence head's width hint, and the checks of a batch of
blocks.  Pure Python at import: torch is imported where a call needs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qstream.arch.interface import Blocks, DraftConfig, Rollout

if TYPE_CHECKING:
    import torch

CONFIDENCE_WEIGHT = "confidence_head.proj.weight"


class DSparkFamily:
    """The descriptor methods of the Markov and confidence heads, the same in every DSpark."""

    def host_head(self, model):
        from qstream.arch.markov import host_head

        return host_head(model)

    def rollout(
        self, model, blocks: Blocks, noise=None, temperature: float = 1.0, top_p: float = 1.0
    ) -> Rollout:
        from qstream.arch.markov import rollout

        return rollout(model, blocks, noise, temperature, top_p)

    def teacher_forced(self, head, blocks: Blocks, tokens: torch.Tensor) -> Rollout:
        from qstream.arch.markov import teacher_forced

        return teacher_forced(head, blocks, tokens)


def shape_hint(config: DraftConfig, name: str, shape: tuple[int, ...]) -> str:
    """Why a confidence head of the other width does not fit (vLLM 0.32 sizes the head from
    ``confidence_head_with_markov``, default false: a [1, H+r] head written without the key
    fails its loader); empty for every other mismatch."""
    H, r = config.hidden_size, config.markov_rank
    if name != CONFIDENCE_WEIGHT or not config.enable_confidence_head or r == 0:
        return ""
    if tuple(shape) == (1, H + r) and not config.confidence_head_with_markov:
        return (
            " (a [1, H+r] head: vLLM builds that width only when config.json sets "
            "confidence_head_with_markov: true)"
        )
    if tuple(shape) == (1, H) and config.confidence_head_with_markov:
        return (
            " (a [1, H] head: vLLM builds [1, H+r] because config.json sets "
            "confidence_head_with_markov: true)"
        )
    return ""


def check_blocks(vocab_size: int, lengths: Any, stream: Any, anchor: Any, first_token: Any):
    """``(stream, anchor, first_token)`` as 1-D int64 tensors of one length, every anchor
    within its stream's context ``lengths`` and every first token a vocabulary id (ValueError
    otherwise): the arguments of a model's ``draft``."""
    import torch

    stream, anchor = torch.as_tensor(stream).long(), torch.as_tensor(anchor).long()
    first_token = torch.as_tensor(first_token).long()
    if not (stream.shape == anchor.shape == first_token.shape) or stream.dim() != 1:
        raise ValueError("stream, anchor and first_token must be 1-D of equal length")
    if stream.numel() and bool((anchor > lengths[stream]).any() or (anchor < 0).any()):
        raise ValueError("every anchor p must satisfy 0 <= p <= its stream's context length")
    if first_token.numel() and not (
        0 <= int(first_token.min()) and int(first_token.max()) < vocab_size
    ):
        raise ValueError(f"first_token ids must lie in [0, {vocab_size})")
    return stream, anchor, first_token
