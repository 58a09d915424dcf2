"""Units and dtype sets that several layers of qstream share, each defined once here."""

from __future__ import annotations

import torch

GIB = 1 << 30  # bytes in a GiB: sizes are reported in binary units, as disk tools and vLLM do

# The floating-point dtypes a checkpoint's weights (and captured states) may hold: as torch dtypes,
# and as the same dtypes are named in a safetensors header, in the same order.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_DTYPE_NAMES = ("BF16", "F16", "F32")
