"""The EAGLE-3 draft (docs/eagle3.md), Llama and Qwen3 forms: vLLM 0.32.0 serves config.json's
``architectures: ["Eagle3LlamaForCausalLM"]`` (or ``LlamaForCausalLMEagle3``) as
``Eagle3LlamaForCausalLM`` (vllm/model_executor/models/llama_eagle3.py) and
``Eagle3Qwen3ForCausalLM`` (qwen3_eagle3.py, q/k RMSNorm per head); speculators 0.9.0 saves
``speculators_model_type: "eagle3"`` with the decoder layer's keys in ``transformer_layer_config``,
whose ``model_type`` picks the form (``update_eagle3`` in
vllm/transformers_utils/configs/speculators/algos.py).  Its config, tensor table and loading;
:data:`ARCH`, its descriptor.  The forward (:mod:`.model`) is imported when called.

>>> cfg = PRESETS["eagle3-tiny"]
>>> Eagle3Config.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from qstream.arch import family
from qstream.arch.dspark_qwen3 import (
    DEFAULT_INCLUDE,
    LAYER_MODULES,
    RopeParameters,
    _rope_from_json,
)
from qstream.arch.family import D2T, check, check_table, number
from qstream.arch.interface import EMBED, LM_HEAD
from qstream.errors import QStreamError
from qstream.serving import DEFAULTS

if TYPE_CHECKING:
    import torch

SPECULATORS_TYPE = "eagle3"
# model_type -> the class vLLM 0.32.0 serves (update_eagle3's eagle3_arch_map), and the
# config.json architectures its registry maps to it (vllm/model_executor/models/registry.py).
FORMS = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}
ARCHITECTURES = {
    "Eagle3LlamaForCausalLM": "llama",
    "LlamaForCausalLMEagle3": "llama",
    "Eagle3Qwen3ForCausalLM": "qwen3",
}
# The target's aux layers when the config names none: three
# (SupportsEagle3.get_eagle3_default_aux_hidden_state_layers in vllm/model_executor/models/
# interfaces.py: (2, L // 2, L - 3))
DEFAULT_AUX = 3
# k, the tokens drafted per verification, when config.json does not say: speculators' EAGLE-3
# converter writes 3 (speculators/convert/eagle/eagle3_converter.py); vLLM itself takes k from
# --speculative-config num_speculative_tokens, else speculators_config's first proposal method
# (SpeculatorsConfig.build_vllm_speculative_config in
# vllm/transformers_utils/configs/speculators/base.py)
DEFAULT_SPECULATIVE_TOKENS = 3
# What the midlayer is called in EAGLE-3's original checkpoints; vLLM loads it as layers.0.
# (LlamaModel.hf_to_vllm_mapper), the name speculators saves.
MIDLAYER, LAYER = "midlayer.", "layers.0."
POSITIVE_INT_FIELDS = (
    "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim vocab_size "
    "draft_vocab_size max_position_embeddings target_hidden_size num_aux_hidden_states "
    "num_speculative_tokens"
).split()


@dataclass(frozen=True)
class Llama3Rope:
    """``rope_type: "llama3"`` (Llama 3.1's, what Llama-form EAGLE-3 drafts carry): neox RoPE
    whose low frequencies are divided by ``factor``, smoothly between the two wavelengths, as
    vLLM 0.32.0's ``Llama3RotaryEmbedding._compute_inv_freq``
    (vllm/model_executor/layers/rotary_embedding/llama3_rope.py)."""

    rope_theta: float
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"
    mscale: ClassVar[float] = 1.0  # cos and sin unscaled

    def __post_init__(self) -> None:
        for key in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, key)
            check(number(value) and value > 0, f"rope_parameters.{key}", value, "must be positive")
        orig = self.original_max_position_embeddings
        check(family.positive_int(orig), "rope_parameters.original_max_position_embeddings",
              orig, "must be a positive integer")  # fmt: skip

    def inv_freq(self, d: int) -> torch.Tensor:
        import torch

        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        orig = self.original_max_position_embeddings
        low, high = self.low_freq_factor, self.high_freq_factor
        wave_len = 2 * math.pi / inv
        smooth = (orig / wave_len - low) / (high - low) if low != high else 0
        scaled = torch.where(wave_len > orig / low, inv / self.factor,
                             (1 - smooth) * inv / self.factor + smooth * inv)  # fmt: skip
        return torch.where(wave_len < orig / high, inv, scaled)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _rope(flat: dict[str, Any]) -> RopeParameters | Llama3Rope:
    """rope_parameters (or a legacy rope_theta + rope_scaling): Llama 3's, else the family's."""
    rope = flat.get("rope_parameters") or flat.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "llama3":
        return _rope_from_json(flat)
    given = {"rope_theta": flat.get("rope_theta"), **rope, "rope_type": "llama3"}
    given.pop("type", None)
    return family.rope_of(Llama3Rope, given)


@dataclass(frozen=True)
class Eagle3Config(family.Sizes):
    """One EAGLE-3 draft: one decoder layer whose attention reads [embedding ‖ hidden]."""

    model_type: str  # "llama" or "qwen3" (q/k RMSNorm per head)
    hidden_size: int  # H
    intermediate_size: int  # SwiGLU width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # d
    vocab_size: int  # V: the target's vocabulary (embed_tokens)
    draft_vocab_size: int  # Vd: lm_head's rows; < V with d2t
    rms_norm_eps: float
    rope_parameters: RopeParameters | Llama3Rope
    max_position_embeddings: int
    target_hidden_size: int  # width of each target aux state
    num_aux_hidden_states: int = DEFAULT_AUX  # fc reads this many target states concatenated
    # hidden-states indices of the target's aux layers (0 is the embedding); None: the target's
    # default three
    aux_layer_ids: tuple[int, ...] | None = None
    num_hidden_layers: int = 1  # the midlayer
    # L, the target's depth, when the config records it (vLLM takes it from the target: the
    # midlayer's runtime name is model.layers.{L}); qstream's verify reads it
    target_num_hidden_layers: int | None = None
    norm_before_residual: bool = False  # the residual is the hidden_norm'ed hidden state
    norm_output: bool = False  # the final-normed state, not the pre-norm one, is fed back
    attention_bias: bool = False
    eos_token_id: int | None = None
    # k: tokens chained per verification (docs/eagle3.md, "Drafting")
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS

    def __post_init__(self) -> None:
        family.check_positive_ints(self, POSITIVE_INT_FIELDS)
        check(self.model_type in FORMS, "model_type", self.model_type,
              f"must be one of {', '.join(FORMS)} (the EAGLE-3 forms vLLM 0.32.0 serves)")  # fmt: skip
        check(self.num_hidden_layers == 1, "num_hidden_layers", self.num_hidden_layers,
              "must be 1: qstream evaluates the one-midlayer EAGLE-3 draft only")  # fmt: skip
        family.check_attention(self)
        if (top := self.target_num_hidden_layers) is not None:
            check(family.positive_int(top), "target_num_hidden_layers", top,
                  "must be a positive integer")  # fmt: skip
        ids = self.aux_layer_ids
        if ids is None:
            check(self.num_aux_hidden_states == DEFAULT_AUX, "num_aux_hidden_states",
                  self.num_aux_hidden_states, "must be 3 when no eagle_aux_hidden_state_layer_ids "
                  "are given (the target then captures its default three layers)")  # fmt: skip
        else:
            check(all(family.is_int(i) and i >= 0 for i in ids) and len(set(ids)) == len(ids),
                  "eagle_aux_hidden_state_layer_ids", list(ids),
                  "must be distinct hidden-states indices >= 0")  # fmt: skip
            n = self.num_aux_hidden_states
            check(len(ids) == n, "eagle_aux_hidden_state_layer_ids", list(ids),
                  f"must list {n} layers: vLLM 0.32.0's fc reads {n} states of the target "
                  "(docs/eagle3.md, \"Config\")")  # fmt: skip
        family.check_flags(self, ("norm_before_residual", "norm_output", "attention_bias"))

    @property
    def architecture(self) -> str:
        """The class vLLM 0.32.0 serves it with, the config.json ``architectures`` entry."""
        return FORMS[self.model_type]

    @property
    def qk_norm(self) -> bool:
        """Whether attention RMS-normalises each head's q and k (the Qwen3 form)."""
        return self.model_type == "qwen3"

    # What the evaluations read of every draft (qstream/arch/interface.py, DraftConfig)
    @property
    def block_size(self) -> int:
        """k, the chain's length (the block drafters' B)."""
        return self.num_speculative_tokens

    @property
    def num_target_layers(self) -> int:
        return self.num_aux_hidden_states

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The aux layers as layer outputs: vLLM's id i is the residual stream entering layer
        i (``LlamaModel.forward`` in vllm/model_executor/models/llama.py), layer i - 1's output."""
        ids = self.aux_layer_ids
        if ids is None or 0 in ids:
            why = "names no" if ids is None else "names the embedding (0) among its"
            raise QStreamError(
                f"config.json {why} eagle_aux_hidden_state_layer_ids: the target's layers "
                "to read are not known"
            )
        return tuple(i - 1 for i in ids)

    @property
    def original_max_position_embeddings(self) -> int:
        orig = getattr(self.rope_parameters, "original_max_position_embeddings", None)
        return orig or self.max_position_embeddings

    markov_rank: ClassVar[int] = 0
    enable_confidence_head: ClassVar[bool] = False
    confidence_head_with_markov: ClassVar[bool] = False

    def to_json(self) -> dict[str, Any]:
        """config.json in vLLM's dense layout (what ``Eagle3LlamaForCausalLM`` reads)."""
        out = {"architectures": [self.architecture], **family.fields_json(self, skip_none=True)}
        ids = out.pop("aux_layer_ids", None)
        if ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        return {**out, "hidden_act": "silu", "tie_word_embeddings": False,
                "torch_dtype": "bfloat16"}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Eagle3Config:
        """config.json contents in either layout (unused keys ignored); ValueError naming a key."""
        family.check_object(data)
        flat = _from_speculators(data) if "speculators_model_type" in data else _dense(data)
        family.refuse_unmodelled(UNMODELLED, flat.get, flat.get("layer_types") or [])
        optional = ("head_dim", "draft_vocab_size", "rope_parameters", "target_hidden_size")
        kwargs = family.read_fields(cls, flat, optional=optional, skip_none=True)
        kwargs.setdefault("draft_vocab_size", kwargs.get("vocab_size"))
        kwargs.setdefault("target_hidden_size", kwargs.get("hidden_size"))
        H, n = kwargs.get("hidden_size"), kwargs.get("num_attention_heads")
        ok = family.positive_int(H) and family.positive_int(n)  # transformers' LlamaConfig default
        kwargs.setdefault("head_dim", int(H) // int(n) if ok else None)  # type: ignore[arg-type]
        kwargs["num_aux_hidden_states"] = _fc_inputs(flat)
        family.ids_tuple(kwargs, "aux_layer_ids", "eagle_aux_hidden_state_layer_ids")
        kwargs["rope_parameters"] = _rope(flat)
        return family.construct(cls, kwargs)


def _fc_inputs(flat: dict[str, Any]) -> Any:
    """How many target states vLLM 0.32.0's fc reads: the Llama form's ``LlamaModel.__init__``
    counts ``num_aux_hidden_states``, else eagle_config's ids, else 3; the Qwen3 form's
    ``Qwen3Eagle3Model.__init__`` (qwen3_eagle3.py) ``num_aux_layers``,
    ``num_aux_hidden_states``, else the ids at the top level or in eagle_config, else 3."""
    eagle = flat.get("eagle_config") or {}
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    counted = [flat.get("num_aux_hidden_states"), nested]
    if flat.get("model_type") == "qwen3":
        top = flat.get("eagle_aux_hidden_state_layer_ids")
        counted = [flat.get("num_aux_layers"), flat.get("num_aux_hidden_states"), top or nested]
    for count in counted:
        if count:
            return len(count) if isinstance(count, list) else count
    return DEFAULT_AUX


def _dense(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's dense layout: the form from ``architectures``; the aux layers where
    ``LlamaModel.__init__`` reads them (``num_aux_hidden_states``, else ``eagle_config``'s
    ``eagle_aux_hidden_state_layer_ids``, then the top-level key ``get_eagle3_aux_layers_from_config``
    reads in vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)."""
    arch = data.get("architectures") or []
    forms = [ARCHITECTURES[a] for a in arch if a in ARCHITECTURES]
    check(bool(forms), "architectures", arch, f"must name one of {', '.join(ARCHITECTURES)}")
    eagle = data.get("eagle_config") or {}
    check(isinstance(eagle, dict), "eagle_config", eagle, "must be an object")
    flat = {**data, "model_type": forms[0]}
    nested = eagle.get("eagle_aux_hidden_state_layer_ids")
    flat["aux_layer_ids"] = data.get("eagle_aux_hidden_state_layer_ids") or nested or None
    for key in ("use_aux_hidden_state", "norm_before_fc"):
        if key in eagle:
            flat[key] = eagle[key]
    return flat


def _from_speculators(data: dict[str, Any]) -> dict[str, Any]:
    """speculators' saved layout as vLLM's ``update_eagle3`` reads it: the layer's keys in
    ``transformer_layer_config``, ``norm_before_residual`` true when absent, and the aux layer
    ids at the top level (where only the Qwen3 form counts them, :func:`_fc_inputs`)."""
    kind = data.get("speculators_model_type")
    check(kind == SPECULATORS_TYPE, "speculators_model_type", kind, "is not 'eagle3'")
    keys = ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm", "norm_output")
    flat = family.speculators_layer(data, keys)
    flat["model_type"] = flat.get("model_type", "llama")
    flat["norm_before_residual"] = data.get("norm_before_residual", True)
    # speculators_config's first proposal method's speculative_tokens (None: absent), as
    # build_vllm_speculative_config (vllm/transformers_utils/configs/speculators/base.py)
    spec = data.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    first = methods[0] if isinstance(methods, list) and methods else None
    flat["num_speculative_tokens"] = (
        first.get("speculative_tokens") if isinstance(first, dict) else None
    )
    ids = data.get("eagle_aux_hidden_state_layer_ids") or None
    flat["aux_layer_ids"] = flat["eagle_aux_hidden_state_layer_ids"] = ids
    return flat


# Keys that change vLLM 0.32.0's EAGLE-3 forward in ways qstream does not model yet, with the
# values that leave it as computed (llama_eagle3.py: LlamaModel.__init__, combine_hidden_states;
# Eagle3LlamaForCausalLM.__init__'s logit_scale).
UNMODELLED = (
    ("norm_before_fc", (None, False), "an RMSNorm before fc"),
    ("fc_norm", (None, False), "per-layer RMSNorms before fc"),
    ("use_aux_hidden_state", (None, True), "a draft without fc"),
    ("logit_scale", (None, 1.0), "scaled logits"),
    ("mlp_bias", (None, False), "MLP biases"),
)


def tensor_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the draft, in checkpoint order, under speculators' names (``layers.0.``;
    a checkpoint's ``midlayer.`` is read as it): embed_tokens and lm_head may be the target's,
    d2t is a reduced vocabulary's."""
    c, p, H = config, LAYER, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (c.vocab_size, H), "fc.weight": (H, c.aux_size)}
    shapes[p + "hidden_norm.weight"] = (H,)
    # attention reads [embedding ‖ hidden]; o_proj never has a bias
    bias = ("q", "k", "v") if c.attention_bias else ()
    shapes.update(family.decoder_layer_shapes(c, p, 2 * H, bias, c.qk_norm))
    shapes["norm.weight"] = (H,)
    shapes[LM_HEAD] = (c.draft_vocab_size, H)
    if c.reduced_vocab:
        shapes[D2T] = (c.draft_vocab_size,)
    return shapes


def check_tensors(config: Eagle3Config, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """QStreamError naming the first tensor missing, unexplained or of a wrong shape."""
    table = tensor_shapes(config)
    optional = (EMBED,) if config.reduced_vocab else (EMBED, LM_HEAD)
    required = {k: v for k, v in table.items() if k not in optional}
    allowed = {**table, family.T2D: (config.vocab_size,)}

    def why(name: str) -> str:
        if name in (LM_HEAD, D2T):
            return (f"; draft_vocab_size {config.draft_vocab_size} < vocab_size "
                    f"{config.vocab_size} needs the draft's own lm_head and d2t")  # fmt: skip
        return ""

    check_table(required, allowed, shapes, where, "EAGLE-3 draft", lambda n, s: "", why)


def read_draft_tensors(directory: str | Path, config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint (``midlayer.`` read as ``layers.0.``), dequantized
    and checked, d2t as int64 offsets (:func:`qstream.arch.family.d2t_problem`)."""
    return family.read_indexed(
        directory, config, check_tensors,
        lambda n: LAYER + n.removeprefix(MIDLAYER) if n.startswith(MIDLAYER) else n,
    )  # fmt: skip


# A stored embed_tokens serves, as process_eagle_weight (vllm/model_executor/models/utils.py)
# marks it the draft's own; the target's lm_head too, for a full vocabulary.
load_weights = family.borrowing_loader(read_draft_tensors)


# A Llama-form draft over a 64-wide target; vocab_size is a placeholder `qstream synth` replaces
# with its tokenizer's (a full-vocabulary draft: no d2t).
PRESETS: dict[str, Eagle3Config] = {
    "eagle3-tiny": Eagle3Config(
        model_type="llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1024, draft_vocab_size=1024,
        rms_norm_eps=1e-6, rope_parameters=RopeParameters(rope_theta=10000.0),
        max_position_embeddings=4096, target_hidden_size=64, aux_layer_ids=(2, 4, 6),
        target_num_hidden_layers=8),
}  # fmt: skip


# How vLLM 0.32.0 serves it (llama_eagle3.py; qwen3_eagle3.py builds the same modules under
# the same names), as data (docs/vllm.md, "The EAGLE-3 draft", cites each rule).  The midlayer
# is built as model.layers.{L} (Eagle3LlamaForCausalLM.__init__ passes LlamaModel the target's
# layer count as start_layer_id); its q/k/v load into one qkv_proj and gate/up into one gate_up_proj
# (LlamaModel.hf_to_vllm_mapper's orig_to_new_stacked), as DFlash's layers do.
# The Qwen3 form's qkv_proj is named under the layer, not its self_attn
# (Qwen3Eagle3DecoderLayer.__init__: prefix=maybe_prefix(prefix, "qkv_proj")): the name
# vLLM matches ignore entries against is model.layers.{L}.qkv_proj.
QWEN3_LAYER_MODULES = {
    kind: ("qkv_proj", split) if runtime == "self_attn.qkv_proj" else (runtime, split)
    for kind, (runtime, split) in LAYER_MODULES.items()
}
LM_HEADS = {
    "lm_head": {
        "runtime": "lm_head",
        # Eagle3LlamaForCausalLM.__init__ builds lm_head with the draft's quant config; the
        # name itself is the target compressed-tensors' matcher gives it a scheme by
        "target": "lm_head",
        "formats": ("fp8", "nvfp4", "mxfp4"),
    },
}


def _serving(form: str) -> dict[str, Any]:
    """The profile of one form: the class vLLM serves it as, the config.json architectures
    its registry maps there, and the speculators form ``update_eagle3`` maps there."""
    return {
        "name": FORMS[form],
        "served_class": FORMS[form],
        "architectures": tuple(a for a, f in ARCHITECTURES.items() if f == form),
        "layer_modules": LAYER_MODULES if form == "llama" else QWEN3_LAYER_MODULES,
        "never_quantized": {
            "embed_tokens": "the draft's embedding is a VocabParallelEmbedding built without "
            "a quant config (LlamaModel.__init__, llama_eagle3.py; Qwen3Eagle3Model.__init__, "
            "qwen3_eagle3.py)",
        },
        "context_proj": "fc",  # a ReplicatedLinear built with the draft's quant config
        "lm_heads": LM_HEADS,
        "default_include": DEFAULT_INCLUDE,
        "gqa_heads": ("num_attention_heads", "num_key_value_heads"),
        "method": "eagle3",  # SpeculativeConfig.method
        "loader": "eagle",  # load_eagle_model (vllm/v1/worker/gpu/spec_decode/eagle/utils.py)
        "drafted_tokens_given": True,  # no config default: num_speculative_tokens is given
        "speculators_types": (SPECULATORS_TYPE,),
        "speculators_form": form,  # transformer_layer_config.model_type
    }


SERVING = tuple(_serving(form) for form in FORMS)


class Eagle3(family.DSparkFamily):
    """The descriptor (docs/eagle3.md): the family's calls, its chain drafter's but."""

    model_module, model_class = f"{__name__}.model", "Eagle3Draft"
    config_type: type = Eagle3Config
    quantize_include: tuple[str, ...] = DEFAULT_INCLUDE
    presets: Mapping[str, Any] = PRESETS
    serving: tuple[Mapping[str, Any], ...] = SERVING
    # ships_embed_tokens: speculators saves it, and vLLM then embeds with it (process_eagle_weight)
    not_calibrated: str | None = "an EAGLE-3 draft is not calibrated yet (docs/eagle3.md)"

    def recognises(self, data: Mapping[str, Any]) -> bool:
        return data.get("speculators_model_type") == SPECULATORS_TYPE or any(
            a in ARCHITECTURES for a in (data.get("architectures") or [])
        )

    tensor_shapes = staticmethod(tensor_shapes)
    load_weights = staticmethod(load_weights)

    def build(
        self, config: Any, weights: Any, variant: Any, device: Any = "cpu", served: Any = None
    ) -> Any:
        """The family's, but a KV scale other than 1.0 (vLLM's EAGLE-3 loader is not followed
        there, docs/eagle3.md, "Serving conditions")."""
        if variant.kv_scale != DEFAULTS["kv_scale"]:
            raise QStreamError(
                f"variant {variant.name}: kvscale={variant.kv_scale} is not evaluated for "
                "EAGLE-3 drafts yet (docs/eagle3.md)"
            )
        return super().build(config, weights, variant, device, served)

    @property
    def drafter(self) -> Any:
        """The chain drafter (drafter.py), imported with torch when first asked."""
        return importlib.import_module(f"{__name__}.drafter").CHAIN_DRAFTER

    def causal_stream(self, model: Any, ids: Any, dtype: Any, depth: int | None = None) -> Any:
        return importlib.import_module(f"{__name__}.drafter").CausalRows(model, ids, dtype, depth)


ARCH = Eagle3()
