"""The Qwen3-style DSpark checkpoint (docs/qwen3-dspark.md, "Tensors", "Loading"): the tensor
table for a config, the same in vLLM's dense layout and speculators' saved one, and the strict
check of a checkpoint against it; loading (memory-mapped, quantized checkpoints dequantized,
what the draft does not carry borrowed from its target, as vLLM 0.32.0's
``Qwen3DSparkForCausalLM.load_weights`` shares it); and how vLLM serves it, as data.  Pure
Python at import: torch and the checkpoint reader are imported where a call needs them.

>>> weights = load_weights("draft/", None, config)   # borrowed from draft/target_head/
>>> weights = load_weights("draft-nvfp4/", "Qwen3-8B/", config)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qstream.arch.config_fields import head_shapes
from qstream.arch.dspark_qwen3.config import Qwen3DSparkConfig
from qstream.arch.family import D2T, borrow_from_target, check_table, d2t_problem, shape_hint
from qstream.arch.interface import EMBED, LM_HEAD
from qstream.errors import QStreamError

if TYPE_CHECKING:
    import torch

T2D = "t2d"  # [vocab] bool, training only (vLLM 0.32's load_weights skips it)
# Tensors a checkpoint may leave out: the target's embedding is shared when the draft has none
# (Qwen3DSparkForCausalLM.load_weights; speculators never saves it).
OPTIONAL = (EMBED,)
# Integer tensors read as stored, with the dtypes each may have (d2t's: d2t_problem).
INDEX_TENSORS = {D2T: ("torch.int64", "torch.int32"), T2D: ("torch.bool", "torch.uint8")}


# ---------------------------------------------------------------------------------------------
# The tensor table


def tensor_shapes(config: Qwen3DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM builds for ``config``, in checkpoint order.  ``lm_head.weight`` and
    ``d2t`` belong to a reduced-vocabulary draft only (a full-vocabulary one may still carry
    its own lm_head: :func:`check_tensors` accepts it)."""
    c = config
    H, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        EMBED: (c.vocab_size, H),
        "fc.weight": (H, c.aux_size),
        "hidden_norm.weight": (H,),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        for name, out, inp in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (out, inp)
            if c.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (out,)
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
    return {**shapes, **head_shapes(c, c.draft_vocab_size)}


