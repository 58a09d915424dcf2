"""The DFlash draft (config.json ``architectures: ["DFlashDraftModel"]``, or speculators'
``speculators_model_type: "dflash"``) behind the architecture interface (docs/qwen3-dspark.md,
"DFlash drafts"): the Qwen3-style backbone of :mod:`qstream.arch.dspark_qwen3` without a Markov
or confidence head, served by vLLM 0.32.0 as ``DFlashQwen3ForCausalLM``
(vllm/model_executor/models/qwen3_dflash.py; registry.py maps ``DFlashDraftModel`` to it).  Its
config, tensor table, forward and loading are the family's; what differs is here: the config's
name and keys, its presets and its vLLM serving profile.  :data:`ARCH`, its descriptor.

>>> cfg = PRESETS["qwen3-dflash-tiny"]
>>> DFlashQwen3Config.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from qstream.arch.dspark_qwen3 import PRESETS as DSPARK_PRESETS
from qstream.arch.dspark_qwen3 import SERVING as DSPARK_SERVING
from qstream.arch.dspark_qwen3 import DSparkQwen3, Qwen3DSparkConfig, _dense
from qstream.arch.family import check, check_flags

ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_TYPE = "dflash"
# Qwen3DSparkModel's keys a DFlash config.json does not carry (vLLM's DFlash reads none of them)
DSPARK_KEYS = (
    "markov_rank markov_head_type enable_confidence_head confidence_head_with_markov "
    "sample_from_anchor dspark_draft_topk target_layer_ids"
).split()


@dataclass(frozen=True)
class DFlashQwen3Config(Qwen3DSparkConfig):
    """One DFlash draft: the Qwen3-style config without a Markov or confidence head, the anchor
    slot always the bonus token (``block_size`` = config.json's block_size - 1 drafted)."""

    architecture: ClassVar[str] = ARCHITECTURE
    speculators_type: ClassVar[str] = SPECULATORS_TYPE

    sample_from_anchor: bool = False  # vLLM 0.32.0's DFlash refuses true (__post_init__)
    # config.json's has_own_lm_head: DFlashQwen3ForCausalLM.__init__ builds lm_head with the
    # draft's quant config, and load_dflash_model (v1/worker/gpu/spec_decode/dflash/utils.py)
    # keeps it instead of the target's, only when this is true
    has_own_lm_head: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        why = "a DFlashDraftModel has none (vLLM 0.32.0's DFlashQwen3ForCausalLM builds no "
        check(self.markov_rank == 0, "markov_rank", self.markov_rank,
              why + "Markov head; a draft with one is a Qwen3DSparkModel)")  # fmt: skip
        check(self.enable_confidence_head is False, "enable_confidence_head",
              self.enable_confidence_head, why + "confidence head)")  # fmt: skip
        # DFlashSpeculator.__init__ (v1/worker/gpu/spec_decode/dflash/speculator.py) raises
        check(self.sample_from_anchor is False, "dflash_config.sample_from_anchor",
              self.sample_from_anchor, "is refused by vLLM 0.32.0's DFlash drafter (the "
              "anchor slot is the bonus token)")  # fmt: skip
        check(self.dspark_draft_topk is None, "dspark_draft_topk", self.dspark_draft_topk,
              "is DSpark's (vLLM 0.32.0's SpeculativeConfig refuses it for DFlash)")  # fmt: skip
        check_flags(self, ("has_own_lm_head",))

    @property
    def own_lm_head(self) -> bool:
        return self.reduced_vocab or self.has_own_lm_head

    def to_json(self) -> dict[str, Any]:
        """config.json as vLLM's ``update_dflash`` (transformers_utils/configs/speculators/
        algos.py) writes a DFlash draft's: the target layers and mask token in
        ``dflash_config``, no DSpark head keys."""
        out = {k: v for k, v in super().to_json().items() if k not in DSPARK_KEYS}
        out["dflash_config"] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if not self.has_own_lm_head:
            del out["has_own_lm_head"]
        return out

    @classmethod
    def _flat(cls, data: dict[str, Any]) -> dict[str, Any]:
        """As the family's, where vLLM reads a DFlash config otherwise: the anchor flag from
        ``dflash_config`` only (DFlashSpeculator.__init__); a speculators DFlash draft is
        block-causal unless ``sliding_window_non_causal`` (``update_dflash``)."""
        if "speculators_model_type" not in data:
            flat = _dense(data, cls.architecture)
            flat["sample_from_anchor"] = (data.get("dflash_config") or {}).get(
                "sample_from_anchor", False
            )
            return flat
        check(data.get("sliding_window_non_causal", True) is True, "sliding_window_non_causal",
              data.get("sliding_window_non_causal"),
              "makes a block-causal draft, which qstream does not evaluate yet")  # fmt: skip
        return super()._flat(data)


def dflash_of(config: Qwen3DSparkConfig, **changes: Any) -> DFlashQwen3Config:
    """The DFlash draft of ``config``'s backbone: no heads, the anchor the bonus token, one more
    block slot so that as many tokens are drafted (``changes`` override any field)."""
    kept = {f.name: getattr(config, f.name) for f in fields(Qwen3DSparkConfig)}
    kept.update(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False,
                sample_from_anchor=False, block_slots=config.block_size + 1)  # fmt: skip
    return DFlashQwen3Config(**{**kept, **changes})


# The qwen3-tiny backbone (qstream/arch/dspark_qwen3/__init__.py) as a DFlash draft: block
# size 8, 7 drafted, as many as the DSpark preset's.
PRESETS: dict[str, DFlashQwen3Config] = {
    "qwen3-dflash-tiny": dflash_of(DSPARK_PRESETS["qwen3-tiny"]),
}

# How vLLM 0.32.0 serves it (qwen3_dflash.py), as data: the DSpark profile's backbone rules —
# Qwen3DSparkForCausalLM is DFlashQwen3ForCausalLM's backbone with heads (qwen3_dspark.py) —
# without the heads, and its own lm_head rule (docs/vllm.md, "The DFlash draft").
LM_HEADS = {
    "lm_head": {
        "runtime": "lm_head",
        # the name itself: compressed-tensors' matcher (exact name or re:) on the ParallelLMHead
        "target": "lm_head",
        "formats": ("fp8", "nvfp4", "mxfp4"),
        "config_flag": "has_own_lm_head",  # without it, built with no quant config
    },
}
SERVING: dict[str, Any] = {
    **DSPARK_SERVING,
    "name": ARCHITECTURE,
    "served_class": "DFlashQwen3ForCausalLM",
    "architectures": (ARCHITECTURE,),
    "never_quantized": {"embed_tokens": DSPARK_SERVING["never_quantized"]["embed_tokens"]},
    "lm_heads": LM_HEADS,
    # update_dflash serves a saved speculators DFlash config as DFlashDraftModel
    "speculators_types": (SPECULATORS_TYPE,),
    "method": "dflash",  # SpeculativeConfig.method: load_dflash_model, DFlashSpeculator
    # SpeculativeConfig.__post_init__ defaults num_speculative_tokens for DSpark only
    "drafted_tokens_given": True,
}


class DFlashQwen3(DSparkQwen3):
    """The descriptor: the family's calls, this config, presets and profile."""

    config_type: type = DFlashQwen3Config
    presets: Mapping[str, Any] = PRESETS
    serving: tuple[Mapping[str, Any], ...] = (SERVING,)

    def recognises(self, data: Mapping[str, Any]) -> bool:
        return (
            ARCHITECTURE in (data.get("architectures") or [])
            or data.get("speculators_model_type") == SPECULATORS_TYPE
        )


ARCH = DFlashQwen3()
