"""The config.json fields every DSpark-family draft reads the same way (docs/model.md,
"Architectures"): how a config dataclass is read from and written to config.json, the checks
its fields share, YaRN's magnitude correction, and the head tensors the fields imply.  Pure
Python: ``qstream quantize`` checks a draft's shapes without torch.

>>> kwargs = read_fields(DSparkConfig, data)      # ValueError naming a missing key
>>> config = construct(DSparkConfig, kwargs)       # ValueError naming a bad value
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from qstream.arch.family import CONFIDENCE_WEIGHT
from qstream.errors import QStreamError


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
    """Each field of ``names`` a positive integer (``key``: its config.json key)."""
    for f in names:
        check(positive_int(getattr(config, f)), key(f), getattr(config, f),
              "must be a positive integer")  # fmt: skip


def check_flags(config: Any, names: Iterable[str]) -> None:
    for f in names:
        check(isinstance(getattr(config, f), bool), f, getattr(config, f), "must be true or false")


def check_target_layers(ids: tuple[Any, ...], n: int | None) -> None:
    """``target_layer_ids``: distinct indices of the target's ``n`` layers (any when None)."""
    top = n if n is not None else math.inf
    where = f"[0, {n})" if n is not None else ">= 0"
    check(len(ids) > 0 and all(is_int(i) and 0 <= i < top for i in ids), "target_layer_ids",
          list(ids), f"must be layer indices in {where}")  # fmt: skip
    check(len(set(ids)) == len(ids), "target_layer_ids", list(ids), "must not repeat")


def check_mask_token(config: Any) -> None:
    mask, vocab = config.mask_token_id, config.vocab_size
    check(isinstance(mask, int) and 0 <= mask < vocab, "mask_token_id", mask,
          f"must be a token id in [0, {vocab})")  # fmt: skip


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, DeepSeek-V3's form: 1 for ``factor <= 1``, else
    ``0.1 * mscale * ln(factor) + 1`` (vLLM 0.32's yarn_get_mscale in
    vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def head_shapes(config: Any, markov_w2_rows: int) -> dict[str, tuple[int, ...]]:
    """The Markov head's tables (when ``markov_rank`` > 0) and the confidence head (when
    enabled): [1, H+r] with ``confidence_head_with_markov``, else [1, H]; its bias [1]."""
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
    """Every field under its config.json ``key``, in field order: ``rope_parameters`` as its
    ``to_json()``, tuples as lists (with ``skip_none``, a None field is left out)."""
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
    """``cls``'s fields read from ``data`` under their config.json ``key``: ValueError naming
    the first missing key of a field with no default and not ``optional`` (with ``skip_none``,
    a null counts as missing); ``target_layer_ids`` must be a list, returned as a tuple."""
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if key(f.name) in data and not (skip_none and data[key(f.name)] is None):
            kwargs[f.name] = data[key(f.name)]
        elif f.default is MISSING and f.name not in optional:
            raise ValueError(f"config.json: missing key {key(f.name)!r}")
    ids = kwargs["target_layer_ids"]
    check(isinstance(ids, list), "target_layer_ids", ids, "must be a list")
    kwargs["target_layer_ids"] = tuple(ids)
    return kwargs


def construct(cls: type, kwargs: Mapping[str, Any], where: str = "") -> Any:
    """``cls(**kwargs)``, a TypeError (a string where a number belongs) as a ValueError."""
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"config.json: {where}{exc}") from None


def load_config(directory: str | Path, parse: Callable[[dict], Any]) -> Any:
    """``parse`` of a draft checkpoint's config.json: its ValueError a QStreamError naming the
    file, key and value."""
    from qstream.checkpoint.files import read_config  # torch-free, kept out of --help

    path = Path(directory) / "config.json"
    data = read_config(Path(directory))
    try:
        return parse(data)
    except ValueError as exc:
        message = f"{path}: {exc}".replace("config.json: config.json:", "config.json:")
        raise QStreamError(message) from None