def check_tensors(
    config: Qwen3DSparkConfig, shapes: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Strict check: every tensor of the table (``embed_tokens`` may be left to the target),
    nothing unexplained beyond a full-vocabulary draft's own lm_head and speculators'
    training-only t2d, every shape exact.  QStreamError naming the first offender."""
    table = tensor_shapes(config)
    extra: dict[str, tuple[int, ...]] = {T2D: (config.vocab_size,)}
    if not config.reduced_vocab:
        extra[LM_HEAD] = (config.vocab_size, config.hidden_size)
    required = {k: v for k, v in table.items() if k not in OPTIONAL}
    check_table(required, {**table, **extra}, shapes, where, "Qwen3-style DSpark draft",
                lambda name, shape: shape_hint(config, name, shape),
                lambda name: _why_needed(config, name))  # fmt: skip


def _why_needed(config: Qwen3DSparkConfig, name: str) -> str:
    if name in (LM_HEAD, D2T):
        return (
            f"; draft_vocab_size {config.draft_vocab_size} < vocab_size {config.vocab_size}: "
            "vLLM refuses a reduced-vocabulary draft without its own lm_head and d2t"
        )
    return ""


# ---------------------------------------------------------------------------------------------
# Loading


def read_draft_tensors(directory: str | Path, config: Qwen3DSparkConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint, quantized ones dequantized, strictly checked
    against the config (``embed_tokens`` may be absent; the target's is then shared)."""
    from qstream.checkpoint.read import read_draft_checkpoint

    directory = Path(directory)
    tensors, index = read_draft_checkpoint(directory, INDEX_TENSORS)
    for name, tensor in index.items():
        if name != D2T and str(tensor.dtype) not in INDEX_TENSORS[name]:  # d2t: d2t_problem
            raise QStreamError(f"{directory}: tensor {name!r} is {tensor.dtype}, not an index map")
    check_tensors(
        config, {k: tuple(v.shape) for k, v in {**tensors, **index}.items()}, str(directory)
    )
    if D2T in index:
        if problem := d2t_problem(index[D2T], config.vocab_size):
            raise QStreamError(f"{directory}: {problem}")
        tensors[D2T] = index[D2T].long()
    return tensors


def load_weights(
    model_dir: str | Path, target: str | Path | None, config: Qwen3DSparkConfig
) -> dict[str, torch.Tensor]:
    """Everything :class:`~qstream.arch.dspark_qwen3.model.Qwen3DSpark` needs: the draft's
    tensors plus, from ``target`` (default ``model_dir/target_head``), ``embed_tokens.weight``
    when the draft has none and ``lm_head.weight`` when the draft has no lm_head of its own
    (a target with tied embeddings lends its embedding)."""
    model_dir = Path(model_dir)
    tensors = read_draft_tensors(model_dir, config)
    wanted = [n for n in (EMBED, LM_HEAD) if n not in tensors]
    if not wanted:
        return tensors
    expected = (config.vocab_size, config.hidden_size)
    missing = " or ".join(wanted)
    borrowed = borrow_from_target(model_dir, target, wanted, expected, missing, _read_borrowed)
    return {**tensors, **borrowed}


def _read_borrowed(target: Path, wanted: list[str]) -> dict[str, torch.Tensor]:
    """``wanted`` from the target; a target whose config.json ties its word embeddings has
    no lm_head tensor and lends embed_tokens for it."""
    from qstream.checkpoint.files import read_config
    from qstream.checkpoint.read import read_target_tensors

    tied = (target / "config.json").exists() and read_config(target).get("tie_word_embeddings")
    if tied and LM_HEAD in wanted:
        out = read_target_tensors(target, [EMBED])
        return {n: out[EMBED] for n in wanted}
    return read_target_tensors(target, wanted)


# ---------------------------------------------------------------------------------------------
# How vLLM 0.32.0 serves the draft (vllm/model_executor/models/qwen3_dspark.py over
# qwen3_dflash.py), as data: SERVING is the Qwen3DSparkModel serving profile that
# qstream/vllm/profiles.py builds (docs/vllm.md, "The Qwen3-style DSpark draft", cites each rule).

# Checkpoint module (under layers.{i}.) -> (runtime module under model.layers.{L+i}., split).
# q/k/v load into one qkv_proj (a QKVParallelLinear), gate/up into gate_up_proj (a
# MergedColumnParallelLinear): DFlashQwen3Model.hf_to_vllm_mapper's orig_to_new_stacked; the
# splits are DFlashQwen3Attention.__init__'s and Qwen2MLP's (qwen3_dflash.py, qwen2.py).
LAYER_MODULES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.o_proj": ("self_attn.o_proj", "in"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "out"),
    "mlp.up_proj": ("mlp.gate_up_proj", "out"),
    "mlp.down_proj": ("mlp.down_proj", "in"),
}
# Modules vLLM never builds quantized, with the reason (docs/vllm.md cites each).
NEVER_QUANTIZED = {
    "markov_head.markov_w1": "the Markov head's markov_w1 is an nn.Embedding, built without a "
    "quant config",
    "confidence_head.proj": (
        "the DSpark confidence head is an fp32 ReplicatedLinear built without a quant config "
        "(served for adaptive verification)"
    ),
    "lm_head": "Qwen3DSparkForCausalLM builds the draft's own lm_head as a ParallelLMHead "
    "without a quant config",
    "embed_tokens": "the draft's embedding is a VocabParallelEmbedding built without a quant "
    "config",
}
# markov_w2 is a ParallelLMHead built WITH the draft's quant config (DSparkMarkovHead.__init__):
# CompressedTensorsConfig.get_quant_method gives it a scheme only when a config group target
# names it (its class name holds no "linear", so the "Linear" target misses it); vLLM 0.32.0
# then loads it in each of qstream's formats (the vLLM lane proves it).  Runtime name, the target
# qstream writes for it, the formats.
LM_HEADS = {
    "markov_head.markov_w2": {
        "runtime": "model.markov_head.markov_w2",
        "target": "re:.*\\.markov_head\\.markov_w2$",
        "formats": ("fp8", "nvfp4", "mxfp4"),
    },
}
# The module kinds a shipped draft quantizes by default: the backbone's Linear layers and fc
# (the descriptor's quantize_include, docs/qwen3-dspark.md, "What is quantized").
DEFAULT_INCLUDE = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "fc",
)
SERVING: dict[str, Any] = {
    "name": "Qwen3DSparkModel",
    "architectures": ("Qwen3DSparkModel",),
    "layer_modules": LAYER_MODULES,
    "never_quantized": NEVER_QUANTIZED,
    # DFlashQwen3Model.__init__: fc is a ReplicatedLinear built with the draft's quant config.
    "context_proj": "fc",
    "lm_heads": LM_HEADS,
    "default_include": DEFAULT_INCLUDE,
    "gqa_heads": ("num_attention_heads", "num_key_value_heads"),
    # vLLM 0.32.0's update_dspark (vllm/transformers_utils/configs/speculators/algos.py) serves
    # a saved speculators DSpark config as Qwen3DSparkModel, whatever its "architectures" says
    "speculators_types": ("dspark",),
}
