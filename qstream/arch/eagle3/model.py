"""The EAGLE-3 draft's forward (docs/eagle3.md, "Forward"), in fp32 (the reference) or a serving
dtype (bf16: weights and activations rounded where vLLM 0.32.0 rounds them), as vLLM computes it
(vllm/model_executor/models/llama_eagle3.py, ``LlamaDecoderLayer.forward`` with layer_idx 0,
``LlamaModel.forward``, ``Eagle3LlamaForCausalLM.combine_hidden_states`` / ``compute_logits``;
qwen3_eagle3.py adds q/k RMSNorm per head).

>>> model = Eagle3Draft(config, weights)         # weights: the tensor table, + embed_tokens
>>> pre = model.prefill(ids, aux)                # ids [S, T] beside aux [S, T, A], causal
>>> chain = model.chain(pre, stream, anchor, k)  # k greedy tokens from each (stream, anchor)

One step reads a token's embedding and a hidden state (the first: ``fc`` of the target's aux
states): ``x = [RMS(e, input_layernorm) ‖ RMS(h, hidden_norm)]`` feeds q/k/v; the residual is
h (its normed form with ``norm_before_residual``); then o_proj, post_attention_layernorm, the
SwiGLU MLP, the final norm and lm_head over the draft vocabulary.  The next step's hidden state
is the pre-norm output (the normed one with ``norm_output``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qstream.arch.eagle3 import LAYER, Eagle3Config, check_tensors
from qstream.arch.family import D2T
from qstream.arch.interface import LM_HEAD
from qstream.arch.weights import DenseDraft


@dataclass(frozen=True)
class Steps:
    """What steps at T positions of S streams computed."""

    logits: torch.Tensor | None  # [S, T, Vd] fp32 over the draft vocabulary (None: not asked)
    hidden: torch.Tensor  # [S, T, H] the state the next step reads
    k: torch.Tensor  # [S, T, kv, d] keys (k_norm'ed in the Qwen3 form, rotated)
    v: torch.Tensor  # [S, T, kv, d]


@dataclass(frozen=True)
class Chain:
    """k tokens drafted (greedy, sampled or given) at each of N (stream, anchor)."""

    tokens: torch.Tensor  # [N, k] target ids (draft id + d2t[draft id]) as chosen
    logits: torch.Tensor  # [N, k, Vd]
    hidden: torch.Tensor  # [N, k, H] the state each step hands on


@dataclass(frozen=True)
class ChainStart:
    """Where chains at N anchors start (:meth:`Eagle3Draft.start`)."""

    k: torch.Tensor  # [N, P, kv, d] the prefill's keys
    v: torch.Tensor  # [N, P, kv, d]
    visible: torch.Tensor  # [N, 1, P] bool: the positions up to the anchor
    hidden: torch.Tensor  # [N, H] the state the prefill step at the anchor hands on
    logits: torch.Tensor  # [N, Vd] fp32 its logits: the first token's
    anchor: torch.Tensor  # [N] int64 the anchor's position in the prefill


Choose = Callable[[int, torch.Tensor], torch.Tensor]  # (step j, logits [N, Vd]) -> target ids


class Eagle3Draft(DenseDraft):
    """An EAGLE-3 draft computing in ``dtype``: ``weights`` maps the tensor table's names,
    embed_tokens and lm_head included (the target's when the draft has none); ``kv``: the KV
    cache it stores keys and values in; ``served`` (weights.py's ServedLinears): its linears'
    input quantizers, its drafting head's product, its cache's scales."""

    check_tensors = staticmethod(check_tensors)

    def setup(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().setup(weights)
        self.qk_norm = self.config.qk_norm
        Vd = self.config.draft_vocab_size
        offsets = weights[D2T].long() if D2T in weights else torch.zeros(Vd, dtype=torch.long)
        # draft id -> target id, as compute_logits scatters the draft logits
        self.d2t = (torch.arange(Vd) + offsets).to(self.device)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., A] (the target's aux states concatenated) -> fc(aux) [..., H]."""
        return self.proj("fc", aux.to(self.device, self.dtype))

    def step(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        visible: torch.Tensor | None = None,
        logits: bool = True,
    ) -> Steps:
        """Steps at ids [S, t] (target ids) beside hidden [S, t, H] at positions pos [S, t],
        attending to ``past`` keys and values [S, P, kv, d] where ``visible`` [S, t, P] and to
        their own with a causal mask (``logits`` False: the keys, values and states only)."""
        c, (S, t) = self.config, ids.shape
        x = torch.cat((self.norm(self.embed(ids.to(self.device)), LAYER + "input_layernorm"),
                       hn := self.norm(hidden, LAYER + "hidden_norm")), -1)  # fmt: skip
        residual = hn if c.norm_before_residual else hidden
        # vLLM 0.32.0's Attention.forward (vllm/model_executor/layers/attention/attention.py)
        # writes k and v to its cache (unified_kv_cache_update) before it attends
        k, v = self.key_value(0, x, pos)  # [S, t, kv, d]
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril().expand(S, t, t)
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat((past[0], k), 1), torch.cat((past[1], v), 1)
            mask = torch.cat((visible.to(self.device), mask), -1)  # type: ignore[union-attr]
        out = self.attend(self.query(0, x, pos), keys, values, mask)  # [S, t, n*d]
        residual = residual + self.proj(LAYER + "self_attn.o_proj", out)
        prenorm = residual + self.mlp(0, residual)
        normed = self.norm(prenorm, "norm")
        scores = self.w.linear(LM_HEAD, normed).float() if logits else None
        return Steps(scores, normed if c.norm_output else prenorm, k, v)

    def prefill(self, ids: torch.Tensor, aux: torch.Tensor, logits: bool = True) -> Steps:
        """The causal pass over ids [S, T] beside fc(aux [S, T, A]) at positions 0..T-1 (vLLM's
        proposer pairs the target's aux states at t with the token at t + 1)."""
        S, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(S, T)
        return self.step(ids.to(self.device), self.combine(aux), pos, logits=logits)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits [..., Vd] fp32 of the state a step hands on (``step``'s, computed alone)."""
        normed = hidden if self.config.norm_output else self.norm(hidden, "norm")
        return self.w.linear(LM_HEAD, normed).float()

    def start(self, pre: Steps, stream: torch.Tensor, anchor: torch.Tensor) -> ChainStart:
        """Chains at (stream[n], anchor[n]) of ``pre``: its keys up to, state and logits at it."""
        stream, anchor = stream.to(self.device), anchor.to(self.device)
        P = pre.k.shape[1]
        visible = (torch.arange(P, device=self.device) <= anchor[:, None])[:, None]  # [N, 1, P]
        hidden = pre.hidden[stream, anchor]  # [N, H]
        logits = self.head(hidden) if pre.logits is None else pre.logits[stream, anchor]
        return ChainStart(pre.k[stream], pre.v[stream], visible, hidden, logits, anchor)

    def run(self, start: ChainStart, k: int, choose: Choose) -> Chain:
        """k steps from ``start``: step j's token is ``choose(j, logits_j)`` (target ids [N]),
        which step j + 1 reads beside the state step j handed on, at the next position."""
        past_k, past_v, visible = start.k, start.v, start.visible
        logits, hidden = start.logits, start.hidden  # [N, Vd], [N, H]
        out_logits, out_hidden, tokens = [logits], [hidden], [choose(0, logits)]
        for j in range(1, k):
            s = self.step(tokens[-1][:, None], hidden[:, None], (start.anchor + j)[:, None],
                          (past_k, past_v), visible)  # fmt: skip
            past_k, past_v = torch.cat((past_k, s.k), 1), torch.cat((past_v, s.v), 1)
            visible = F.pad(visible, (0, 1), value=True)
            logits, hidden = s.logits[:, 0], s.hidden[:, 0]  # type: ignore[index]
            out_logits.append(logits)
            out_hidden.append(hidden)
            tokens.append(choose(j, logits))
        return Chain(torch.stack(tokens, 1), torch.stack(out_logits, 1), torch.stack(out_hidden, 1))

    def chain(self, pre: Steps, stream: torch.Tensor, anchor: torch.Tensor, k: int) -> Chain:
        """:meth:`run` greedy from :meth:`start`."""
        return self.run(
            self.start(pre, stream, anchor), k, lambda j, x: self.to_target(x.argmax(-1))
        )

    def causal_hidden(self, ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The midlayer as a causal decoder over ids [S, T] (the boot regime, docs/eval-drift.md),
        the embedding its first state -> [S, T, depth, H] fp32 (default depth: one)."""
        S, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(S, T)
        hidden = self.embed(ids.to(self.device))
        out = []
        for _ in range(depth or 1):
            hidden = self.step(ids, hidden, pos, logits=False).hidden
            out.append(hidden.float())
        return torch.stack(out, 2)


# The FLOP model (docs/eval-drift.md, "FLOP model"): multiply-adds of the products, x2


def _step_flops(config: Eagle3Config) -> float:
    """One step's products but lm_head's: q/k/v over [embedding ‖ hidden], o_proj, the MLP."""
    H, d = config.hidden_size, config.head_dim
    qkv = 2 * H * d * (config.num_attention_heads + 2 * config.num_key_value_heads)
    return 2.0 * (qkv + config.num_attention_heads * d * H + 3 * H * config.intermediate_size)


def context_flops(config: Eagle3Config) -> float:
    """One prefill position: fc, then a step without its lm_head."""
    return 2.0 * config.aux_size * config.hidden_size + _step_flops(config)


def drafted_flops(config: Eagle3Config, anchor: torch.Tensor) -> float:
    """Per block: the first token's lm_head, then k - 1 steps with theirs."""
    head = 2.0 * config.hidden_size * config.draft_vocab_size
    k = config.block_size
    return float(len(anchor)) * (k * head + (k - 1) * _step_flops(config))


def causal_flops(config: Eagle3Config, T: int) -> float:
    """The boot regime's causal pass: one step per aux layer at each of T positions."""
    return float(T) * config.num_target_layers * _step_flops(config)
