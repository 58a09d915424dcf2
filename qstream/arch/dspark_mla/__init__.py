"""The DSpark draft with MLA attention (Kimi-K3's), behind the architecture interface
(docs/model.md, "Architectures"): :mod:`.config` its configuration, :mod:`.model` its forward
(reference, batched and causal) and FLOP model, :mod:`.checkpoint` its tensor table, loading
and serving profile; :data:`ARCH` is its descriptor (qstream/arch/interface.py's
``Architecture``).  The config and checkpoint modules are pure Python; the model, which needs
torch, is imported when first called, so that ``qstream quantize`` checks a draft's shapes
without loading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from qstream.arch import FlopModel
from qstream.arch.dspark_mla import checkpoint
from qstream.arch.dspark_mla.config import ARCHITECTURE, MODEL_TYPE, PRESETS, DSparkConfig
from qstream.arch.family import DSparkFamily

if TYPE_CHECKING:
    import torch

    from qstream.serving import Variant

# The module kinds docs/model.md quantizes in a shipped DSpark (61% of K3's parameters).
QUANTIZE_INCLUDE = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.o_proj",
    "self_attn.q_b_proj",
    "context_proj",
)


class DSparkMLA(FlopModel, DSparkFamily):
    """The descriptor: every call the rest of the package makes of this architecture."""

    model_module = "qstream.arch.dspark_mla.model"  # forward and FLOP model, torch
    config_type: type = DSparkConfig
    # --include_layers' default (pure Python here: --help reads it)
    quantize_include: tuple[str, ...] = QUANTIZE_INCLUDE
    presets: Mapping[str, DSparkConfig] = PRESETS
    serving: Mapping[str, Any] | None = checkpoint.SERVING
    final_norm: str = "final_norm.weight"
    context_proj: str = "context_proj"
    ships_embed_tokens: bool = True

    def recognises(self, data: Mapping[str, Any]) -> bool:
        return data.get("architectures") == [ARCHITECTURE] or data.get("model_type") == MODEL_TYPE

    tensor_shapes = staticmethod(checkpoint.tensor_shapes)
    load_weights = staticmethod(checkpoint.load_weights)

    def build(self, config: DSparkConfig, weights, variant: Variant, device: Any = "cpu"):
        from qstream.arch.dspark_mla.model import DSpark

        return DSpark(config, weights, variant.dtype, device)

    def causal_stream(self, model, ids: torch.Tensor, dtype: torch.dtype, depth=None):
        from qstream.arch.dspark_mla.model import CausalStream

        return CausalStream(model, ids, dtype, depth)


ARCH = DSparkMLA()
