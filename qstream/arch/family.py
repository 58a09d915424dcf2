"""What every draft architecture shares (docs/model.md, "Architectures"): the descriptor's
common calls, the config.json fields read and checked the same way, loading, and the checks of a
batch of blocks, a tensor table and a d2t map.  Pure Python at import (``qstream quantize``
checks a draft's shapes without torch): torch is imported where a call needs it."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from qstream.arch.interface import EMBED, LM_HEAD, TARGET_HEAD_DIR, DraftConfig, Drafter
from qstream.errors import QStreamError
from qstream.serving import DEFAULTS

Shapes = Mapping[str, tuple[int, ...]]

CONFIDENCE_WEIGHT = "confidence_head.proj.weight"
D2T = "d2t"  # [draft_vocab] int64: target id = draft id + d2t[draft id] (vLLM's draft_id_to_target_id)
T2D = "t2d"  # [vocab] bool, training only (vLLM 0.32's load_weights skip it)
# Integer tensors read as stored, with the dtypes each may have (d2t's: d2t_problem).
INDEX_TENSORS = {D2T: ("torch.int64", "torch.int32"), T2D: ("torch.bool", "torch.uint8")}


class Sizes:
    """The sizes every draft config derives the same way."""

    @property
    def aux_size(self: Any) -> int:
        """A: width of one position's aux context (all selected target layers concatenated)."""
        return self.num_target_layers * self.target_hidden_size

    @property
    def reduced_vocab(self: Any) -> bool:
        """A draft vocabulary smaller than the target's: own lm_head and d2t required."""
        return getattr(self, "draft_vocab_size", self.vocab_size) < self.vocab_size


class DSparkFamily:
    """The descriptor calls the same in every DSpark; ``build``, ``causal_stream`` and the FLOP
    model are ``model_module``'s, imported with torch when first called."""

    config_type: type
    model_module: str  # the forward and FLOP model
    model_class: str  # the module's draft model class
    quantize_include: tuple[str, ...]  # --include_layers' default (pure Python: --help reads it)
    presets: Mapping[str, Any]
    serving: tuple[Mapping[str, Any], ...]
    final_norm = "norm.weight"
    context_proj = "fc"
    ships_embed_tokens = True
    embeds_with_target = False
    not_evaluated: str | None = None
    not_captured: str | None = None
    not_calibrated: str | None = None

    def parse_config(self, data: Mapping[str, Any]) -> Any:
        return self.config_type.from_json(dict(data))  # type: ignore[attr-defined]

    def shape_hint(self, config: Any, name: str, shape: tuple[int, ...]) -> str:
        return shape_hint(config, name, shape)

    @property
    def drafter(self) -> Drafter:
        return importlib.import_module("qstream.arch.markov").BLOCK_DRAFTER

    def build(
        self, config: Any, weights: Any, variant: Any, device: Any = "cpu", served: Any = None
    ) -> Any:
        """The model serving ``weights`` as ``variant`` says; ``served`` (weights.py's
        ServedLinears, qstream/eval/variants.py's ``served_linears``) must hold its linears'
        input quantizers, KV-cache scales and drafting head (ValueError naming the missing)."""
        if variant.activation.strategy is not None and not (served and served.inputs):
            raise ValueError(f"variant {variant.name}: its linears' input quantizers are missing")
        if variant.kv_scale != DEFAULTS["kv_scale"] and not (served and served.kv_scales):
            raise ValueError(f"variant {variant.name}: its KV-cache scales are missing")
        if variant.head != DEFAULTS["head"] and not (served and served.products):
            raise ValueError(f"variant {variant.name}: its quantized drafting head is missing")
        model = getattr(importlib.import_module(self.model_module), self.model_class)
        return model(
            config, weights, dtype=variant.dtype, device=device, kv=variant.kv, served=served
        )

    def causal_stream(self, model: Any, ids: Any, dtype: Any, depth: int | None = None) -> Any:
        return importlib.import_module(self.model_module).CausalStream(model, ids, dtype, depth)

    def context_flops(self, config: Any) -> float:
        return importlib.import_module(self.model_module).context_flops(config)

    def drafted_flops(self, config: Any, anchor: Any) -> float:
        return importlib.import_module(self.model_module).drafted_flops(config, anchor)

    def causal_flops(self, config: Any, T: int) -> float:
        return importlib.import_module(self.model_module).causal_flops(config, T)


