"""Quantizing a checkpoint (docs/quantize.md): the whole run (``quantize``) picks the modules
(``select``) and lays out the output (``plan``), then hands that plan down to the output's files
(``write``) and the streamed tensors (``convert``).

>>> from qstream.quant import quantize_checkpoint
>>> summary = quantize_checkpoint("draft", "draft-fp8", "fp8", include=["mlp.gate_proj"])
"""

from qstream.quant.quantize import QuantizeSummary, quantize_checkpoint

__all__ = ["QuantizeSummary", "quantize_checkpoint"]
