"""A tiny Qwen3-style DSpark draft built, initialised and saved by speculators 0.9.0 itself, and
speculators' own forward run over anchors the test chooses (tests/test_speculators_parity.py).

Only the speculators lane imports this (speculators needs an older transformers than the main
environment; docs/testing.md).  speculators' layout: ``save_pretrained`` writes config.json
(``speculators_model_type: "dspark"``, the backbone nested in ``transformer_layer_config``) and
model.safetensors without ``embed_tokens`` (and without ``lm_head`` for a full-vocabulary draft);
both are the target's, written here to ``target_head/`` as ``qstream synth`` does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file

VOCAB = 300
HIDDEN = 64
AUX_IDS = [1, 3, 5]  # hidden-states indices: target layers 0, 2 and 4
MASK_TOKEN = 5
BLOCK_SLOTS = 7
MARKOV_RANK = 16


@dataclass(frozen=True)
class Case:
    """One speculators configuration of the tiny draft."""

    rope: dict
    sample_from_anchor: bool = True
    draft_vocab: int = VOCAB
    max_positions: int = 256


PLAIN = {"rope_type": "default", "rope_theta": 10000.0}
# YaRN at factor 4 over a 64-position original context; max_position_embeddings is
# factor * original, so transformers and vLLM read the same factor whichever key they trust.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}


def build(case: Case, seed: int):
    """speculators' DSparkDraftModel for ``case``, every weight drawn from ``seed`` (norms away
    from 1, a Markov head that matters), eval mode, eager attention."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=case.max_positions,
        rope_parameters=dict(case.rope),
    )
    layer._attn_implementation = "eager"  # flex attention would compile on CPU
    drafted = BLOCK_SLOTS if case.sample_from_anchor else BLOCK_SLOTS - 1
    spec = SpeculatorsConfig(
        algorithm="dspark",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=drafted)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    )
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=case.draft_vocab,
        block_size=BLOCK_SLOTS,
        aux_hidden_state_layer_ids=AUX_IDS,
        mask_token_id=MASK_TOKEN,
        sample_from_anchor=case.sample_from_anchor,
        markov_rank=MARKOV_RANK,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        speculators_config=spec,
    )
    torch.manual_seed(seed)
    model = DSparkDraftModel(config).eval()
    _randomise(model, seed)
    if case.draft_vocab < VOCAB:
        kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed + 1))
        kept = kept[: case.draft_vocab].sort().values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        model.load_vocab_mappings(t2d, kept - torch.arange(case.draft_vocab))
    return model


def _randomise(model, seed: int) -> None:
    """Weights of a useful size: norms 1 +- 0.3, projections ~ 1/sqrt(fan_in), embeddings and
    the Markov table ~ 1 (speculators' own init leaves the Markov bias near zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias") or name.startswith(
                ("embed_tokens", "markov_head.markov_w1")
            ):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)


def save(model, root: Path) -> tuple[Path, Path]:
    """speculators' own ``save_pretrained`` into root/draft, and the target's embedding and
    lm_head (speculators saves neither) into root/target_head, read through an index."""
    draft, head = root / "draft", root / "target_head"
    model.save_pretrained(draft)
    head.mkdir(parents=True)
    tensors = {
        "model.embed_tokens.weight": model.embed_tokens.weight.detach().clone(),
        "lm_head.weight": _target_lm_head(model),
    }
    save_file(tensors, head / "model.safetensors")
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in tensors}}
    (head / "model.safetensors.index.json").write_text(json.dumps(index))
    return draft, head


def _target_lm_head(model) -> torch.Tensor:
    """The target's [V, H] head: the draft's own rows for a full vocabulary; with a reduced
    one, the draft's rows at their target ids and unrelated rows elsewhere."""
    weight = model.lm_head.weight.detach()
    if model.d2t is None:
        return weight.clone()
    full = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))
    full[torch.arange(weight.shape[0]) + model.d2t] = weight
    return full


@dataclass(frozen=True)
class Run:
    """speculators' outputs over N blocks of ``block_slots`` slots (every slot, slot 0 too)."""

    hidden: torch.Tensor  # [N, slots, H] final-normed
    logits_base: torch.Tensor  # [N, slots, Vd] lm_head(hidden)
    logits: torch.Tensor  # [N, slots, Vd] with the Markov bias of the true previous tokens
    confidence: torch.Tensor  # [N, slots] confidence logits (before the sigmoid)


def forward(model, aux: torch.Tensor, ids: torch.Tensor, stream, anchor) -> Run:
    """speculators' ``DSparkDraftModel.forward`` on S streams packed as S documents of one
    sequence (speculators' training layout: ``hidden_states`` [1, S*T, A] is each position's
    aux layers concatenated, ``position_ids`` restart per document), at exactly the blocks
    (stream[n], anchor[n]): ``select_anchors`` returns them and ``compute_metrics`` hands the
    head outputs back instead of a loss."""
    from speculators.models.dflash import core as dflash_core
    from speculators.models.dspark import core as dspark_core

    S, T, _ = aux.shape
    packed = stream * T + anchor
    n = packed.numel()
    seen: dict[str, torch.Tensor] = {}
    backbone = model._backbone_forward

    def select(loss_mask, num_anchors, block_size):
        assert num_anchors == n and block_size == BLOCK_SLOTS
        return packed.clone(), torch.ones(n, dtype=torch.bool)

    def keep_backbone(*args, **kwargs):
        out = backbone(*args, **kwargs)
        seen["hidden"], seen["logits_base"] = out[0], out[1]
        return out

    def keep_heads(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    with (
        torch.no_grad(),
        mock.patch.object(dflash_core, "select_anchors", select),
        mock.patch.object(dspark_core, "compute_metrics", keep_heads),
        mock.patch.object(model, "_backbone_forward", keep_backbone),
    ):
        model(
            hidden_states=aux.reshape(1, S * T, -1),
            input_ids=ids.reshape(1, S * T),
            loss_mask=torch.ones(1, S * T, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, S * T, HIDDEN),
            document_ids=torch.arange(S).repeat_interleave(T)[None],
            position_ids=torch.arange(T).repeat(S)[None],
            max_anchors=n,
        )
    return Run(*(seen[k].reshape(n, BLOCK_SLOTS, -1).squeeze(-1) for k in Run.__annotations__))


def greedy(model, run: Run, first_token: torch.Tensor, first_slot: int):
    """speculators' Markov head driven the way vLLM drafts (vllm/v1/worker/gpu/spec_decode/
    dspark/speculator.py, ``_sample_sequential``): prev_0 = the anchor's token; at each drafted
    slot argmax(U + markov_w2 . markov_w1[prev]) in the draft vocabulary, mapped to the target's
    (d + d2t[d]), fed back.  -> (target ids [N, B], logits [N, B, Vd], confidence logits)."""
    head, conf = model.markov_head, model.confidence_head
    prev, tokens, logits, confidence = first_token.clone(), [], [], []
    with torch.no_grad():
        for slot in range(first_slot, BLOCK_SLOTS):
            hidden = run.hidden[:, slot : slot + 1]
            emb = head.prev_embeddings(prev[:, None])
            step = (
                run.logits_base[:, slot]
                + head.block_bias(prev_token_ids=prev[:, None], hidden_states=hidden, prev_emb=emb)[
                    :, 0
                ]
            )
            confidence.append(conf(torch.cat([hidden, emb], dim=-1))[:, 0])
            draft = step.argmax(-1)
            prev = draft if model.d2t is None else draft + model.d2t[draft]
            tokens.append(prev)
            logits.append(step)
    return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(confidence, 1)