def shape_hint(config: DraftConfig, name: str, shape: tuple[int, ...]) -> str:
    """Why a confidence head of the other width does not fit (vLLM 0.32 sizes it from
    ``confidence_head_with_markov``, default false); empty for every other mismatch."""
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
    """A model's ``draft`` arguments as 1-D int64 tensors of one length, checked."""
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


def context_lengths(aux_size: int, aux: Any, lengths: Any) -> tuple[int, int, Any]:
    """S, T and ``lengths`` [S] int64 on the CPU (default: all T) of aux [S, T, aux_size]."""
    import torch

    if len(aux.shape) != 3 or aux.shape[-1] != aux_size:
        raise ValueError(f"aux must be [S, T, {aux_size}], got {list(aux.shape)}")
    S, T, _ = aux.shape
    lengths = torch.full((S,), T) if lengths is None else torch.as_tensor(lengths).cpu()
    return S, T, lengths.to(torch.int64)


def check_table(
    required: Shapes,
    allowed: Shapes,
    shapes: Shapes,
    where: str,
    what: str,
    hint: Callable[[str, tuple[int, ...]], str],
    why_missing: Callable[[str], str] = lambda name: "",
) -> None:
    """QStreamError naming the first tensor of ``shapes`` missing from ``required``, outside
    ``allowed`` or misshapen (``hint`` explains), and ``where``."""
    for name in required:
        if name not in shapes:
            raise QStreamError(
                f"{where}: missing tensor {name!r} (expected shape {list(required[name])}"
                f"{why_missing(name)})"
            )
    for name, shape in shapes.items():
        if name not in allowed:
            raise QStreamError(
                f"{where}: unexpected tensor {name!r} {list(shape)} "
                f"(not part of a {what} of this config)"
            )
        if tuple(shape) != allowed[name]:
            raise QStreamError(
                f"{where}: tensor {name!r} has shape {list(shape)}, expected "
                f"{list(allowed[name])}{hint(name, shape)}"
            )


def borrow_from_target(
    model_dir: Path,
    target: str | Path | None,
    names: list[str],
    expected: tuple[int, ...],
    missing: str,
    read: Callable[[Path, list[str]], dict] | None = None,
) -> dict:
    """``names`` of shape ``expected`` read from ``target`` (default ``model_dir/target_head``)
    by ``read`` (default ``read_target_tensors``); a target with tied word embeddings (SmolLM2)
    lends embed_tokens for lm_head, as vLLM's draft shares the target's head."""
    if target is None:
        target = model_dir / TARGET_HEAD_DIR
        if not target.is_dir():
            raise QStreamError(
                f"{model_dir}: the draft has no {missing} of its own; pass the "
                f"target checkpoint (--target DIR) or add {TARGET_HEAD_DIR}/"
            )
    from qstream.checkpoint.files import read_config
    from qstream.checkpoint.read import read_target_tensors

    read, path = read or read_target_tensors, Path(target)
    tied = (path / "config.json").exists() and read_config(path).get("tie_word_embeddings")
    if tied and LM_HEAD in names:
        out = read(path, [EMBED])
        borrowed = {n: out[EMBED] for n in names}
    else:
        borrowed = read(path, names)
    for name, tensor in borrowed.items():
        if tuple(tensor.shape) != expected:
            raise QStreamError(
                f"{target}: {name} has shape {list(tensor.shape)}, the draft needs {list(expected)}"
            )
    return borrowed


