"""The Qwen3-style DSpark draft's configuration (docs/qwen3-dspark.md): a frozen dataclass read
from either layout people have (vLLM's dense ``Qwen3DSparkModel`` config.json, or speculators'
saved ``speculators_model_type: "dspark"`` config) and written in vLLM's dense layout.

>>> cfg = PRESETS["qwen3-tiny"]
>>> Qwen3DSparkConfig.from_json(cfg.to_json()) == cfg
True

Two of config.json's keys are read differently in the two layouts, as vLLM 0.32.0 reads them
(``update_dspark`` in vllm/transformers_utils/configs/speculators/algos.py):
speculators' ``aux_hidden_state_layer_ids`` index the target's hidden-states tuple (0 is the
embedding), so ``target_layer_ids`` = each id - 1; and ``sample_from_anchor`` defaults to false
there, true in the dense layout (``DSparkSpeculator.__init__``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from qstream.arch import config_fields
from qstream.arch.config_fields import check, is_int, number, positive_int, yarn_get_mscale

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
        return yarn_get_mscale(self.factor) if self.rope_type == "yarn" else 1.0

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
class Qwen3DSparkConfig:
    """One Qwen3-style DSpark (or, with ``markov_rank`` 0, DFlash) draft.  Field names are
    config.json's, except ``block_slots``: config.json's ``block_size``, the query slots of
    one block (``block_size`` here is the tokens a block drafts, the interface's meaning)."""

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
        config_fields.check_positive_ints(self, POSITIVE_INT_FIELDS, _json_key)
        check(number(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps",
              self.rms_norm_eps, "must be positive")  # fmt: skip
        n, kv = self.num_attention_heads, self.num_key_value_heads
        check(n % kv == 0, "num_key_value_heads", kv, f"must divide num_attention_heads ({n})")
        check(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (RoPE pairs)")
        check(self.draft_vocab_size <= self.vocab_size, "draft_vocab_size",
              self.draft_vocab_size, f"must not exceed vocab_size ({self.vocab_size})")  # fmt: skip
        config_fields.check_mask_token(self)
        config_fields.check_target_layers(self.target_layer_ids, self.target_num_hidden_layers)
        if (top := self.target_num_hidden_layers) is not None:
            check(positive_int(top), "target_num_hidden_layers", top, "must be a positive integer")
        self._check_heads()

    def _check_heads(self) -> None:
        r = self.markov_rank
        check(is_int(r) and r >= 0, "markov_rank", r, "must be an integer >= 0 (0: no head)")
        # vLLM 0.32.0's Qwen3DSparkModel builds only the vanilla DSparkMarkovHead
        # (vllm/model_executor/models/qwen3_dspark.py); speculators' gated and rnn heads
        # carry tensors it has no parameter for.
        check(self.markov_head_type == "vanilla", "markov_head_type", self.markov_head_type,
              "must be 'vanilla': vLLM 0.32's Qwen3DSparkModel serves no other Markov head")  # fmt: skip
        config_fields.check_flags(self, ("enable_confidence_head", "confidence_head_with_markov",
                           "sample_from_anchor", "attention_bias"))  # fmt: skip
        check(not (self.confidence_head_with_markov and self.enable_confidence_head and r == 0),
              "confidence_head_with_markov", True, "needs a Markov head (markov_rank > 0)")  # fmt: skip
        check(self.block_size > 0, "block_size", self.block_slots,
              "must leave a drafted slot after the bonus anchor (sample_from_anchor false)")  # fmt: skip

    # The interface's view (qstream/arch/interface.py, DraftConfig).
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
    def aux_size(self) -> int:
        """A: one position's context width (every selected target layer concatenated)."""
        return self.num_target_layers * self.target_hidden_size

    @property
    def original_max_position_embeddings(self) -> int:
        """The context length before YaRN extends it (max_position_embeddings without it)."""
        orig = self.rope_parameters.original_max_position_embeddings
        return orig if orig is not None else self.max_position_embeddings

    @property
    def reduced_vocab(self) -> bool:
        """A draft vocabulary smaller than the target's: own lm_head and d2t required."""
        return self.draft_vocab_size < self.vocab_size

    has_markov_head = property(lambda self: self.markov_rank > 0)

    def to_json(self) -> dict[str, Any]:
        """config.json in vLLM's dense layout (what ``Qwen3DSparkForCausalLM`` reads)."""
        head = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        return {**head, **config_fields.fields_json(self, _json_key, skip_none=True),
                "dflash_config": {"mask_token_id": self.mask_token_id}, "hidden_act": "silu",
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Qwen3DSparkConfig:
        """Build from config.json contents in either layout (module docstring); keys this model
        does not use are ignored.  Raises ValueError naming a missing or bad key."""
        config_fields.check_object(data)
        flat = _from_speculators(data) if "speculators_model_type" in data else _dense(data)
        optional = ("draft_vocab_size", "rope_parameters")
        kwargs = config_fields.read_fields(cls, flat, _json_key, optional, skip_none=True)
        kwargs.setdefault("draft_vocab_size", kwargs.get("vocab_size"))
        kwargs["rope_parameters"] = _rope_from_json(flat)
        return config_fields.construct(cls, kwargs)


def _dense(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's dense layout: the keys are the dataclass's, except where vLLM 0.32.0 looks first:
    the mask token in ``dflash_config`` (``get_parallel_drafting_token_id`` in
    vllm/v1/worker/gpu/spec_decode/utils.py), the target layers in
    ``eagle_aux_hidden_state_layer_ids`` (hidden-states indices), ``dflash_config``, then
    ``dspark_target_layer_ids`` (``get_eagle3_aux_layers_from_config`` in
    vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)."""
    arch = data.get("architectures")
    check(arch is None or ARCHITECTURE in arch, "architectures", arch,
          f"must name {ARCHITECTURE!r}")  # fmt: skip
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


def _from_speculators(data: dict[str, Any]) -> dict[str, Any]:
    """speculators' saved layout: the backbone's keys nest in ``transformer_layer_config``."""
    kind = data.get("speculators_model_type")
    check(kind in (SPECULATORS_TYPE, "dflash"), "speculators_model_type", kind,
          "is not a speculators draft qstream knows (known: 'dspark', 'dflash')")  # fmt: skip
    layer: dict[str, Any] = data.get("transformer_layer_config")  # type: ignore[assignment]
    check(isinstance(layer, dict), "transformer_layer_config", layer, "must be an object")
    _refuse_unmodelled(layer, {})
    # vLLM's update_dflash makes such a draft block-causal unless sliding_window_non_causal
    check(kind != "dflash" or data.get("sliding_window_non_causal", True) is True,
          "sliding_window_non_causal", data.get("sliding_window_non_causal"),
          "makes a block-causal draft, which qstream does not evaluate yet")  # fmt: skip
    aux: list[int] = data.get("aux_hidden_state_layer_ids")  # type: ignore[assignment]
    check(isinstance(aux, list) and all(is_int(i) and i >= 1 for i in aux),
          "aux_hidden_state_layer_ids", aux,
          "must list hidden-state indices >= 1 (target layer i's output is index i + 1)")  # fmt: skip
    flat = {**layer, "target_layer_ids": [i - 1 for i in aux]}
    for key in ("draft_vocab_size", "block_size", "mask_token_id", "target_hidden_size",
                "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov"):  # fmt: skip
        if data.get(key) is not None:
            flat[key] = data[key]
    flat["sample_from_anchor"] = data.get("sample_from_anchor", False)
    if kind == "dflash":
        flat["markov_rank"], flat["enable_confidence_head"] = 0, False
    flat.setdefault("target_hidden_size", layer.get("hidden_size"))
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
    """One line for a key in :data:`UNMODELLED` at a value the forward does not compute, and
    for sliding-window layers."""
    for key, fine, what in UNMODELLED:
        value = dflash.get(key[14:]) if key.startswith("dflash_config.") else data.get(key)
        check(any(value is v or (number(v) and value == v) for v in fine), key, value,
              f"makes {what}, which qstream does not evaluate yet")  # fmt: skip
    types = data.get("layer_types") or []
    check(not any(t == "sliding_attention" for t in types), "layer_types", types,
          "has sliding-window layers, which qstream does not evaluate yet")  # fmt: skip


def _rope_from_json(flat: dict[str, Any]) -> RopeParameters:
    rope = flat.get("rope_parameters")
    if rope is None:  # the legacy layout: rope_theta beside an optional rope_scaling
        rope = {"rope_theta": flat.get("rope_theta"), **(flat.get("rope_scaling") or {})}
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    check(isinstance(rope, dict), "rope_parameters", rope, "must be an object")
    if rope.get("rope_theta") is None:
        raise ValueError("config.json: missing key 'rope_parameters.rope_theta'")
    names = {f.name for f in fields(RopeParameters)}
    for key, value in rope.items():  # vLLM's get_rope reads more keys than qstream models
        check(key in names or value is None or (key, value) == ("truncate", True),
              f"rope_parameters.{key}", value, "is not evaluated by qstream")  # fmt: skip
    return config_fields.construct(
        RopeParameters, {k: v for k, v in rope.items() if k in names}, "rope_parameters: "
    )


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
