"""The shapes vLLM builds for a K3 DSpark draft from its config.json, as the checkpoint must
store them: the model's tensor table (:func:`qstream.model.tensors.tensor_shapes`) with each
quantized Linear weight replaced by the tensors its format stores (docs/formats.md).

vLLM sizes every parameter from config.json and copies each checkpoint tensor into it; a
tensor of another shape fails its loader (or, for a width the config leaves open such as the
confidence head's, the checkpoint was written for a config vLLM does not read).

>>> stored_shapes("nvfp4", 96, 64)
{'weight_packed': (96, 32), 'weight_scale': (96, 4), 'weight_global_scale': (1,)}
"""

from __future__ import annotations

from collections.abc import Mapping

from qstream.formats import FORMATS
from qstream.model.config import DSparkConfig
from qstream.model.tensors import shape_hint, tensor_shapes


def stored_shapes(fmt: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """What a ``[n, k]`` weight quantized to ``fmt`` is stored as, by suffix (docs/formats.md):
    FP8 ``weight [N, K]``, ``weight_scale [N, 1]``; the 4-bit formats ``weight_packed
    [N, K/2]`` (two E2M1 codes a byte), ``weight_scale [N, K/block]``, NVFP4 also
    ``weight_global_scale [1]``."""
    if fmt == "fp8":
        return {"weight": (n, k), "weight_scale": (n, 1)}
    shapes: dict[str, tuple[int, ...]] = {
        "weight_packed": (n, k // 2),
        "weight_scale": (n, k // FORMATS[fmt].block_size),
    }
    if fmt == "nvfp4":
        shapes["weight_global_scale"] = (1,)
    return shapes


def expected_shapes(
    config: DSparkConfig, fmt: str, quantized: set[str]
) -> dict[str, tuple[int, ...]]:
    """Every tensor name vLLM loads for ``config`` -> the shape it must have, with the modules
    in ``quantized`` stored as ``fmt``."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in tensor_shapes(config).items():
        module, _, suffix = name.rpartition(".")
        if module in quantized and suffix == "weight" and len(shape) == 2:
            out.update({f"{module}.{s}": v for s, v in stored_shapes(fmt, *shape).items()})
        else:
            out[name] = shape
    return out


def shape_problems(
    config_json: Mapping, stored: Mapping[str, tuple[int, ...]], fmt: str, quantized: set[str]
) -> list[str]:
    """One line per stored tensor whose shape differs from what vLLM builds from
    ``config_json``, naming the tensor, its stored shape and the expected one.  Tensors the
    draft does not define are left to the other checks (vLLM drops some, e.g. the confidence
    head of a config without one)."""
    try:
        config = DSparkConfig.from_json(dict(config_json))
    except ValueError as exc:
        return [f"{exc}; cannot check the stored shapes against what vLLM builds from it"]
    expected = expected_shapes(config, fmt, quantized)
    return [
        f"{name}: stored {list(shape)}, vLLM builds {list(expected[name])} from config.json"
        f"{shape_hint(config, name, shape)}"
        for name, shape in stored.items()
        if name in expected and tuple(shape) != expected[name]
    ]
