"""The DSpark-MLA draft behind the architecture interface (docs/model.md, "Architectures"):
:data:`ARCH` is its descriptor (qstream/arch/interface.py's ``Architecture``).  The config,
tensor table and FLOP model are pure Python; the model's modules, which need torch, are imported
when first called, so that ``qstream quantize`` checks a draft's shapes without loading them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qstream.arch.dspark_mla import flops, tensors
from qstream.arch.dspark_mla.config import ARCHITECTURE, MODEL_TYPE, PRESETS, DSparkConfig
from qstream.arch.dspark_mla.serving import SERVING
from qstream.arch.family import DSparkFamily

if TYPE_CHECKING:
    import torch

# The module kinds docs/model.md quantizes in a shipped DSpark (61% of K3's parameters).
QUANTIZE_INCLUDE = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.o_proj",
    "self_attn.q_b_proj",
    "context_proj",
)


class DSparkMLA(DSparkFamily):
    """The descriptor: every call the rest of the package makes of this architecture."""

    config_type: type = DSparkConfig
    quantize_include: tuple[str, ...] = QUANTIZE_INCLUDE
    presets: Mapping[str, DSparkConfig] = PRESETS
    serving: Mapping[str, Any] | None = SERVING
    final_norm: str = "final_norm.weight"
    context_proj: str = "context_proj"
    ships_embed_tokens: bool = True

    def recognises(self, data: Mapping[str, Any]) -> bool:
        return data.get("architectures") == [ARCHITECTURE] or data.get("model_type") == MODEL_TYPE

    tensor_shapes = staticmethod(tensors.tensor_shapes)
    context_flops = staticmethod(flops.context_flops)
    drafted_flops = staticmethod(flops.drafted_flops)
    causal_flops = staticmethod(flops.causal_flops)

    def load_weights(
        self, model_dir: str | Path, target: str | Path | None, config: DSparkConfig
    ) -> dict[str, torch.Tensor]:
        from qstream.arch.dspark_mla.load import load_weights

        return load_weights(model_dir, target, config)

    def build(self, config: DSparkConfig, weights, dtype: torch.dtype, device: Any = "cpu"):
        from qstream.arch.dspark_mla.forward import DSpark

        return DSpark(config, weights, dtype, device)

    def causal_stream(self, model, ids: torch.Tensor, dtype: torch.dtype, depth=None):
        from qstream.arch.dspark_mla.causal import CausalStream

        return CausalStream(model, ids, dtype, depth)


ARCH = DSparkMLA()
