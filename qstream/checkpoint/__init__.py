"""Checkpoint-level work: read safetensors checkpoints, quantize them to the compressed-tensors
layout without a model class, and inspect or verify the result.

>>> from qstream.checkpoint import quantize_checkpoint
>>> summary = quantize_checkpoint("draft", "draft-fp8", "fp8", include=["mlp.gate_proj"])
"""

from qstream.checkpoint.quantize import QuantizeSummary, quantize_checkpoint

__all__ = ["QuantizeSummary", "quantize_checkpoint"]
