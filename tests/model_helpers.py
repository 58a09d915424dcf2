"""Shared helpers of the tests/test_model_*.py files."""

import torch

from qstream.model.dspark import LM_HEAD
from qstream.model.tensors import tensor_shapes


def random_model_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Every model tensor (and lm_head) drawn iid: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, .1²)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {**tensor_shapes(cfg), LM_HEAD: (cfg.vocab_size, cfg.hidden_size)}
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            out[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        else:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
    return out
