"""``qstream synth --target HF_DIR``: a synthetic DSpark draft shaped for a real Hugging Face
target (docs/model.md, "A draft for a Hugging Face target"), so that capture → eval-drift →
card runs end to end on that target's architecture.

From the target it takes: ``hidden_size`` (the draft's H and ``target_hidden_size``, so the
draft reads the target's ``lm_head`` and carries a copy of its ``embed_tokens``), the depth
(``target_num_hidden_layers`` and the ``target_layer_ids`` of :func:`spread_layer_ids`), the
vocabulary and the tokenizer (copied); the Markov statistics are the corpus's, tokenized with
that tokenizer.  Everything else (widths of the draft's own layers, rope) is the preset's.
The draft has no ``target_head/``: ``lm_head`` is borrowed at load time with ``--target``.

>>> synth_for_target("TARGET_DIR", "draft/", corpus="gsm8k/train.jsonl")
>>> load_model("draft/", target="TARGET_DIR")
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tokenizers import Tokenizer

import qstream
from qstream.arch.dspark_mla.load import EMBED
from qstream.arch.interface import DraftConfig
from qstream.arch.registry import DEFAULT_ARCH
from qstream.checkpoint.dequantized import read_target_tensors
from qstream.checkpoint.target import TargetShape, read_target_shape
from qstream.errors import QStreamError
from qstream.publish import SYNTH_RECORD, check_target, publishing
from qstream.synth.corpus import builtin_corpus, read_corpus
from qstream.synth.draft import (
    SynthSummary,
    _markov_head,
    _Plan,
    _small_tensors,
    _write_tensors,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


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
    """The draft's mask token: the tokenizer's mask token, else ``<|mask|>``, else its pad
    token, else the last id of the vocabulary (a padding row in most padded vocabularies)."""
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


def target_draft_config(shape: TargetShape, tok: Tokenizer, preset: str) -> DraftConfig:
    """The preset reshaped for the target (module docstring)."""
    if tok.get_vocab_size() > shape.vocab_size:
        raise QStreamError(
            f"{shape.path}: tokenizer.json has {tok.get_vocab_size()} tokens, more than "
            f"config.json's vocab_size {shape.vocab_size}"
        )
    base = DEFAULT_ARCH.presets[preset]
    ids = spread_layer_ids(shape.num_hidden_layers, base.num_target_layers)
    return replace(
        base,
        hidden_size=shape.hidden_size,
        target_hidden_size=shape.hidden_size,
        target_num_hidden_layers=shape.num_hidden_layers,
        target_layer_ids=ids,
        num_target_layers=len(ids),
        vocab_size=shape.vocab_size,
        mask_token_id=_mask_id(Path(shape.path), tok, shape.vocab_size),
    )


def _load_tokenizer(target: Path) -> Tokenizer:
    path = target / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception types
        raise QStreamError(f"--target {target}: cannot load tokenizer.json ({exc})") from None


def synth_for_target(
    target: str | Path,
    output_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    corpus: str | Path | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SynthSummary:
    """Write a draft for ``target`` to ``output_dir``, complete or not at all."""
    shape = read_target_shape(target)
    output = Path(output_dir).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    check_target(output, overwrite, "--output_dir")
    tok = _load_tokenizer(Path(target))
    config = target_draft_config(shape, tok, preset)
    texts = read_corpus(corpus) if corpus is not None else builtin_corpus(seed=seed)
    w1, w2, alpha, top1 = _markov_head(tok, texts, config, seed)
    small = _small_tensors(config, seed, w1, w2)
    small[EMBED] = read_target_tensors(target, [EMBED])[EMBED].float()
    if tuple(small[EMBED].shape) != (config.vocab_size, config.hidden_size):
        raise QStreamError(f"{target}: {EMBED} has shape {list(small[EMBED].shape)}")
    shapes = DEFAULT_ARCH.tensor_shapes(config)
    with publishing(output, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(target) / name).is_file():
                shutil.copyfile(Path(target) / name, tmp / name)
        size = _write_tensors(tmp, shapes, _Plan(config, small, 0.0, seed), progress, False)
        summary = SynthSummary(
            str(output), preset, seed, str(corpus) if corpus else "built-in", len(shapes),
            sum(math.prod(s) for s in shapes.values()), size, alpha, top1,
        )  # fmt: skip
        record = {k: v for k, v in asdict(summary).items() if k != "output_dir"}
        (tmp / SYNTH_RECORD).write_text(
            json.dumps({"qstream_version": qstream.__version__, "summary": record,
                        "target": shape.identity()}, indent=2) + "\n"
        )  # fmt: skip
    return summary
