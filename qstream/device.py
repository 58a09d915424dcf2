"""Where a model computes, and the math settings that keep the FP32 reference FP32 on a GPU:
:func:`exact_math` turns off TF32 and reduced-precision bf16/fp16 reductions for the duration of
a pass (docs/eval-drift.md, "Devices")."""

from __future__ import annotations

import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from qstream.errors import QStreamError


def resolve_device(text: str) -> torch.device:
    """``--device`` -> a torch device that exists here; one-line QStreamError otherwise."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise QStreamError(f"--device {text!r}: expected cpu, cuda or cuda:N")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise QStreamError(
                f"--device {text}: CUDA is not available here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise QStreamError(f"--device {text}: this machine has {count} CUDA device(s)")
    return device


def math_settings() -> dict:
    """The matmul settings in force now, as the results record them (PyTorch's fp32_precision
    API: "ieee" is full FP32, "tf32" allows TF32, "none" follows the global default)."""
    matmul = torch.backends.cuda.matmul
    return {
        "cuda_matmul_fp32_precision": matmul.fp32_precision,
        "cudnn_fp32_precision": torch.backends.cudnn.fp32_precision,
        "cuda_bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "cuda_fp16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction,
    }


@contextmanager
def exact_math() -> Iterator[None]:
    """FP32 matmuls and convolutions in IEEE fp32 (no TF32) and no reduced-precision reductions
    in bf16/fp16 GEMMs while the block runs."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (
        matmul.fp32_precision,
        cudnn.fp32_precision,
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    try:
        matmul.fp32_precision = cudnn.fp32_precision = "ieee"
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
        yield
    finally:
        matmul.fp32_precision, cudnn.fp32_precision = saved[0], saved[1]
        matmul.allow_bf16_reduced_precision_reduction = saved[2]
        matmul.allow_fp16_reduced_precision_reduction = saved[3]


def describe_device(device: torch.device) -> dict:
    """The results' ``compute`` block: device, its name, torch and CUDA versions, threads, the
    CPU kernels torch chose, and the math settings every pass ran under (:func:`exact_math`)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    with exact_math():
        settings = math_settings()
    return {
        "device": str(device),
        "device_name": name,
        "torch_version": torch.__version__.split("+")[0],
        "cuda_version": torch.version.cuda,
        "threads": torch.get_num_threads(),
        # the kernels torch picked (AVX512, AVX2, DEFAULT): float results follow them
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "math": settings,
    }