def read_indexed(
    directory: str | Path, config: Any, check_tensors: Callable, rename: Callable = str
) -> dict:
    """Every tensor of a draft checkpoint with index maps (Qwen3-style DSpark, EAGLE-3) under
    its ``rename``d name, dequantized and checked, t2d dropped, d2t as int64 offsets."""
    from qstream.checkpoint.read import read_draft_checkpoint

    directory = Path(directory)
    floats, index = read_draft_checkpoint(directory, INDEX_TENSORS)
    tensors = {rename(k): v for k, v in {**floats, **index}.items()}
    if T2D in tensors and str(tensors[T2D].dtype) not in INDEX_TENSORS[T2D]:
        raise QStreamError(f"{directory}: tensor {T2D!r} is {tensors[T2D].dtype}, not an index map")
    check_tensors(config, {k: tuple(v.shape) for k, v in tensors.items()}, str(directory))
    tensors.pop(T2D, None)
    if D2T in tensors:
        if problem := d2t_problem(tensors[D2T], config.vocab_size):
            raise QStreamError(f"{directory}: {problem}")
        tensors[D2T] = tensors[D2T].long()
    return tensors


def borrowing_loader(read_draft_tensors: Callable[[Any, Any], dict]) -> Callable[..., dict]:
    """An architecture's ``load_weights(model_dir, target, config, noted=None)``: the draft's
    tensors plus those of embed_tokens and lm_head they lack, from ``target`` (default
    ``model_dir/target_head``); a stored embed_tokens serves, so ``noted`` is never called."""

    def load_weights(model_dir: str | Path, target: Any, config: Any, noted: Any = None) -> dict:
        tensors = read_draft_tensors(model_dir, config)
        wanted = [n for n in (EMBED, LM_HEAD) if n not in tensors]
        if not wanted:
            return tensors
        expected = (config.vocab_size, config.hidden_size)
        lent = borrow_from_target(Path(model_dir), target, wanted, expected, " or ".join(wanted))
        return {**tensors, **lent}

    return load_weights


def load_noting_embed(
    arch: Any, model_dir: str | Path, target: str | Path | None, config: Any
) -> tuple[dict, dict]:
    """``arch.load_weights`` and what the results record when the target's embed_tokens replaced
    a different stored copy (``{}`` otherwise), said once on stderr."""
    from qstream.publish import stderr_notice

    embed: dict = {}
    weights = arch.load_weights(model_dir, target, config, embed.update)
    if embed:
        stderr_notice(
            f"{model_dir}: the draft's stored embed_tokens differ from the target's "
            f"({embed['target']}; max |diff| {embed['max_abs_diff']:.6g}); the draft embeds "
            "with the target's, as vLLM serves it (docs/model.md)"
        )
    return weights, embed


