"""qstream: quantize speculative-decoding draft models and measure what it costs them."""

from qstream.errors import QStreamError

__version__ = "0.1.0"

__all__ = ["QStreamError", "__version__"]
