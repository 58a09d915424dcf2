"""The activation and KV-cache schemes a checkpoint declares beyond its weights, and the
calibrated scales a static one stores (docs/quantize.md, "Activation and KV-cache schemes").
The formulas are compressed-tensors' (tests/test_quantize_schemes.py): ``calculate_qparams``
(``amax / 448``) and ``generate_gparam`` (``448 * 6 / amax``, float32), on an amax in the
weight dtype (``initialize_qparams``; both shape [1]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qstream.checkpoint.files import Checkpoint
from qstream.checkpoint.layout import KV_CACHE_SCHEMES, KV_SCALES, input_scale_name
from qstream.errors import QStreamError
from qstream.formats.fp8 import amax_scale
from qstream.formats.nvfp4 import global_scale
from qstream.quant.select import Selection, share_group_amax
from qstream.regimes import AUX_REGIMES
from qstream.serving import ACTIVATIONS, Activations
from qstream.vllm.profiles import KV_SCALES_NOT_LOADED, profile_for

NEEDS_CALIBRATION = (
    f"needs calibrated scales: pass --calibration (a regime, {', '.join(AUX_REGIMES)}, or "
    "captured states)"
)


@dataclass(frozen=True)
class Serving:
    """How inputs and KV cache are served, and the scales to store, keyed by the tensor each
    is written after."""

    activations: Activations = ACTIVATIONS["none"]
    kv_cache: str | None = None
    scales: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    calibration: Any = None  # a qstream.calibration.Calibration


def input_scale(activations: Activations, amax: float, dtype: torch.dtype) -> torch.Tensor:
    """``[1]`` stored input scale: FP8 static ``input_scale`` in ``dtype``, NVFP4
    ``input_global_scale`` float32."""
    observed = torch.tensor([amax], dtype=torch.float32).to(dtype)
    if input_scale_name(activations) == "input_global_scale":
        return global_scale(observed)
    return amax_scale(observed)


def kv_scales(amax: tuple[float, float], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``k_scale`` and ``v_scale`` ([1], ``dtype``) of one attention layer's K and V amax."""
    return {
        name: amax_scale(torch.tensor([a], dtype=torch.float32).to(dtype))
        for name, a in zip(KV_SCALES, amax)
    }


def checked_amax(what: str, module: str, amax: torch.Tensor | None) -> float:
    if amax is None:
        raise QStreamError(f"{module}: calibration holds no {what} amax")
    value = float(amax)
    if not (value > 0 and value != float("inf")):
        raise QStreamError(f"{module}: calibrated {what} amax {value!r} must be finite and > 0")
    return value


def serving_schemes(
    checkpoint: Checkpoint,
    fmt: str,
    selection: Selection,
    activations: str,
    kv_cache_scheme: str | None,
    calibration: Any,
) -> Serving:
    """The schemes and their scales.  ``calibration``: a Calibration, a callable that runs one
    (called once the options need it), or None."""
    if activations not in ACTIVATIONS:
        raise QStreamError(f"--activations {activations!r}: choose one of {', '.join(ACTIVATIONS)}")
    act = ACTIVATIONS[activations]
    if act.weights and fmt not in act.weights:
        raise QStreamError(
            f"--activations {act.name}: served with {' or '.join(act.weights)} weights "
            f"(vLLM's {act.vllm_scheme}), not --quant_format {fmt}"
        )
    if kv_cache_scheme is not None:
        _check_kv_scheme(checkpoint, kv_cache_scheme)
    stored = input_scale_name(act)
    if stored is None and kv_cache_scheme is None:
        if callable(calibration):
            raise QStreamError(
                "--calibration: only a static scheme stores calibrated scales (--activations "
                "fp8-static or nvfp4, --kv-cache-scheme fp8)"
            )
        return Serving(act)
    option = f"--activations {act.name}" if stored else f"--kv-cache-scheme {kv_cache_scheme}"
    if calibration is None:
        raise QStreamError(f"{option}: {NEEDS_CALIBRATION}")
    if callable(calibration):
        calibration = calibration()
    scales: dict[str, dict] = {}
    if stored is not None:
        amaxes = {
            m: checked_amax("input", m, calibration.input_amax(m)) for m in selection.quantized
        }
        # a fused layer keeps one input scale (vLLM's .max() over its shards), so each group
        # shares its members' largest amax: no member's input saturates (docs/quantize.md)
        for module, amax in share_group_amax(amaxes, selection.fused_groups).items():
            weight = checkpoint.info(f"{module}.weight")
            scales[weight.name] = {f"{module}.{stored}": input_scale(act, amax, weight.torch_dtype)}
    if kv_cache_scheme is not None:
        for anchor, kv in _kv_scales(checkpoint, calibration).items():
            scales[anchor] = {**scales.get(anchor, {}), **kv}
    return Serving(act, kv_cache_scheme, scales, calibration)


def _check_kv_scheme(checkpoint: Checkpoint, scheme: str) -> None:
    if scheme not in KV_CACHE_SCHEMES:
        raise QStreamError(f"--kv-cache-scheme {scheme!r}: choose {', '.join(KV_CACHE_SCHEMES)}")
    refused = KV_SCALES_NOT_LOADED.get(profile_for(checkpoint.config).name)
    if refused:
        raise QStreamError(f"--kv-cache-scheme {scheme}: {refused} (docs/vllm.md)")


def _kv_scales(checkpoint: Checkpoint, calibration: Any) -> dict[str, dict]:
    """Each attention layer's k_scale / v_scale, keyed by its last stored tensor."""
    attn = ".self_attn."  # the attention module of every architecture qstream knows
    last = {n[: n.index(attn) + len(attn) - 1]: n for n in checkpoint.tensor_shard if attn in n}
    scales = {}
    for attention, anchor in last.items():
        amax = zip("KV", calibration.kv_amax(attention))
        k, v = (checked_amax(what, attention, a) for what, a in amax)
        dtype = checkpoint.info(anchor).torch_dtype
        scales[anchor] = {f"{attention}.{n}": t for n, t in kv_scales((k, v), dtype).items()}
    return scales


def serving_record(serving: Serving, command: bool = False) -> dict:
    """The options that declared ``serving`` (none for weight-only), with the calibration's
    source (``command``: its own options instead, as the equivalent command gives them)."""
    record: dict[str, Any] = {}
    if serving.activations.vllm_scheme is not None:
        record["activations"] = serving.activations.name
    if serving.kv_cache is not None:
        record["kv_cache_scheme"] = serving.kv_cache
    if serving.scales and serving.calibration is not None:
        source = serving.calibration.source
        if command:
            record.update(source.get("options", {}))
        else:
            record["calibration"] = source
    return record
