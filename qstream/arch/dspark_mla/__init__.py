"""The DSpark draft with MLA attention (Kimi-K3's) behind the architecture interface
(docs/model.md): its config.json as a frozen dataclass and the presets ``tiny``, ``small`` and
``k3``; its tensor table, strict loading (quantized checkpoints dequantized, the target's lm_head
borrowed) and vLLM serving profile; :data:`ARCH`, its descriptor.  Pure Python: the forward
(:mod:`.model`, torch) is imported when first called, so ``qstream quantize`` checks a draft's
shapes without loading it.

>>> cfg = PRESETS["tiny"]
>>> DSparkConfig.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qstream.arch import family
from qstream.arch.family import DSparkFamily, check, yarn_get_mscale
from qstream.arch.interface import EMBED, LM_HEAD, TARGET_HEAD_DIR

if TYPE_CHECKING:
    import torch

ARCHITECTURE = "K3DSparkModel"
MODEL_TYPE = "k3_dspark"


@dataclass(frozen=True)
class YarnParameters:
    """``rope_parameters`` of config.json (YaRN, as DeepSeek-V3 and Kimi use it)."""

    factor: float = 32.0  # context extension factor; interpolated inv_freq = inv_freq / factor
    original_max_position_embeddings: int = 128  # pre-extension context length
    beta_fast: float = 32.0  # ramp end (in rotations) below which frequencies are extrapolated
    beta_slow: float = 1.0  # ramp start (in rotations) above which frequencies are interpolated
    # cos/sin are scaled by yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor,
    # mscale_all_dim) (DSparkConfig.rope_mscale); the softmax scale gains the square of the
    # second term (DSparkConfig.softmax_scale)
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        orig = self.original_max_position_embeddings
        check(self.factor >= 1.0, "rope_parameters.factor", self.factor, "must be >= 1")
        check(orig > 0, "rope_parameters.original_max_position_embeddings", orig,
              "must be positive")  # fmt: skip
        check(self.beta_fast > self.beta_slow > 0, "rope_parameters.beta_fast", self.beta_fast,
              f"must exceed beta_slow ({self.beta_slow}) > 0")  # fmt: skip
        check(self.mscale > 0, "rope_parameters.mscale", self.mscale, "must be positive")
        check(self.mscale_all_dim >= 0, "rope_parameters.mscale_all_dim", self.mscale_all_dim,
              "must be >= 0")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"rope_type": "yarn", **asdict(self)}


# config.json fields that must be positive integers (docs/model.md, "The DSpark-MLA draft").
POSITIVE_INT_FIELDS = (
    "hidden_size intermediate_size num_hidden_layers num_attention_heads q_lora_rank kv_lora_rank "
    "qk_nope_head_dim v_head_dim vocab_size target_hidden_size target_num_hidden_layers "
    "markov_rank block_size"
).split()


@dataclass(frozen=True)
class DSparkConfig(family.Sizes):
    """One DSpark draft.  Field names and meanings are config.json's (docs/model.md)."""

    hidden_size: int  # H, the draft's residual width
    intermediate_size: int  # I, SwiGLU width
    num_hidden_layers: int  # draft layers (5 for DSpark)
    num_attention_heads: int  # n
    q_lora_rank: int  # MLA query low-rank width
    kv_lora_rank: int  # MLA key/value latent width (what a KV cache stores)
    qk_nope_head_dim: int  # per-head key/query dims without position
    qk_rope_head_dim: int  # per-head (shared across heads for keys) rotary dims, interleaved pairs
    v_head_dim: int  # per-head value dims
    vocab_size: int  # V; rows of embed_tokens, lm_head and the Markov tables
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    rope_parameters: YarnParameters  # YaRN extension
    max_position_embeddings: int  # must equal factor * original_max_position_embeddings
    target_hidden_size: int  # width of each target hidden state fed as context
    target_num_hidden_layers: int  # the target's depth (target_layer_ids index into it)
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the aux context
    num_target_layers: int  # len(target_layer_ids)
    mask_token_id: int  # token embedded at block positions 1..B-1
    markov_rank: int  # r, width of the low-rank Markov head
    block_size: int = 7  # B, tokens drafted per block
    markov_head_type: str = "vanilla"  # the only Markov head docs/model.md defines
    # confidence_head.proj present (vLLM builds and loads it; adaptive verification reads it)
    enable_confidence_head: bool = True
    # the head reads [hf ; markov_w1[prev]] ([1, H+r]) rather than hf alone ([1, H]); vLLM
    # 0.32 builds the narrow head unless this is true (its default: false)
    confidence_head_with_markov: bool = False
    # tokenizer facts carried for convenience, not used by the model
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        family.check_positive_ints(self, POSITIVE_INT_FIELDS)
        rope = self.qk_rope_head_dim
        check(isinstance(rope, int) and rope > 0 and rope % 2 == 0, "qk_rope_head_dim", rope,
              "must be a positive even integer (RoPE rotates pairs)")  # fmt: skip
        check(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "must be positive")
        check(self.rope_theta > 1, "rope_theta", self.rope_theta, "must exceed 1")
        yarn = self.rope_parameters
        expected_max = yarn.factor * yarn.original_max_position_embeddings
        check(self.max_position_embeddings == expected_max, "max_position_embeddings",
              self.max_position_embeddings, "must equal rope_parameters.factor x "
              f"original_max_position_embeddings ({expected_max:g})")  # fmt: skip
        ids = self.target_layer_ids
        family.check_target_layers(ids, self.target_num_hidden_layers)
        check(self.num_target_layers == len(ids), "num_target_layers", self.num_target_layers,
              f"must equal len(target_layer_ids) = {len(ids)}")  # fmt: skip
        family.check_mask_token(self)
        check(self.markov_head_type == "vanilla", "markov_head_type", self.markov_head_type,
              "must be 'vanilla'")  # fmt: skip
        family.check_flags(self, ("enable_confidence_head", "confidence_head_with_markov"))

    # Derived sizes: names follow docs/model.md's tensor table.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def original_max_position_embeddings(self) -> int:
        """The context length the rope was trained at, before YaRN extends it."""
        return self.rope_parameters.original_max_position_embeddings

    @property
    def softmax_scale(self) -> float:
        """``(nope+rope)^-0.5 * yarn_get_mscale(factor, mscale_all_dim)^2`` (DeepSeek-V3's,
        as vLLM's K3 MLA applies it to the softmax; 0.130861 for Kimi-K3)."""
        yarn = self.rope_parameters
        m = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        return self.qk_head_dim**-0.5 * (m * m)

    @property
    def rope_mscale(self) -> float:
        """The factor on RoPE's cos and sin, 1 exactly when mscale == mscale_all_dim."""
        yarn = self.rope_parameters
        m = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        return yarn_get_mscale(yarn.factor, yarn.mscale) / m

    def to_json(self) -> dict[str, Any]:
        """config.json contents (every field, plus architectures/model_type)."""
        head = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        return {**head, **family.fields_json(self), "torch_dtype": "bfloat16"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DSparkConfig:
        """Build from config.json contents; keys this model does not use (quantization_config,
        transformers_version, ...) are ignored.  Raises ValueError naming a missing or bad key."""
        family.check_object(data)
        arch = data.get("architectures")
        check(arch is None or arch == [ARCHITECTURE], "architectures", arch,
              f"must be [{ARCHITECTURE!r}]")  # fmt: skip
        check(data.get("model_type", MODEL_TYPE) == MODEL_TYPE, "model_type",
              data.get("model_type"), f"must be {MODEL_TYPE!r}")  # fmt: skip
        kwargs = family.read_fields(cls, data)
        family.ids_tuple(kwargs, "target_layer_ids", "target_layer_ids")
        yarn = kwargs["rope_parameters"]
        check(isinstance(yarn, dict), "rope_parameters", yarn, "must be an object")
        check(yarn.get("rope_type") == "yarn", "rope_parameters.rope_type",
              yarn.get("rope_type"), "must be 'yarn'")  # fmt: skip
        names = {f.name for f in fields(YarnParameters)}
        if missing := sorted(names - set(yarn)):
            raise ValueError(f"config.json: missing key 'rope_parameters.{missing[0]}'")
        kwargs["rope_parameters"] = family.construct(
            YarnParameters, {k: yarn[k] for k in names}, "rope_parameters: "
        )
        return family.construct(cls, kwargs)


def _preset(**kw: Any) -> DSparkConfig:
    yarn = YarnParameters(factor=32.0, original_max_position_embeddings=kw.pop("original_max"))
    return DSparkConfig(
        num_hidden_layers=5,
        confidence_head_with_markov=True,  # the presets' head reads hf and the Markov embedding
        rms_norm_eps=1e-5,
        rope_parameters=yarn,
        max_position_embeddings=int(32 * yarn.original_max_position_embeddings),
        num_target_layers=len(kw["target_layer_ids"]),
        mask_token_id=2,
        **kw,
    )


# vocab_size / mask_token_id of tiny are placeholders: `qstream synth` replaces them with its
# tokenizer's (dataclasses.replace).  small and k3 keep their vocab and pad the tokenizer's.
PRESETS: dict[str, DSparkConfig] = {
    # docs/model.md, tiny column.  v_head_dim != qk_nope_head_dim and n*v != H on purpose;
    # every quantized input width (H, I, q_lora_rank, n*v, A) is a multiple of 32, so MXFP4,
    # NVFP4 and FP8 quantize the same tensors and are compared on them.
    "tiny": _preset(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=1024,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8,
        rope_theta=10000.0, original_max=128, markov_rank=16,
        target_hidden_size=64, target_num_hidden_layers=8, target_layer_ids=(0, 2, 4, 5, 6)),
    # CPU benchmark size: realistic matrix shapes (H 1024, V 32k), about 90 M parameters.
    "small": _preset(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=8, vocab_size=32000,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, rope_theta=10000.0, original_max=4096, markov_rank=64,
        target_hidden_size=1024, target_num_hidden_layers=24, target_layer_ids=(1, 6, 12, 17, 22)),
    # docs/model.md, Kimi-K3 column: 68 tensors, 3,562,312,961 parameters.
    "k3": _preset(
        hidden_size=7168, intermediate_size=14336, num_attention_heads=64, vocab_size=163840,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_theta=50000.0, original_max=32768, markov_rank=256,
        target_hidden_size=7168, target_num_hidden_layers=93, target_layer_ids=(2, 23, 47, 71, 89)),
}  # fmt: skip


def tensor_shapes(config: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """docs/model.md's tensor table: name -> shape, in checkpoint order."""
    c = config
    n, H = c.num_attention_heads, c.hidden_size
    nkv = n * (c.qk_nope_head_dim + c.v_head_dim)
    shapes: dict[str, tuple[int, ...]] = {
        EMBED: (c.vocab_size, H),
        "context_proj.weight": (H, c.aux_size),
        "context_norm.weight": (H,),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_a_proj.weight"] = (c.q_lora_rank, H)
        shapes[p + "self_attn.q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes[p + "self_attn.q_b_proj.weight"] = (n * c.qk_head_dim, c.q_lora_rank)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, H)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (nkv, c.kv_lora_rank)
        shapes[p + "self_attn.o_proj.weight"] = (H, n * c.v_head_dim)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, H)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, H)
        shapes[p + "mlp.down_proj.weight"] = (H, c.intermediate_size)
    shapes["final_norm.weight"] = (H,)
    return {**shapes, **family.head_shapes(c, c.vocab_size)}


def check_tensors(
    config: DSparkConfig,
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    extra: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """QStreamError naming the first tensor missing, unexpected (beyond ``extra``) or misshapen."""
    expected = {**tensor_shapes(config), **(extra or {})}
    family.check_table(expected, expected, shapes, where, "DSpark draft",
                lambda name, shape: family.shape_hint(config, name, shape))  # fmt: skip


def load_config(directory: str | Path) -> DSparkConfig:
    """config.json of a draft checkpoint (QStreamError naming key and value)."""
    return family.load_config(directory, DSparkConfig.from_json)


def read_draft_tensors(
    directory: str | Path, config: DSparkConfig | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint, dequantized (4-bit formats to bf16, FP8 to its
    scale's dtype) and checked (``embed_tokens.weight`` may be left to the target)."""
    from qstream.checkpoint.read import read_draft_checkpoint

    directory = Path(directory)
    config = config or load_config(directory)
    tensors, _ = read_draft_checkpoint(directory)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if EMBED not in shapes:
        shapes[EMBED] = (config.vocab_size, config.hidden_size)  # checked when borrowed
    check_tensors(config, shapes, str(directory))
    return tensors


def load_weights(
    model_dir: str | Path,
    target: str | Path | None = None,
    config: DSparkConfig | None = None,
    noted: Callable[[dict], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The draft's tensors with ``lm_head.weight`` and ``embed_tokens.weight`` from ``target``
    (default ``model_dir/target_head``, as ``qstream synth`` writes it).  vLLM 0.32.0 never
    serves the draft's stored embed_tokens: ``K3DSparkForCausalLM.hf_to_vllm_mapper`` drops it
    and, ``has_own_embed_tokens`` being False, ``load_dspark_model``
    (``vllm/v1/worker/gpu/spec_decode/dspark/utils.py``) aliases the target's
    (``maybe_share_target_embed``).  The stored copy serves only a target that holds none;
    when it differs from the target's, ``noted`` gets ``{target, max_abs_diff}``."""
    from qstream.checkpoint.read import read_target_tensors

    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    tensors = read_draft_tensors(model_dir, config)
    own = tensors.get(EMBED)
    read = partial(read_target_tensors, optional=(EMBED,) if own is not None else ())
    expected = (config.vocab_size, config.hidden_size)
    lent = family.borrow_from_target(model_dir, target, [LM_HEAD, EMBED], expected, "lm_head", read)
    if own is not None and EMBED in lent and noted:
        # max |own - lent| in float32 (exact for bf16), 4096 rows at a time (K3's is 1.2 B)
        pairs = zip(own.split(4096), lent[EMBED].split(4096), strict=True)
        if diff := max(float((a.float() - b.float()).abs().max()) for a, b in pairs):
            noted({"target": str(target or model_dir / TARGET_HEAD_DIR), "max_abs_diff": diff})
    return {**tensors, **lent}


# How vLLM 0.32.0 serves the draft (vllm/models/kimi_k3/nvidia/dspark_mla.py), as data:
# SERVING is the K3DSparkModel serving profile that qstream/vllm/profiles.py builds
# (docs/vllm.md cites each rule).


# Checkpoint module (under layers.{i}.) -> (runtime module under model.layers.{L+i}., split).
# q_a/kv_a load into one fused_qkv_a_proj, gate/up into gate_up_proj
# (K3DSparkForCausalLM.hf_to_vllm_mapper's orig_to_new_stacked); the splits are those of
# vllm/models/kimi_k3/nvidia/mla.py MultiHeadLatentAttention and model.py KimiMLP.
LAYER_MODULES = {
    "self_attn.q_a_proj": ("self_attn.fused_qkv_a_proj", "none"),
    "self_attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj", "none"),
    "self_attn.q_b_proj": ("self_attn.q_b_proj", "out"),
    "self_attn.kv_b_proj": ("self_attn.kv_b_proj", "out"),
    "self_attn.o_proj": ("self_attn.o_proj", "in"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "out"),
    "mlp.up_proj": ("mlp.gate_up_proj", "out"),
    "mlp.down_proj": ("mlp.down_proj", "in"),
}
# Modules vLLM never builds quantized, with the reason (docs/vllm.md cites each).  In vLLM
# 0.32.0, K3DSparkModel.__init__ builds DSparkMarkovHead and, when config.json sets
# enable_confidence_head, DSparkConfidenceHead (an fp32 ReplicatedLinear, served for adaptive
# verification) without a quant config; K3DSparkForCausalLM.hf_to_vllm_mapper drops
# embed_tokens (the target's is shared).
NEVER_QUANTIZED = {
    "markov_head.markov_w1": "the DSpark Markov head is built without a quant config",
    "markov_head.markov_w2": "the DSpark Markov head is built without a quant config",
    "confidence_head.proj": (
        "the DSpark confidence head is built in fp32 without a quant config "
        "(served for adaptive verification)"
    ),
    "embed_tokens": "the draft's embedding is an embedding table, not a Linear layer",
}
SERVING = {
    "name": "K3DSparkModel",
    "served_class": "K3DSparkForCausalLM",  # vllm/models/kimi_k3/nvidia/dspark_mla.py
    "architectures": ("K3DSparkModel",),
    "layer_modules": LAYER_MODULES,
    "never_quantized": NEVER_QUANTIZED,
    "context_proj": "context_proj",
    "context_kv": "model.context_kv_proj",
    # q_a_proj and kv_a_proj_with_mqa of every layer are one fused group: each layer fuses its
    # pair into fused_qkv_a_proj, and every layer's kv_a is loaded again into one context_kv_proj.
    "cross_layer": (
        ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
        "self_attn.{q_a_proj, kv_a_proj_with_mqa} of every layer",
        "vLLM fuses each layer's pair into fused_qkv_a_proj and loads every layer's "
        "kv_a_proj_with_mqa again into one cross-layer context_kv_proj",
    ),
}


# The module kinds docs/model.md quantizes in a shipped DSpark (61% of K3's parameters).
QUANTIZE_INCLUDE = tuple(
    "mlp.gate_proj mlp.up_proj mlp.down_proj self_attn.o_proj self_attn.q_b_proj context_proj".split()
)


class DSparkMLA(DSparkFamily):
    """The descriptor: every call the rest of the package makes of this architecture."""

    model_module, model_class = "qstream.arch.dspark_mla.model", "DSpark"
    config_type: type = DSparkConfig
    quantize_include: tuple[str, ...] = QUANTIZE_INCLUDE
    presets: Mapping[str, Any] = PRESETS
    serving: tuple[Mapping[str, Any], ...] = (SERVING,)
    final_norm = "final_norm.weight"
    context_proj = "context_proj"
    embeds_with_target = True  # load_weights: the target's embed_tokens, as vLLM serves

    def recognises(self, data: Mapping[str, Any]) -> bool:
        return data.get("architectures") == [ARCHITECTURE] or data.get("model_type") == MODEL_TYPE

    tensor_shapes = staticmethod(tensor_shapes)
    load_weights = staticmethod(load_weights)


ARCH = DSparkMLA()
