"""The Qwen3-style DSpark checkpoint's tensors (docs/qwen3-dspark.md, "Tensors"): names and
shapes for a config, the same in vLLM's dense layout and speculators' saved one, and the strict
check of a checkpoint against them."""

from __future__ import annotations

from collections.abc import Mapping

from qstream.arch.dspark_qwen3.config import Qwen3DSparkConfig
from qstream.arch.family import CONFIDENCE_WEIGHT, D2T, check_table, shape_hint

EMBED = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
T2D = "t2d"  # [vocab] bool, training only (vLLM 0.32's load_weights skips it)
# Tensors a checkpoint may leave out: the target's embedding is shared when the draft has none
# (Qwen3DSparkForCausalLM.load_weights; speculators never saves it).
OPTIONAL = (EMBED,)


def tensor_shapes(config: Qwen3DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM builds for ``config``, in checkpoint order.  ``lm_head.weight`` and
    ``d2t`` belong to a reduced-vocabulary draft only (a full-vocabulary one may still carry
    its own lm_head: :func:`check_tensors` accepts it)."""
    c = config
    H, d, r = c.hidden_size, c.head_dim, c.markov_rank
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        EMBED: (c.vocab_size, H),
        "fc.weight": (H, c.aux_size),
        "hidden_norm.weight": (H,),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, H)
            if c.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        if c.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, H)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, H)
        shapes[p + "mlp.down_proj.weight"] = (H, c.intermediate_size)
    shapes["norm.weight"] = (H,)
    if c.reduced_vocab:
        shapes[LM_HEAD] = (c.draft_vocab_size, H)
        shapes[D2T] = (c.draft_vocab_size,)
    if c.has_markov_head:
        shapes["markov_head.markov_w1.weight"] = (c.vocab_size, r)
        shapes["markov_head.markov_w2.weight"] = (c.draft_vocab_size, r)
    if c.enable_confidence_head:
        shapes[CONFIDENCE_WEIGHT] = (1, H + (r if c.confidence_head_with_markov else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def allowed_extra(config: Qwen3DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may carry beyond the table: a full-vocabulary draft's own lm_head,
    and speculators' training-only t2d."""
    extra: dict[str, tuple[int, ...]] = {T2D: (config.vocab_size,)}
    if not config.reduced_vocab:
        extra[LM_HEAD] = (config.vocab_size, config.hidden_size)
    return extra


def check_tensors(
    config: Qwen3DSparkConfig, shapes: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Strict check: every tensor of the table (``embed_tokens`` may be left to the target),
    nothing unexplained, every shape exact.  QStreamError naming the first offender."""
    table = tensor_shapes(config)
    required = {k: v for k, v in table.items() if k not in OPTIONAL}
    check_table(required, {**table, **allowed_extra(config)}, shapes, where,
                "Qwen3-style DSpark draft", lambda name, shape: shape_hint(config, name, shape),
                lambda name: _why_needed(config, name))  # fmt: skip


def _why_needed(config: Qwen3DSparkConfig, name: str) -> str:
    if name in (LM_HEAD, D2T):
        return (
            f"; draft_vocab_size {config.draft_vocab_size} < vocab_size {config.vocab_size}: "
            "vLLM refuses a reduced-vocabulary draft without its own lm_head and d2t"
        )
    return ""
