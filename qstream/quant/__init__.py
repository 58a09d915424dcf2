"""Quantizing a checkpoint (docs/quantize.md): which modules (``select``), each tensor converted
(``convert``), the output's files (``write``), and the whole run (``quantize``).

>>> from qstream.quant import quantize_checkpoint
>>> summary = quantize_checkpoint("draft", "draft-fp8", "fp8", include=["mlp.gate_proj"])
"""

from qstream.quant.quantize import QuantizeSummary, quantize_checkpoint

__all__ = ["QuantizeSummary", "quantize_checkpoint"]
