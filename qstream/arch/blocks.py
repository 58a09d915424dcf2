"""Building blocks every draft architecture computes the same way (docs/model.md, "API"): RMSNorm
in fp32 and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (or wider), returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def swiglu(x: torch.Tensor, gate, up, down, linear=F.linear) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``, each product ``linear(x, weight)`` (by default the
    weights are tensors; the forwards pass weight names and their own products)."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)
