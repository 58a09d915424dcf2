"""The Qwen3-style DSpark draft (and DFlash, without a Markov head) behind the architecture
interface (docs/qwen3-dspark.md): its config.json read from vLLM's dense layout or speculators'
saved one and written in vLLM's; its tensor table, loading (as vLLM 0.32.0's
``Qwen3DSparkForCausalLM.load_weights`` borrows from the target) and vLLM serving profile;
:data:`ARCH`, its descriptor.  Pure Python: the forward (:mod:`.model`) is imported when called.

>>> cfg = PRESETS["qwen3-tiny"]
>>> Qwen3DSparkConfig.from_json(cfg.to_json()) == cfg
True

Two keys are read differently in the two layouts, as vLLM 0.32.0 reads them (``update_dspark``
in vllm/transformers_utils/configs/speculators/algos.py): speculators'
``aux_hidden_state_layer_ids`` index the target's hidden-states tuple (0 is the embedding), so
``target_layer_ids`` = each id - 1; and ``sample_from_anchor`` defaults to false there, true in
the dense layout (``DSparkSpeculator.__init__``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from qstream.arch import family
from qstream.arch.family import D2T, DSparkFamily, check, is_int, number, positive_int
from qstream.arch.interface import EMBED, LM_HEAD

if TYPE_CHECKING:
    import torch

ARCHITECTURE = "Qwen3DSparkModel"
MODEL_TYPE = "qwen3"
SPECULATORS_TYPE = "dspark"
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeParameters:
    """``rope_parameters`` (transformers 5's layout; a legacy ``rope_theta`` + ``rope_scaling``
    is read into it): neox-style RoPE, plain or YaRN-extended."""

    rope_theta: float
    rope_type: str = "default"
    factor: float = 1.0  # YaRN: context extension factor
    original_max_position_embeddings: int | None = None  # YaRN: the pre-extension length
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        check(self.rope_type in ROPE_TYPES, "rope_parameters.rope_type", self.rope_type,
              f"must be one of {', '.join(ROPE_TYPES)} (other scalings are not implemented)")  # fmt: skip
        check(number(self.rope_theta) and self.rope_theta > 1, "rope_parameters.rope_theta",
              self.rope_theta, "must be a number above 1")  # fmt: skip
        if self.rope_type == "yarn":
            orig = self.original_max_position_embeddings
            check(number(self.factor) and self.factor >= 1, "rope_parameters.factor",
                  self.factor, "must be >= 1")  # fmt: skip
            check(positive_int(orig), "rope_parameters.original_max_position_embeddings",
                  orig, "must be a positive integer for yarn")  # fmt: skip
            check(self.beta_fast > self.beta_slow > 0, "rope_parameters.beta_fast",
                  self.beta_fast, f"must exceed beta_slow ({self.beta_slow}) > 0")  # fmt: skip

    @property
    def mscale(self) -> float:
        """YaRN's factor on cos and sin, ``0.1 ln(factor) + 1`` (1 without YaRN)."""
        return family.yarn_get_mscale(self.factor) if self.rope_type == "yarn" else 1.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            out.update(factor=self.factor, beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


POSITIVE_INT_FIELDS = (
    "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "head_dim vocab_size draft_vocab_size max_position_embeddings target_hidden_size block_slots"
).split()


@dataclass(frozen=True)
class Qwen3DSparkConfig(family.Sizes):
    """One Qwen3-style DSpark (``markov_rank`` 0: DFlash) draft.  Field names are config.json's,
    except ``block_slots``: its ``block_size``, the query slots of a block (``block_size``
    here: the tokens a block drafts, the interface's meaning)."""

    architecture: ClassVar[str] = ARCHITECTURE  # config.json's "architectures" entry
    speculators_type: ClassVar[str] = SPECULATORS_TYPE  # its speculators_model_type

    hidden_size: int  # H
    intermediate_size: int  # I, SwiGLU width
    num_hidden_layers: int  # draft layers
    num_attention_heads: int  # n query heads
    num_key_value_heads: int  # GQA key/value heads (n is a multiple)
    head_dim: int  # d, per head (q/k RMSNorm width)
    vocab_size: int  # V: the target's vocabulary (embed_tokens, markov_w1)
    draft_vocab_size: int  # the draft's output vocabulary (lm_head, markov_w2); < V with d2t
    rms_norm_eps: float
    rope_parameters: RopeParameters
    max_position_embeddings: int
    target_hidden_size: int  # width of each target hidden state fed as context
    target_layer_ids: tuple[int, ...]  # target layer outputs concatenated as context (0-based)
    mask_token_id: int  # embedded at block slots 1..
    block_slots: int = 7  # config.json's block_size: query slots per block
    sample_from_anchor: bool = True  # slot 0 drafts too (else the anchor is the bonus token)
    markov_rank: int = 0  # r; 0: no Markov head (a DFlash draft)
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False  # vLLM's default (speculators': true)
    attention_bias: bool = False
    target_num_hidden_layers: int | None = None  # the target's depth, when the config says it
    dspark_draft_topk: int | None = None  # vLLM's gathered Markov projection (docs/vllm.md)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        family.check_positive_ints(self, POSITIVE_INT_FIELDS, _json_key)
        family.check_attention(self)
        family.check_mask_token(self)
        family.check_target_layers(self.target_layer_ids, self.target_num_hidden_layers)
        if (top := self.target_num_hidden_layers) is not None:
            check(positive_int(top), "target_num_hidden_layers", top, "must be a positive integer")
        r = self.markov_rank
        check(is_int(r) and r >= 0, "markov_rank", r, "must be an integer >= 0 (0: no head)")
        # vLLM 0.32.0's Qwen3DSparkModel builds only the vanilla DSparkMarkovHead
        # (vllm/model_executor/models/qwen3_dspark.py); speculators' gated and rnn heads
        # carry tensors it has no parameter for.
        check(self.markov_head_type == "vanilla", "markov_head_type", self.markov_head_type,
              "must be 'vanilla': vLLM 0.32's Qwen3DSparkModel serves no other Markov head")  # fmt: skip
        family.check_flags(self, ("enable_confidence_head", "confidence_head_with_markov",
                           "sample_from_anchor", "attention_bias"))  # fmt: skip
        check(not (self.confidence_head_with_markov and self.enable_confidence_head and r == 0),
              "confidence_head_with_markov", True, "needs a Markov head (markov_rank > 0)")  # fmt: skip
        check(self.block_size > 0, "block_size", self.block_slots,
              "must leave a drafted slot after the bonus anchor (sample_from_anchor false)")  # fmt: skip

    @property
    def block_size(self) -> int:
        """Tokens one block drafts: every slot, or every slot after the bonus anchor."""
        return self.block_slots - (0 if self.sample_from_anchor else 1)

    @property
    def first_slot(self) -> int:
        """The block slot whose logits predict the token after the anchor."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def original_max_position_embeddings(self) -> int:
        """The context length before YaRN extends it (max_position_embeddings without it)."""
        orig = self.rope_parameters.original_max_position_embeddings
        return orig if orig is not None else self.max_position_embeddings

    @property
    def own_lm_head(self) -> bool:
        """Whether the checkpoint must carry its own lm_head (else it may)."""
        return self.reduced_vocab

    def to_json(self) -> dict[str, Any]:
        """config.json in vLLM's dense layout (what ``Qwen3DSparkForCausalLM`` reads)."""
        head = {"architectures": [self.architecture], "model_type": MODEL_TYPE}
        return {**head, **family.fields_json(self, _json_key, skip_none=True),
                "dflash_config": {"mask_token_id": self.mask_token_id}, "hidden_act": "silu",
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Qwen3DSparkConfig:
        """config.json contents in either layout (unused keys ignored); ValueError naming a key."""
        family.check_object(data)
        flat = cls._flat(data)
        optional = ("draft_vocab_size", "rope_parameters")
        kwargs = family.read_fields(cls, flat, _json_key, optional, skip_none=True)
        family.ids_tuple(kwargs, "target_layer_ids", "target_layer_ids")
        kwargs.setdefault("draft_vocab_size", kwargs.get("vocab_size"))
        kwargs["rope_parameters"] = _rope_from_json(flat)
        return family.construct(cls, kwargs)

    @classmethod
    def _flat(cls, data: dict[str, Any]) -> dict[str, Any]:
        """config.json contents in either layout -> the dataclass's keys (unread ones kept)."""
        if "speculators_model_type" in data:
            return _from_speculators(data, cls.speculators_type)
        return _dense(data, cls.architecture)


def _dense(data: dict[str, Any], architecture: str) -> dict[str, Any]:
    """vLLM's dense layout: the keys are the dataclass's, except where vLLM 0.32.0 looks first:
    the mask token in ``dflash_config`` (``get_parallel_drafting_token_id`` in
    vllm/v1/worker/gpu/spec_decode/utils.py), the target layers in
    ``eagle_aux_hidden_state_layer_ids`` (hidden-states indices), ``dflash_config``, then
    ``dspark_target_layer_ids`` (``get_eagle3_aux_layers_from_config`` in
    vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)."""
    arch = data.get("architectures")
    check(arch is None or architecture in arch, "architectures", arch,
          f"must name {architecture!r}")  # fmt: skip
    flat = dict(data)
    dflash = data.get("dflash_config") or {}
    check(isinstance(dflash, dict), "dflash_config", dflash, "must be an object")
    _refuse_unmodelled(data, dflash)
    if dflash.get("mask_token_id") is not None:
        flat["mask_token_id"] = dflash["mask_token_id"]
    eagle = data.get("eagle_aux_hidden_state_layer_ids")
    for ids in (eagle and [i - 1 for i in eagle if is_int(i)], dflash.get("target_layer_ids"),
                data.get("dspark_target_layer_ids")):  # fmt: skip
        if ids:
            flat["target_layer_ids"] = ids
            break
    flat.setdefault("target_hidden_size", data.get("hidden_size"))
    return flat


def _from_speculators(data: dict[str, Any], kind_read: str) -> dict[str, Any]:
    """speculators' saved layout (of the ``kind_read`` speculators_model_type): the backbone's
    keys nest in ``transformer_layer_config``."""
    kind = data.get("speculators_model_type")
    known = "'dspark', 'dflash'"  # the speculators drafts of this family qstream reads
    check(kind == kind_read, "speculators_model_type", kind,
          f"is not a speculators draft qstream knows (known: {known})")  # fmt: skip
    keys = ("draft_vocab_size", "block_size", "mask_token_id", "target_hidden_size",
            "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov")  # fmt: skip
    flat = family.speculators_layer(data, keys)
    _refuse_unmodelled(data["transformer_layer_config"], {})
    aux: list[int] = data.get("aux_hidden_state_layer_ids")  # type: ignore[assignment]
    check(isinstance(aux, list) and all(is_int(i) and i >= 1 for i in aux),
          "aux_hidden_state_layer_ids", aux,
          "must list hidden-state indices >= 1 (target layer i's output is index i + 1)")  # fmt: skip
    flat["target_layer_ids"] = [i - 1 for i in aux]
    flat["sample_from_anchor"] = data.get("sample_from_anchor", False)
    flat.setdefault("target_hidden_size", data["transformer_layer_config"].get("hidden_size"))
    return flat


# config.json keys that change vLLM 0.32.0's forward in ways qstream does not model, with the
# values that leave it as qstream computes it (qwen3_dflash.py: _dflash_layer_causal,
# _resolve_layer_attention, DFlashQwen3DecoderLayer.__init__, DFlashQwen3Model.__init__;
# qwen3_dspark.py: Qwen3DSparkForCausalLM.__init__'s logit_scale).
UNMODELLED = (
    ("is_causal", (None, False), "a block-causal draft"),
    ("dflash_config.causal", (None, False), "a block-causal draft"),
    ("dflash_config.use_swa", (None, False), "sliding-window layers"),
    ("is_neox_style", (None, True), "interleaved RoPE"),
    ("dflash_config.attention_value_scale", (None,), "scaled values"),
    ("dflash_config.attention_sink_bias", (None, False), "attention sinks"),
    ("add_swa_attention_sink_bias", (None, False), "attention sinks"),
    ("logit_scale", (None, 1.0), "scaled logits"),
    ("use_aux_hidden_state", (None, True), "a draft without fc"),
    ("dflash_config.use_aux_hidden_state", (None, True), "a draft without fc"),
)


def _refuse_unmodelled(data: dict[str, Any], dflash: dict[str, Any]) -> None:
    family.refuse_unmodelled(
        UNMODELLED,
        lambda key: dflash.get(key[14:]) if key.startswith("dflash_config.") else data.get(key),
        data.get("layer_types") or [],
    )


def _rope_from_json(flat: dict[str, Any]) -> RopeParameters:
    rope = flat.get("rope_parameters")
    if rope is None:  # the legacy layout: rope_theta beside an optional rope_scaling
        rope = {"rope_theta": flat.get("rope_theta"), **(flat.get("rope_scaling") or {})}
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    check(isinstance(rope, dict), "rope_parameters", rope, "must be an object")
    if rope.get("rope_theta") is None:
        raise ValueError("config.json: missing key 'rope_parameters.rope_theta'")
    return family.rope_of(RopeParameters, rope, lambda k, v: (k, v) == ("truncate", True))


def _json_key(name: str) -> str:
    return "block_size" if name == "block_slots" else name


def _preset(**kw: Any) -> Qwen3DSparkConfig:
    theta = kw.pop("rope_theta", 1_000_000.0)
    kw.setdefault("draft_vocab_size", kw["vocab_size"])
    return Qwen3DSparkConfig(
        num_hidden_layers=5,
        rms_norm_eps=1e-6,
        rope_parameters=RopeParameters(rope_theta=theta),
        enable_confidence_head=True,
        confidence_head_with_markov=True,  # every checkpoint qstream writes carries the key
        **kw,
    )


# qwen3-tiny's vocab_size / mask_token_id are placeholders: `qstream synth` replaces them with
# its tokenizer's.  Every quantized input width (H, I, n*d, A, r) is a multiple of 32, so every
# format quantizes the same tensors; GQA with 2 query heads per key/value head.
PRESETS: dict[str, Qwen3DSparkConfig] = {
    "qwen3-tiny": _preset(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1024, max_position_embeddings=4096, mask_token_id=2,
        markov_rank=32, target_hidden_size=64, target_num_hidden_layers=8,
        target_layer_ids=(0, 2, 4, 5, 6)),
    # The shapes of a block-7 DSpark draft for Qwen3-8B (docs/qwen3-dspark.md, "Synthetic
    # checkpoints"): the target's widths, vocabulary and RoPE, five draft layers over the five
    # target layers `synth --target` spreads over its 36; the mask is the first id past the
    # tokenizer's 151,669 (a row of Qwen3's padded embedding).
    "qwen3-8b": _preset(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, mask_token_id=151669,
        markov_rank=256, target_hidden_size=4096, target_num_hidden_layers=36,
        target_layer_ids=(1, 9, 18, 26, 34), eos_token_id=151645),
}  # fmt: skip


def tensor_shapes(config: Qwen3DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM builds for ``config``, in checkpoint order (``lm_head.weight`` and
    ``d2t``: a reduced-vocabulary draft's)."""
    c, H = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        EMBED: (c.vocab_size, H),
        "fc.weight": (H, c.aux_size),
        "hidden_norm.weight": (H,),
    }
    bias = ("q", "k", "v", "o") if c.attention_bias else ()
    for i in range(c.num_hidden_layers):
        shapes.update(family.decoder_layer_shapes(c, f"layers.{i}.", H, bias, qk_norm=True))
    shapes["norm.weight"] = (H,)
    if c.own_lm_head:
        shapes[LM_HEAD] = (c.draft_vocab_size, H)
    if c.reduced_vocab:
        shapes[D2T] = (c.draft_vocab_size,)
    return {**shapes, **family.head_shapes(c, c.draft_vocab_size)}


def check_tensors(
    config: Qwen3DSparkConfig, shapes: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """QStreamError naming the first tensor missing (``embed_tokens`` may be the target's),
    unexplained (beyond a full-vocabulary draft's own lm_head and t2d) or of a wrong shape."""
    table = tensor_shapes(config)
    extra: dict[str, tuple[int, ...]] = {family.T2D: (config.vocab_size,)}
    if not config.own_lm_head:
        extra[LM_HEAD] = (config.vocab_size, config.hidden_size)
    # the target's embedding is shared when the draft has none (Qwen3DSparkForCausalLM.load_weights;
    # speculators never saves it)
    required = {k: v for k, v in table.items() if k != EMBED}
    family.check_table(required, {**table, **extra}, shapes, where, "Qwen3-style DSpark draft",
                lambda name, shape: family.shape_hint(config, name, shape),
                lambda name: _why_needed(config, name))  # fmt: skip


def _why_needed(config: Qwen3DSparkConfig, name: str) -> str:
    if name == LM_HEAD and not config.reduced_vocab:
        return (
            "; config.json sets has_own_lm_head: true, so vLLM keeps an lm_head of the draft's own"
        )
    if name in (LM_HEAD, D2T):
        return (
            f"; draft_vocab_size {config.draft_vocab_size} < vocab_size {config.vocab_size}: "
            "vLLM refuses a reduced-vocabulary draft without its own lm_head and d2t"
        )
    return ""


def read_draft_tensors(directory: str | Path, config: Qwen3DSparkConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint, dequantized and checked (:func:`check_tensors`)."""
    return family.read_indexed(directory, config, check_tensors)


# A stored embed_tokens serves, as vLLM 0.32.0's Qwen3DSparkForCausalLM.load_weights sets
# has_own_embed_tokens and maybe_share_target_embed shares the target's only when equal.
load_weights = family.borrowing_loader(read_draft_tensors)


# How vLLM 0.32.0 serves the draft (vllm/model_executor/models/qwen3_dspark.py over
# qwen3_dflash.py), as data: SERVING is the Qwen3DSparkModel serving profile that
# qstream/vllm/profiles.py builds (docs/vllm.md, "The Qwen3-style DSpark draft", cites each rule).

# Checkpoint module (under layers.{i}.) -> (runtime module under model.layers.{L+i}., split).
# q/k/v load into one qkv_proj (a QKVParallelLinear), gate/up into gate_up_proj (a
# MergedColumnParallelLinear): DFlashQwen3Model.hf_to_vllm_mapper's orig_to_new_stacked; the
# splits are DFlashQwen3Attention.__init__'s and Qwen2MLP's (qwen3_dflash.py, qwen2.py).
LAYER_MODULES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.o_proj": ("self_attn.o_proj", "in"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "out"),
    "mlp.up_proj": ("mlp.gate_up_proj", "out"),
    "mlp.down_proj": ("mlp.down_proj", "in"),
}
# Modules vLLM never builds quantized, with the reason (docs/vllm.md cites each).
NEVER_QUANTIZED = {
    "markov_head.markov_w1": "the Markov head's markov_w1 is an nn.Embedding, built without a "
    "quant config",
    "confidence_head.proj": (
        "the DSpark confidence head is an fp32 ReplicatedLinear built without a quant config "
        "(served for adaptive verification)"
    ),
    "lm_head": "Qwen3DSparkForCausalLM builds the draft's own lm_head as a ParallelLMHead "
    "without a quant config",
    "embed_tokens": "the draft's embedding is a VocabParallelEmbedding built without a quant "
    "config",
}
# markov_w2 is a ParallelLMHead built WITH the draft's quant config (DSparkMarkovHead.__init__):
# CompressedTensorsConfig.get_quant_method gives it a scheme only when a config group target
# names it (its class name holds no "linear", so the "Linear" target misses it); vLLM 0.32.0
# then loads it in each of qstream's formats (the vLLM lane proves it).  Runtime name, the target
# qstream writes for it, the formats.
LM_HEADS = {
    "markov_head.markov_w2": {
        "runtime": "model.markov_head.markov_w2",
        "target": "re:.*\\.markov_head\\.markov_w2$",
        "formats": ("fp8", "nvfp4", "mxfp4"),
    },
}
# The module kinds a shipped draft quantizes by default: the backbone's Linear layers and fc
# (the descriptor's quantize_include, docs/qwen3-dspark.md, "What is quantized").
DEFAULT_INCLUDE = tuple(
    "mlp.gate_proj mlp.up_proj mlp.down_proj self_attn.q_proj self_attn.k_proj self_attn.v_proj "
    "self_attn.o_proj fc".split()
)
SERVING: dict[str, Any] = {
    "name": "Qwen3DSparkModel",
    "served_class": "Qwen3DSparkForCausalLM",  # registry.py's class for the name
    "architectures": ("Qwen3DSparkModel",),
    "layer_modules": LAYER_MODULES,
    "never_quantized": NEVER_QUANTIZED,
    # DFlashQwen3Model.__init__: fc is a ReplicatedLinear built with the draft's quant config.
    "context_proj": "fc",
    "lm_heads": LM_HEADS,
    "default_include": DEFAULT_INCLUDE,
    "gqa_heads": ("num_attention_heads", "num_key_value_heads"),
    # vLLM 0.32.0's update_dspark (vllm/transformers_utils/configs/speculators/algos.py) serves
    # a saved speculators DSpark config as Qwen3DSparkModel, whatever its "architectures" says
    "speculators_types": ("dspark",),
}


class DSparkQwen3(DSparkFamily):
    """The descriptor: every call the rest of the package makes of this architecture."""

    model_module, model_class = "qstream.arch.dspark_qwen3.model", "Qwen3DSpark"
    config_type: type = Qwen3DSparkConfig
    quantize_include: tuple[str, ...] = DEFAULT_INCLUDE  # the serving profile's default
    presets: Mapping[str, Any] = PRESETS
    serving: tuple[Mapping[str, Any], ...] = (SERVING,)
    # speculators never saves embed_tokens; vLLM then shares the target's
    # (Qwen3DSparkForCausalLM.load_weights in vllm/model_executor/models/qwen3_dspark.py)
    ships_embed_tokens = False

    def recognises(self, data: Mapping[str, Any]) -> bool:
        # every speculators config: its parser names a speculators_model_type it does not know
        return ARCHITECTURE in (data.get("architectures") or []) or "speculators_model_type" in data

    tensor_shapes = staticmethod(tensor_shapes)
    load_weights = staticmethod(load_weights)


ARCH = DSparkQwen3()
