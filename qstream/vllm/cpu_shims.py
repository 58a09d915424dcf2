"""The CPU shims that let vLLM 0.32.0's own DSpark loader run without an accelerator, held only
for the duration of a load (:func:`cpu_shims`): Triton reported present, ``torch.accelerator
.empty_cache()`` a no-op, ``kv_b_proj`` flagged for the CPU linear, and a stand-in linear kernel
for the FP8/NVFP4/MXFP4 schemes, which run their own ``create_weights`` and
``process_weights_after_loading`` unchanged (docs/vllm.md, "Four CPU shims, and why", with
vLLM's files).  The same patches feed the :class:`~qstream.vllm.load_checks.Recorder`;
:func:`vllm_log` collects what vLLM logs while loading.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from qstream.vllm.load_checks import Recorder

# The kernel selector each scheme module of vLLM 0.32.0 calls for qstream's formats.
SCHEME_MODULES = {
    "compressed_tensors_w8a16_fp8": "init_wfp8_a16_linear_kernel",
    "compressed_tensors_w4a4_nvfp4": "init_nvfp4_linear_kernel",
    "compressed_tensors_w4a4_mxfp4": "init_mxfp4_linear_kernel",
}
_SCHEMES = "vllm.model_executor.layers.quantization.compressed_tensors.schemes."


@contextlib.contextmanager
def cpu_shims(recorder: Recorder) -> Iterator[None]:
    """The four bridges (module docstring), and ``recorder`` fed from vLLM's loader."""
    import vllm.config.vllm as vllm_config_module
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    get_all_weights = DefaultModelLoader.get_all_weights
    load_weights = DefaultModelLoader.load_weights
    after_loading = base_loader.process_weights_after_loading

    def fed(self, model_config, model):
        for name, tensor in get_all_weights(self, model_config, model):
            recorder.fed(name, tensor)
            yield name, tensor

    def loading(self, model, model_config):
        recorder.instrument(model)
        return load_weights(self, model, model_config)

    def post_processing(model, model_config, target_device):
        recorder.snapshot(model)
        for name, module in model.named_modules():
            if name.endswith("self_attn.kv_b_proj"):
                module._cpu_skip_gemm_dispatch = True
        return after_loading(model, model_config, target_device)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(vllm_config_module, "HAS_TRITON", True))
        stack.enter_context(mock.patch("torch.accelerator.empty_cache", lambda: None))
        stack.enter_context(mock.patch.object(DefaultModelLoader, "get_all_weights", fed))
        stack.enter_context(mock.patch.object(DefaultModelLoader, "load_weights", loading))
        stack.enter_context(
            mock.patch.object(base_loader, "process_weights_after_loading", post_processing)
        )
        for module_name, selector in SCHEME_MODULES.items():
            module = importlib.import_module(_SCHEMES + module_name)
            stack.enter_context(mock.patch.object(module, selector, _StandInKernel))
        yield


@contextlib.contextmanager
def vllm_log(sink: list[str]) -> Iterator[None]:
    """Collect what vLLM logs at WARNING or above while loading.  Some of its module loggers
    reach the root logger without passing the "vllm" one, so both are listened to."""
    seen: list[logging.LogRecord] = []  # held, so that a record reaching both is told apart

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name.startswith("vllm") and not any(r is record for r in seen):
                seen.append(record)
                sink.append(f"{record.levelname}: {record.getMessage().strip()}")

    handler = Collect(logging.WARNING)
    loggers = (logging.getLogger("vllm"), logging.getLogger())
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class _StandInKernel:
    """Takes the place of the GPU kernel a scheme selects.  Its ``process_weights_after_loading``
    leaves the scheme's layout as the scheme left it (no repack); ``apply_weights`` multiplies by
    the weight decoded from that layout in the activation dtype, with vLLM's own FP4 nibble
    decoder (``nvfp4_emulation_utils.break_fp4_bytes``) and, for NVFP4, its emulation's
    ``dequantize_to_dtype``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.config = kwargs.get("config") or _KernelConfig(kwargs.get("weight_quant_key"))

    def input_quant_key(self) -> None:
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = torch.nn.functional.linear(x, _decoded_weight(layer, x.dtype))
        return out if bias is None else out + bias


@dataclass
class _KernelConfig:
    weight_quant_key: Any = None


def _decoded_weight(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in ``dtype`` from the parameters a scheme left after post-processing."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
        dequantize_to_dtype,
    )

    weight: torch.Tensor = getattr(layer, "weight")
    weight_scale: torch.Tensor = getattr(layer, "weight_scale")
    if weight.dtype == torch.float8_e4m3fn:  # W8A16 FP8: [K, N] codes, [N, 1] scale
        return weight.t().to(dtype) * weight_scale.reshape(-1, 1).to(dtype)
    if weight_scale.dtype == torch.float8_e4m3fn:  # NVFP4: its global scale already inverted
        global_scale = getattr(layer, "weight_global_scale")
        return dequantize_to_dtype(weight, weight_scale, global_scale, dtype, swizzle=False)
    values = break_fp4_bytes(weight, torch.float32)  # MXFP4: E8M0 block exponents
    scale = torch.exp2(weight_scale.to(torch.float32) - 127)
    blocks = values.reshape(values.shape[0], -1, 32) * scale.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)