def d2t_problem(d2t: Any, vocab_size: int) -> str | None:
    """Why ``d2t`` does not map every draft id ``d`` to its own target id ``d + d2t[d]`` in
    [0, vocab_size), else None: the one check loading, quantize and verify make."""
    if str(d2t.dtype) not in ("torch.int64", "torch.int32"):
        return f"tensor {D2T!r} is {str(d2t.dtype).removeprefix('torch.')}, expected int64 offsets"
    target = d2t.long() + d2t.new_tensor(range(len(d2t))).long()
    bad = ((target < 0) | (target >= vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        return (f"{D2T}[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(target[i])}, "
                f"outside the target vocabulary [0, {vocab_size})")  # fmt: skip
    ids, order = target.sort(stable=True)
    same = (ids[1:] == ids[:-1]).nonzero()
    if len(same):
        i, j = int(order[int(same[0])]), int(order[int(same[0]) + 1])
        return (f"{D2T}[{j}] = {int(d2t[j])} maps draft id {j} to target id {int(target[j])}, "
                f"as {D2T}[{i}] = {int(d2t[i])} maps draft id {i}: each draft id needs its own")  # fmt: skip
    return None


def check(ok: bool, key: str, value: Any, why: str) -> None:
    """ValueError ``config.json: key = value why`` unless ``ok``."""
    if not ok:
        raise ValueError(f"config.json: {key} = {value!r} {why}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(v: Any) -> bool:
    return is_int(v) and v > 0


def number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_positive_ints(config: Any, names: Iterable[str], key=lambda name: name) -> None:
    for f in names:
        check(positive_int(getattr(config, f)), key(f), getattr(config, f),
              "must be a positive integer")  # fmt: skip


def check_flags(config: Any, names: Iterable[str]) -> None:
    for f in names:
        check(isinstance(getattr(config, f), bool), f, getattr(config, f), "must be true or false")


def check_target_layers(ids: tuple[Any, ...], n: int | None) -> None:
    top = n if n is not None else math.inf
    where = f"[0, {n})" if n is not None else ">= 0"
    check(len(ids) > 0 and all(is_int(i) and 0 <= i < top for i in ids), "target_layer_ids",
          list(ids), f"must be layer indices in {where}")  # fmt: skip
    check(len(set(ids)) == len(ids), "target_layer_ids", list(ids), "must not repeat")


def check_attention(config: Any) -> None:
    """The checks a Llama-style attention layer's config passes (Qwen3-style DSpark, EAGLE-3):
    rms_norm_eps, grouped heads, an even head_dim, a draft vocabulary within the target's."""
    c = config
    check(number(c.rms_norm_eps) and c.rms_norm_eps > 0, "rms_norm_eps", c.rms_norm_eps,
          "must be positive")  # fmt: skip
    n, kv = c.num_attention_heads, c.num_key_value_heads
    check(n % kv == 0, "num_key_value_heads", kv, f"must divide num_attention_heads ({n})")
    check(c.head_dim % 2 == 0, "head_dim", c.head_dim, "must be even (RoPE pairs)")
    check(c.draft_vocab_size <= c.vocab_size, "draft_vocab_size", c.draft_vocab_size,
          f"must not exceed the target's vocab_size ({c.vocab_size})")  # fmt: skip


def refuse_unmodelled(table: Iterable, value_of: Callable[[str], Any], types: Any) -> None:
    """ValueError for a ``(key, fine values, what)`` of ``table`` at a value not computed, or
    sliding-window ``layer_types``."""
    for key, fine, what in table:
        value = value_of(key)
        check(any(value is v or (number(v) and value == v) for v in fine), key, value,
              f"makes {what}, which qstream does not evaluate yet")  # fmt: skip
    check(not any(t == "sliding_attention" for t in types), "layer_types", types,
          "has sliding-window layers, which qstream does not evaluate yet")  # fmt: skip


def check_mask_token(config: Any) -> None:
    mask, vocab = config.mask_token_id, config.vocab_size
    check(isinstance(mask, int) and 0 <= mask < vocab, "mask_token_id", mask,
          f"must be a token id in [0, {vocab})")  # fmt: skip


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, as vLLM 0.32's yarn_get_mscale
    (vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def decoder_layer_shapes(
    c: Any, p: str, attention_input: int, bias: tuple[str, ...], qk_norm: bool
) -> dict[str, tuple[int, ...]]:
    """One Llama/Qwen3 decoder layer's tensors under prefix ``p`` in checkpoint order: q/k/v/o
    reading ``attention_input`` wide, a bias on each projection named in ``bias``, q_norm/k_norm
    when ``qk_norm``, then the SwiGLU MLP (the Qwen3-style DSpark's layers, EAGLE-3's midlayer)."""
    H, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (H,)}
    for name, out, inp in (("q", q, attention_input), ("k", kv, attention_input),
                           ("v", kv, attention_input), ("o", H, q)):  # fmt: skip
        shapes[f"{p}self_attn.{name}_proj.weight"] = (out, inp)
        if name in bias:
            shapes[f"{p}self_attn.{name}_proj.bias"] = (out,)
    if qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, H)
    shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, H)
    shapes[p + "mlp.down_proj.weight"] = (H, c.intermediate_size)
    return shapes


def head_shapes(config: Any, markov_w2_rows: int) -> dict[str, tuple[int, ...]]:
    """The Markov head's tables (``markov_rank`` > 0) and the confidence head (when enabled)."""
    H, r = config.hidden_size, config.markov_rank
    shapes: dict[str, tuple[int, ...]] = {}
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (config.vocab_size, r)
        shapes["markov_head.markov_w2.weight"] = (markov_w2_rows, r)
    if config.enable_confidence_head:
        shapes[CONFIDENCE_WEIGHT] = (1, H + (r if config.confidence_head_with_markov else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def fields_json(config: Any, key=lambda name: name, skip_none: bool = False) -> dict[str, Any]:
    """Every field under its config.json ``key``, in field order (``skip_none``: None left out)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name == "rope_parameters":
            value = value.to_json()
        elif isinstance(value, tuple):
            value = list(value)
        if value is not None or not skip_none:
            out[key(f.name)] = value
    return out


def check_object(data: Any) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"config.json must hold an object, not {type(data).__name__}")


def read_fields(
    cls: type,
    data: Mapping[str, Any],
    key: Callable[[str], str] = lambda name: name,
    optional: tuple[str, ...] = (),
    skip_none: bool = False,
) -> dict[str, Any]:
    """``cls``'s fields read from ``data`` under their config.json ``key`` (ValueError naming the
    first missing required key; ``skip_none``: a null is missing)."""
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if key(f.name) in data and not (skip_none and data[key(f.name)] is None):
            kwargs[f.name] = data[key(f.name)]
        elif f.default is MISSING and f.name not in optional:
            raise ValueError(f"config.json: missing key {key(f.name)!r}")
    return kwargs


def ids_tuple(kwargs: dict[str, Any], name: str, key: str) -> None:
    """``kwargs[name]``, a list of ids read from config.json's ``key``, as a tuple (if read)."""
    if name in kwargs:
        check(isinstance(kwargs[name], list), key, kwargs[name], "must be a list")
        kwargs[name] = tuple(kwargs[name])


def rope_of(cls: type, rope: Mapping[str, Any], ignored=lambda key, value: False) -> Any:
    """``cls`` of the ``rope_parameters`` keys it models (ValueError naming another key set,
    unless ``ignored``: vLLM's get_rope reads more keys than qstream models)."""
    names = {f.name for f in fields(cls)}
    for key, value in rope.items():
        check(key in names or value is None or ignored(key, value), f"rope_parameters.{key}",
              value, "is not evaluated by qstream")  # fmt: skip
    return construct(cls, {k: v for k, v in rope.items() if k in names}, "rope_parameters: ")


def speculators_layer(data: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """speculators' saved layout: ``transformer_layer_config``'s keys, then ``keys`` set at the
    top level."""
    layer = data.get("transformer_layer_config")
    check(isinstance(layer, dict), "transformer_layer_config", layer, "must be an object")
    assert isinstance(layer, dict)
    return {**layer, **{k: data[k] for k in keys if data.get(k) is not None}}


def construct(cls: type, kwargs: Mapping[str, Any], where: str = "") -> Any:
    """``cls(**kwargs)``, a TypeError as a ValueError."""
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"config.json: {where}{exc}") from None


def load_config(directory: str | Path, parse: Callable[[dict], Any]) -> Any:
    """``parse`` of a draft checkpoint's config.json, its ValueError a QStreamError."""
    from qstream.checkpoint.files import read_config  # torch-free, kept out of --help

    path = Path(directory) / "config.json"
    data = read_config(Path(directory))
    try:
        return parse(data)
    except ValueError as exc:
        message = f"{path}: {exc}".replace("config.json: config.json:", "config.json:")
        raise QStreamError(message) from None
