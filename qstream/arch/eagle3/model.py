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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from qstream.arch.dspark_qwen3.model import apply_rope
from qstream.arch.eagle3 import LAYER, Eagle3Config, Llama3Rope, check_tensors
from qstream.arch.family import D2T
from qstream.arch.interface import EMBED, LM_HEAD
from qstream.arch.weights import (
    ComputeWeights,
    ServedLinears,
    embedding,
    fp8_round_trip,
    inv_freq,
    rms_norm,
    swiglu,
)
from qstream.serving import KV_CACHES, KVCache

ATTENTION = LAYER + "self_attn"  # the midlayer's attention, as ServedLinears.kv_scales names it


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


class Eagle3Draft:
    """An EAGLE-3 draft computing in ``dtype``: ``weights`` maps the tensor table's names,
    embed_tokens and lm_head included (the target's when the draft has none); ``kv``: the KV
    cache it stores keys and values in; ``served`` (weights.py's ServedLinears): its linears'
    input quantizers, its drafting head's product, its cache's scales."""

    def __init__(
        self,
        config: Eagle3Config,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv: KVCache = KV_CACHES["auto"],
        served: ServedLinears | None = None,
    ):
        check_tensors(config, {k: tuple(v.shape) for k, v in weights.items()}, "weights")
        for name in (EMBED, LM_HEAD):
            if name not in weights:
                raise ValueError(
                    f"weights: {name} is required (the target's, when not the draft's)"
                )
        self.config, self.dtype = config, dtype
        floats = {k: v for k, v in weights.items() if k != D2T}
        # On the CPU a bf16 model multiplies its operands upcast exactly to fp32, as the
        # Qwen3-style DSpark does (Qwen3DSpark.matmul): only the order of the fp32 sums differs
        upcast = dtype != torch.float32 and torch.device(device).type == "cpu"
        served = replace(served or ServedLinears(), fp32_products=upcast)
        self.w = ComputeWeights(floats, dtype, device, served)
        self.kv_fp8 = getattr(torch, str(kv.dtype)) if kv.quantized else None
        self.device = self.w.device
        Vd = config.draft_vocab_size
        offsets = weights[D2T].long() if D2T in weights else torch.zeros(Vd, dtype=torch.long)
        # draft id -> target id, as compute_logits scatters the draft logits
        self.d2t = (torch.arange(Vd) + offsets).to(self.device)
        rope, d = config.rope_parameters, config.head_dim
        if isinstance(rope, Llama3Rope):
            self.inv_freq = rope.inv_freq(d).to(self.device)
        else:
            yarn = rope if rope.rope_type == "yarn" else None
            self.inv_freq = inv_freq(d, float(rope.rope_theta), yarn).to(self.device)
        self.mscale = rope.mscale

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[f"{name}.weight"], self.config.rms_norm_eps)

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T (+ b)`` accumulated in fp32 and rounded to the model's dtype, the bias added
        in fp32 before rounding (as a GEMM epilogue adds it)."""
        bias = self.w.stored.get(f"{name}.bias")
        if bias is None:
            return self.w.linear(f"{name}.weight", x)
        return (self.w.linear(f"{name}.weight", x, torch.float32) + bias.float()).to(self.dtype)

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
        c, a = self.config, LAYER + "self_attn."
        S, t = ids.shape
        x = torch.cat((self.norm(embedding(self.w, EMBED, ids.to(self.device)),
                                 LAYER + "input_layernorm"),
                       hn := self.norm(hidden, LAYER + "hidden_norm")), -1)  # fmt: skip
        residual = hn if c.norm_before_residual else hidden
        q = self.proj(a + "q_proj", x).unflatten(-1, (c.num_attention_heads, c.head_dim))
        k = self.proj(a + "k_proj", x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        v = self.proj(a + "v_proj", x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        if c.qk_norm:
            q, k = self.norm(q, a + "q_norm"), self.norm(k, a + "k_norm")
        q = apply_rope(q, pos, self.inv_freq, self.mscale)  # [S, t, n, d]
        k = apply_rope(k, pos, self.inv_freq, self.mscale)  # [S, t, kv, d]
        k, v = self.cached(k, v)
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril().expand(S, t, t)
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat((past[0], k), 1), torch.cat((past[1], v), 1)
            mask = torch.cat((visible.to(self.device), mask), -1)  # type: ignore[union-attr]
        out = self.attend(q, keys, values, mask)  # [S, t, n*d]
        residual = residual + self.proj(a + "o_proj", out)
        p = LAYER + "mlp."
        mlp = swiglu(self.norm(residual, LAYER + "post_attention_layernorm"),
                     p + "gate_proj", p + "up_proj", p + "down_proj", self._linear)  # fmt: skip
        prenorm = residual + mlp
        normed = self.norm(prenorm, "norm")
        scores = self.w.linear(LM_HEAD, normed).float() if logits else None
        return Steps(scores, normed if c.norm_output else prenorm, k, v)

    def cached(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [S, t, kv, d] as every read of the draft's KV cache sees them, its own step's
        included: vLLM 0.32.0's ``Attention.forward`` (vllm/model_executor/layers/attention/
        attention.py) writes them (``unified_kv_cache_update``: ``do_kv_cache_update``,
        ``reshape_and_cache_flash``) before it attends; an fp8 cache rounds them at the layer's
        scale (1.0 unless given), as the Qwen3-style DSpark's (docs/eval-drift.md, "KV cache")."""
        if self.kv_fp8 is None:
            return k, v
        k_scale, v_scale = self.w.served.cache_scales(ATTENTION)
        return fp8_round_trip(k, self.kv_fp8, k_scale), fp8_round_trip(v, self.kv_fp8, v_scale)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w.linear(f"{name}.weight", x)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """q [S, t, n, d] over k, v [S, P, kv, d] (GQA), mask [S, t, P] True where visible."""
        c = self.config
        q = q.unflatten(-2, (c.num_key_value_heads, -1))  # [S, t, kv, g, d]
        s = torch.einsum("sqkgd,stkd->skgqt", q.float(), k.float()) * c.head_dim**-0.5
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
        p = torch.softmax(s, -1).to(self.dtype).float()  # as Qwen3DSpark.attend rounds them
        out = torch.einsum("skgqt,stkd->sqkgd", p, v.float())  # upcasts: exact
        return out.to(self.dtype).flatten(-3)

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
        """Where a chain at each (stream[n], anchor[n]) of ``pre`` starts: the prefill's keys
        and values visible up to the anchor, and its state and logits at the anchor."""
        stream, anchor = stream.to(self.device), anchor.to(self.device)
        P = pre.k.shape[1]
        visible = (torch.arange(P, device=self.device) <= anchor[:, None])[:, None]  # [N, 1, P]
        hidden = pre.hidden[stream, anchor]  # [N, H]
        logits = self.head(hidden) if pre.logits is None else pre.logits[stream, anchor]
        return ChainStart(pre.k[stream], pre.v[stream], visible, hidden, logits, anchor)

    def run(self, start: ChainStart, k: int, choose: Choose) -> Chain:
        """k steps from ``start``: step j's token is ``choose(j, logits_j)`` (target ids [N]),
        and step j + 1 reads it beside the state step j handed on, at the following position,
        attending to the visible prefill and the chain so far."""
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
        """k greedy tokens at each (stream[n], anchor[n]) of ``pre``: the first from the prefill
        step at the anchor, each next one a step at the following position reading the last
        token and hidden state, attending to the prefill up to the anchor and the chain so far."""
        return self.run(
            self.start(pre, stream, anchor), k, lambda j, x: self.to_target(x.argmax(-1))
        )

    def causal_hidden(self, ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The midlayer as a causal decoder over ids [S, T] (the boot regime's aux states,
        docs/eval-drift.md): the first step reads the embedding as its state, each next one the
        state the step before handed on -> [S, T, depth, H] fp32 (default depth: one)."""
        S, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(S, T)
        hidden = embedding(self.w, EMBED, ids.to(self.device))
        out = []
        for _ in range(depth or 1):
            hidden = self.step(ids, hidden, pos, logits=False).hidden
            out.append(hidden.float())
        return torch.stack(out, 2)
