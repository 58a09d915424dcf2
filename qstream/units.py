"""Units and dtype sets that several layers of qstream share, each defined once here."""

from __future__ import annotations

import torch

GIB = 1 << 30  # bytes in a GiB: sizes are reported in binary units, as disk tools and vLLM do
MIB, KIB = 1 << 20, 1 << 10


def human_size(n_bytes: int) -> str:
    """``n_bytes`` in the largest binary unit it reaches (a small checkpoint is never
    "0.000 GiB"): ``human_size(3 << 20) == "3.00 MiB"``."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n_bytes >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{n_bytes} B"


# The floating-point dtypes a checkpoint's weights (and captured states) may hold: as torch dtypes,
# and as the same dtypes are named in a safetensors header, in the same order.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_DTYPE_NAMES = ("BF16", "F16", "F32")
