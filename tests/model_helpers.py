"""Shared helpers of the tests/test_model_*.py files."""

from dataclasses import replace

import torch

from qstream.arch.dspark_mla import PRESETS, tensor_shapes
from qstream.arch.dspark_mla.model import LM_HEAD, DSpark


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


class RecordingDSpark(DSpark):
    """Records the key and query extents of every score tensor (the largest temporaries of
    attention)."""

    def scores(self, q, k):
        self.widest = max(getattr(self, "widest", 0), k.shape[-2])
        self.tallest = max(getattr(self, "tallest", 0), q.shape[-2])
        return super().scores(q, k)


def long_context_model(dtype=torch.float32):
    """A tiny-preset draft with a 300-token vocabulary (cheap at long contexts), recording."""
    config = replace(PRESETS["tiny"], vocab_size=300)
    return RecordingDSpark(config, random_model_weights(config, 0), dtype), config
