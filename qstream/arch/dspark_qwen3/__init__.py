"""The Qwen3-style DSpark draft (and DFlash, without a Markov head) behind the architecture
interface (docs/qwen3-dspark.md; docs/model.md, "Architectures"): :mod:`.config` its
configuration in vLLM's and speculators' layouts, :mod:`.model` its forward (reference, batched
and causal) and FLOP model, :mod:`.checkpoint` its tensor table, loading and serving profile;
:data:`ARCH` is its descriptor (qstream/arch/interface.py's ``Architecture``).  The config and
checkpoint modules are pure Python; the model, which needs torch, is imported when first
called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from qstream.arch import FlopModel
from qstream.arch.dspark_qwen3 import checkpoint
from qstream.arch.dspark_qwen3.config import ARCHITECTURE, PRESETS, Qwen3DSparkConfig
from qstream.arch.family import DSparkFamily

if TYPE_CHECKING:
    import torch

    from qstream.serving import Variant

QUANTIZE_INCLUDE: tuple[str, ...] = checkpoint.DEFAULT_INCLUDE  # the serving profile's default


class DSparkQwen3(FlopModel, DSparkFamily):
    """The descriptor: every call the rest of the package makes of this architecture."""

    model_module = "qstream.arch.dspark_qwen3.model"  # forward and FLOP model, torch
    config_type: type = Qwen3DSparkConfig
    quantize_include: tuple[str, ...] = QUANTIZE_INCLUDE
    presets: Mapping[str, Qwen3DSparkConfig] = PRESETS
    serving: Mapping[str, Any] | None = checkpoint.SERVING
    final_norm: str = "norm.weight"
    context_proj: str = "fc"
    # speculators never saves embed_tokens; vLLM then shares the target's
    # (Qwen3DSparkForCausalLM.load_weights in vllm/model_executor/models/qwen3_dspark.py)
    ships_embed_tokens: bool = False

    def recognises(self, data: Mapping[str, Any]) -> bool:
        # every speculators config: its parser names a speculators_model_type it does not know
        return ARCHITECTURE in (data.get("architectures") or []) or "speculators_model_type" in data

    tensor_shapes = staticmethod(checkpoint.tensor_shapes)
    load_weights = staticmethod(checkpoint.load_weights)

    def build(self, config: Qwen3DSparkConfig, weights, variant: Variant, device: Any = "cpu"):
        from qstream.arch.dspark_qwen3.model import Qwen3DSpark

        return Qwen3DSpark(config, weights, variant.dtype, device)

    def causal_stream(self, model, ids: torch.Tensor, dtype: torch.dtype, depth=None):
        from qstream.arch.dspark_qwen3.model import CausalStream

        return CausalStream(model, ids, dtype, depth)


ARCH = DSparkQwen3()
