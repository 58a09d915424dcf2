"""The Qwen3-style DSpark draft behind the architecture interface (docs/model.md,
"Architectures"; docs/qwen3-dspark.md): :data:`ARCH` is its descriptor.  The config, tensor
table and FLOP model are pure Python; the model's modules, which need torch, are imported when
first called."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qstream.arch.dspark_qwen3 import flops, tensors
from qstream.arch.dspark_qwen3.config import (
    ARCHITECTURE,
    PRESETS,
    Qwen3DSparkConfig,
)
from qstream.arch.dspark_qwen3.serving import DEFAULT_INCLUDE, SERVING
from qstream.arch.family import DSparkFamily

if TYPE_CHECKING:
    import torch

    from qstream.serving import Variant

# The module kinds a shipped draft quantizes: the backbone's Linear layers and fc
# (docs/qwen3-dspark.md, "What is quantized"); the serving profile's default selection.
QUANTIZE_INCLUDE: tuple[str, ...] = DEFAULT_INCLUDE


class DSparkQwen3(DSparkFamily):
    """The descriptor: every call the rest of the package makes of this architecture."""

    config_type: type = Qwen3DSparkConfig
    quantize_include: tuple[str, ...] = QUANTIZE_INCLUDE
    presets: Mapping[str, Qwen3DSparkConfig] = PRESETS
    serving: Mapping[str, Any] | None = SERVING
    final_norm: str = "norm.weight"
    context_proj: str = "fc"
    # speculators never saves embed_tokens; vLLM then shares the target's
    # (Qwen3DSparkForCausalLM.load_weights in vllm/model_executor/models/qwen3_dspark.py)
    ships_embed_tokens: bool = False

    def recognises(self, data: Mapping[str, Any]) -> bool:
        # every speculators config: its parser names a speculators_model_type it does not know
        return ARCHITECTURE in (data.get("architectures") or []) or "speculators_model_type" in data

    tensor_shapes = staticmethod(tensors.tensor_shapes)
    context_flops = staticmethod(flops.context_flops)
    drafted_flops = staticmethod(flops.drafted_flops)
    causal_flops = staticmethod(flops.causal_flops)

    def load_weights(
        self, model_dir: str | Path, target: str | Path | None, config: Qwen3DSparkConfig
    ) -> dict[str, torch.Tensor]:
        from qstream.arch.dspark_qwen3.load import load_weights

        return load_weights(model_dir, target, config)

    def build(self, config: Qwen3DSparkConfig, weights, variant: Variant, device: Any = "cpu"):
        from qstream.arch.dspark_qwen3.forward import Qwen3DSpark

        return Qwen3DSpark(config, weights, variant.dtype, device)

    def causal_stream(self, model, ids: torch.Tensor, dtype: torch.dtype, depth=None):
        from qstream.arch.dspark_qwen3.forward import CausalStream

        return CausalStream(model, ids, dtype, depth)


ARCH = DSparkQwen3()
