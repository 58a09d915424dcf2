"""Quantizing a checkpoint (docs/quantize.md): the whole run (``quantize``) picks the modules
(``select``), then plans and writes the output (``write``: its files and the streamed tensors).

>>> from qstream.quant import quantize_checkpoint
>>> summary = quantize_checkpoint("draft", "draft-fp8", "fp8", include=["mlp.gate_proj"])
"""

from qstream.quant.quantize import QuantizeSummary, quantize_checkpoint

__all__ = ["QuantizeSummary", "quantize_checkpoint"]
