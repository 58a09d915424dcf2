"""``qstream synth --target HF_DIR``: a synthetic draft shaped for a real Hugging Face target
(docs/model.md, "A draft for a Hugging Face target"; a Qwen3 target: docs/qwen3-dspark.md,
"Synthetic checkpoints"): the target's width, depth, vocabulary and tokenizer, the rest the
preset's.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from qstream.arch.interface import EMBED, Architecture, DraftConfig
from qstream.arch.registry import ARCHITECTURES, architecture_of
from qstream.checkpoint.files import read_config
from qstream.checkpoint.read import read_target_tensors
from qstream.checkpoint.target import TargetShape, read_target_shape
from qstream.errors import QStreamError
from qstream.progress import Progress
from qstream.publish import check_target
from qstream.synth.corpus import builtin_corpus, read_corpus
from qstream.synth.draft import (
    SynthSummary,
    _markov_head,
    _Plan,
    _small_tensors,
    preset_architecture,
    publish_draft,
)

QWEN3_MODEL_TYPES = ("qwen3",)  # transformers' Qwen3ForCausalLM
# config.json keys the draft copies as they are from the target (and RoPE)
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
    """``preset`` reshaped for the Qwen3 target whose config.json holds ``target``, with
    ``min(preset's, target's)`` layers; ValueError naming a key the target lacks or holds badly."""
    # the target's mask token and layers at the top level, which the preset's dflash_config
    # would override (vLLM reads dflash_config first)
    data = {
        k: v for k, v in preset.to_json().items() if k not in ("rope_parameters", "dflash_config")
    }
    data.update({k: target[k] for k in COPIED if k in target})
    # rope_parameters (transformers 5), else rope_theta with rope_scaling folded in
    # (transformers 4, as Qwen3-8B's config.json has it)
    rope = target.get("rope_parameters")
    if rope is None:
        scaling = target.get("rope_scaling")
        rope = {
            "rope_theta": target.get("rope_theta"),
            **(scaling if isinstance(scaling, dict) else {}),
        }
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    data["rope_parameters"] = rope
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
        bos_token_id=_token(target.get("bos_token_id")),
        eos_token_id=_token(target.get("eos_token_id")),
    )
    return arch.parse_config(data)


def _token(value: Any) -> int | None:
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
DEFAULT_PRESET, QWEN3_PRESET = "tiny", "qwen3-tiny"  # without --preset: by the target's kind


def spread_layer_ids(depth: int, count: int) -> tuple[int, ...]:
    """``count`` layer-output ids spread evenly from layer 1 to layer N−2 (rounded half up):
    past the first layer, short of the last one, whose output is already close to the logits
    (EAGLE-3's default ids 2, N//2, N−3 cover about the same span in the hidden-states-index
    convention).  Gives the small preset's ids for N = 24; fewer ids when N is too shallow."""
    if depth < 3:
        raise QStreamError(f"the target has {depth} layers; a draft needs a target of 3 or more")
    count = min(count, depth - 2)
    if count == 1:
        return (depth // 2,)
    step = (depth - 3) / (count - 1)
    return tuple(math.floor(1 + i * step + 0.5) for i in range(count))


def _mask_id(target: Path, tok: Tokenizer, vocab_size: int) -> int:
    """The tokenizer's mask token, else ``<|mask|>``, else its pad token, else the last id."""
    names = []
    config_path = target / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        names = [config.get("mask_token"), "<|mask|>", config.get("pad_token")]
    for name in [*names, "<|mask|>"]:
        if isinstance(name, dict):
            name = name.get("content")
        token = tok.token_to_id(name) if isinstance(name, str) else None
        if token is not None and token < vocab_size:
            return token
    return vocab_size - 1


def target_preset(shape: TargetShape, preset: str | None) -> str:
    """``preset``, checked against the target's kind (Qwen3 or DSpark-MLA); None: its tiny one."""
    qwen3 = shape.model_type in QWEN3_MODEL_TYPES
    wanted = preset_architecture(QWEN3_PRESET if qwen3 else DEFAULT_PRESET).config_type
    if preset is None:
        return QWEN3_PRESET if qwen3 else DEFAULT_PRESET
    if not issubclass(preset_architecture(preset).config_type, wanted):
        kind = "Qwen3-style" if qwen3 else "a DSpark-MLA one, not Qwen3-style"
        fits = sorted((a for a in ARCHITECTURES if issubclass(a.config_type, wanted)),
                      key=lambda a: a.config_type is not wanted)  # fmt: skip
        names = [p for a in fits for p in a.presets]
        raise QStreamError(
            f"--preset {preset}: {shape.path} is a {shape.model_type or 'non-Qwen3'} target, "
            f"whose draft is {kind}: --preset {' or '.join(names)}"
        )
    return preset


def target_draft_config(shape: TargetShape, tok: Tokenizer, preset: str) -> DraftConfig:
    if tok.get_vocab_size() > shape.vocab_size:
        raise QStreamError(
            f"{shape.path}: tokenizer.json has {tok.get_vocab_size()} tokens, more than "
            f"config.json's vocab_size {shape.vocab_size}"
        )
    arch = preset_architecture(preset)
    base = arch.presets[preset]
    ids = spread_layer_ids(shape.num_hidden_layers, base.num_target_layers)
    mask = _mask_id(Path(shape.path), tok, shape.vocab_size)
    if shape.model_type in QWEN3_MODEL_TYPES:
        path = Path(shape.path) / "config.json"
        try:
            return qwen3_draft_config(read_config(Path(shape.path)), shape, base, ids, mask, arch)
        except ValueError as exc:
            raise QStreamError(f"{path}: {str(exc).removeprefix('config.json: ')}") from None
    return replace(
        base,
        hidden_size=shape.hidden_size,
        target_hidden_size=shape.hidden_size,
        target_num_hidden_layers=shape.num_hidden_layers,
        target_layer_ids=ids,
        num_target_layers=len(ids),
        vocab_size=shape.vocab_size,
        mask_token_id=mask,
    )


def synth_for_target(
    target: str | Path,
    output_dir: str | Path,
    preset: str | None = None,
    seed: int = 0,
    corpus: str | Path | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> SynthSummary:
    """Write a draft for ``target`` to ``output_dir``, complete or not at all (lm_head is the
    target's, borrowed with ``--target``)."""
    shape = read_target_shape(target)
    preset = target_preset(shape, preset)
    output = Path(output_dir).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    check_target(output, overwrite, "--output_dir")
    try:
        tok = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises its own exception types
        raise QStreamError(f"--target {Path(target)}: cannot load tokenizer.json ({exc})") from None
    config = target_draft_config(shape, tok, preset)
    texts = read_corpus(corpus) if corpus is not None else builtin_corpus(seed=seed)
    w1, w2, alpha, top1 = _markov_head(tok, texts, config, seed)
    small = _small_tensors(config, seed, w1, w2)
    if architecture_of(config).ships_embed_tokens:
        small[EMBED] = read_target_tensors(target, [EMBED])[EMBED].float()
        if tuple(small[EMBED].shape) != (config.vocab_size, config.hidden_size):
            raise QStreamError(f"{target}: {EMBED} has shape {list(small[EMBED].shape)}")

    def write_tok(tmp: Path) -> None:
        for name in TOKENIZER_FILES:
            if (Path(target) / name).is_file():
                shutil.copyfile(Path(target) / name, tmp / name)

    plan = _Plan(config, small, 0.0, seed)
    return publish_draft(output, overwrite, preset, corpus, plan, alpha, top1, write_tok,
                         progress, target=shape.identity())  # fmt: skip
