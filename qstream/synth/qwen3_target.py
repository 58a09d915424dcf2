"""The Qwen3-style DSpark draft ``qstream synth --target`` writes for a transformers Qwen3 target
(docs/qwen3-dspark.md, "Synthetic checkpoints"): the draft's decoder takes the target's
attention and MLP shapes, norm epsilon, RoPE and context length, as vLLM's
``Qwen3DSparkModel`` drafts do; the preset gives the rest (the Markov and confidence heads, the block).

>>> config = qwen3_draft_config(target_json, shape, arch.presets["qwen3-tiny"], ids, mask, arch)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qstream.arch.interface import Architecture, DraftConfig
from qstream.checkpoint.target import TargetShape

QWEN3_MODEL_TYPES = ("qwen3",)  # transformers' Qwen3ForCausalLM
# config.json keys the draft copies as they are from the target (RoPE: _rope)
COPIED = (
    "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
    "rms_norm_eps max_position_embeddings vocab_size attention_bias"
).split()


def qwen3_draft_config(
    target: Mapping[str, Any],
    shape: TargetShape,
    preset: DraftConfig,
    layer_ids: tuple[int, ...],
    mask_token_id: int,
    arch: Architecture,
) -> DraftConfig:
    """``preset`` reshaped for the Qwen3 target ``shape`` whose config.json holds ``target``:
    the target's widths, heads, norm epsilon, RoPE, context length and vocabulary (the draft's
    output vocabulary is the whole of it); ``min(preset's, target's)`` draft layers over
    ``layer_ids``; the target's bos/eos ids.  ValueError naming a key the target lacks or
    holds a bad value in."""
    data = {k: v for k, v in preset.to_json().items() if k != "rope_parameters"}
    data.update({k: target[k] for k in COPIED if k in target})
    data["rope_parameters"] = _rope(target)
    heads = target.get("num_attention_heads")
    if "head_dim" not in target and isinstance(heads, int) and heads > 0:
        data["head_dim"] = shape.hidden_size // heads  # transformers' default without one
    data.update(
        draft_vocab_size=shape.vocab_size,
        target_hidden_size=shape.hidden_size,
        target_num_hidden_layers=shape.num_hidden_layers,
        target_layer_ids=list(layer_ids),
        num_hidden_layers=min(preset.num_hidden_layers, shape.num_hidden_layers),
        mask_token_id=mask_token_id,
        dflash_config={"mask_token_id": mask_token_id},
        bos_token_id=_token(target.get("bos_token_id")),
        eos_token_id=_token(target.get("eos_token_id")),
    )
    return arch.parse_config(data)


def _token(value: Any) -> int | None:
    """A single special-token id (a list of eos ids keeps its first)."""
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rope(target: Mapping[str, Any]) -> Any:
    """The target's ``rope_parameters`` (transformers 5), else its legacy ``rope_theta`` with
    ``rope_scaling`` folded in (transformers 4, as Qwen3-8B's config.json has it)."""
    if target.get("rope_parameters") is not None:
        return target["rope_parameters"]
    scaling = target.get("rope_scaling")
    rope = {
        "rope_theta": target.get("rope_theta"),
        **(scaling if isinstance(scaling, dict) else {}),
    }
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope
