"""The shapes a checkpoint's tensors must have for what its config.json says, per serving profile
(docs/quantize.md, "Tensors checked against the config"), checked by ``quantize`` on its input and
``verify`` on its output.  A draft's: the architecture's ``tensor_shapes``; a missing tensor
matters even where vLLM does not complain (DefaultModelLoader.load_weights, default_loader.py,
refuses unloaded parameters only without a quantization config).  ``generic``: the integer fields
vLLM sizes layers from, and each fused group complete and agreeing on K."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from qstream.arch.family import D2T, d2t_problem
from qstream.arch.registry import architecture_for
from qstream.formats import CODE_SUFFIXES, FORMATS
from qstream.vllm import profiles as serving
from qstream.vllm.profiles import Profile

if TYPE_CHECKING:
    from qstream.checkpoint.files import Checkpoint

Shapes = Mapping[str, tuple[int, ...]]

# Tensors of a DSpark draft's table that vLLM drops at load (the target's embedding is shared:
# K3DSparkForCausalLM.hf_to_vllm_mapper, docs/vllm.md), so a draft may leave them out.
DROPPED_BY_VLLM = ("embed_tokens.weight",)
# config.json fields of a Hugging Face causal LM that vLLM's model classes size layers from
# (e.g. LlamaAttention and LlamaMLP in vllm/model_executor/models/llama.py); null means unset.
GENERIC_INT_FIELDS = (
    "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "head_dim vocab_size max_position_embeddings"
).split()


def shape_problems(
    profile: Profile,
    config_json: Mapping,
    stored: Shapes,
    fmt: str | None = None,
    quantized: Collection[str] = (),
) -> list[str]:
    """One line per way the ``stored`` tensors (name -> shape) differ from what ``config_json``
    implies under ``profile`` (``fmt``, ``quantized``: how its modules are stored)."""
    empty = {
        n for n, shape in stored.items() if n.rpartition(".")[2] in CODE_SUFFIXES and 0 in shape
    }
    problems = [
        f"{n}: shape {list(stored[n])}, a zero-size weight (no config builds a layer "
        "without inputs or outputs)"
        for n in sorted(empty)
    ]
    if profile.renames_layers:
        rest = _dspark_problems(config_json, stored, fmt, quantized)
    else:
        rest = [
            f"config.json: {key} = {value!r} must be a positive integer"
            for key in GENERIC_INT_FIELDS
            if (value := config_json.get(key)) is not None
            and (isinstance(value, bool) or not isinstance(value, int) or value <= 0)
        ]
        rest += _fused_problems(stored)
    return problems + [p for p in rest if p.split(":", 1)[0] not in empty]


def d2t_problems(checkpoint: Checkpoint) -> list[str]:
    """The check loading makes of a stored ``d2t`` (:func:`qstream.arch.family.d2t_problem`)
    against config.json's ``vocab_size``; none without a d2t or a readable config."""
    if D2T not in checkpoint.tensor_shard:
        return []
    try:
        vocab = architecture_for(checkpoint.config).parse_config(checkpoint.config).vocab_size
    except ValueError:  # shape_problems names it
        return []
    shard = checkpoint.tensor_shard[D2T]
    problem = d2t_problem(checkpoint.tensor(D2T), vocab)
    return [] if problem is None else [f"{problem} (in {shard})"]


def _dspark_problems(
    config_json: Mapping, stored: Shapes, fmt: str | None, quantized: Collection[str]
) -> list[str]:
    """Every tensor vLLM loads present (a quantized module's are verify's other checks) and of
    the shape vLLM builds, each quantized weight as what its format stores."""
    arch = architecture_for(config_json)
    try:
        config = arch.parse_config(config_json)
    except ValueError as exc:
        return [f"{exc}; cannot check the tensors against what vLLM builds from it"]
    problems, expected = [], {}
    for name, shape in arch.tensor_shapes(config).items():
        module, _, suffix = name.rpartition(".")
        if name not in stored and name not in DROPPED_BY_VLLM and module not in quantized:
            problems.append(
                f"{name}: missing; vLLM builds it {list(shape)} from config.json and would "
                "leave it unloaded"
            )
        if fmt and module in quantized and suffix == "weight" and len(shape) == 2:
            expected.update(
                {f"{module}.{s}": v for s, v in FORMATS[fmt].stored_shapes(*shape).items()}
            )
        else:
            expected[name] = shape
    return problems + [
        f"{name}: stored {list(shape)}, vLLM builds {list(expected[name])} from config.json"
        f"{arch.shape_hint(config, name, shape)}"
        for name, shape in stored.items()
        if name in expected and tuple(shape) != expected[name]
    ]


def _fused_problems(stored: Shapes) -> list[str]:
    """A fused member without the partners vLLM needs (serving.GENERIC_PARTNERS), and members
    of one fused group that disagree on K (the halves of a gated MLP: on the whole shape).  A
    4-bit ``weight_packed [N, K/2]`` holds an ``[N, K]`` weight (docs/formats.md)."""
    weights: dict[str, tuple[int, ...]] = {}
    for name, shape in stored.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight":
            weights[module] = tuple(shape)
        elif suffix in CODE_SUFFIXES and len(shape) == 2:
            weights[module] = (shape[0], CODE_SUFFIXES[suffix] * shape[1])
    problems = []
    for module in weights:
        parent, _, leaf = module.rpartition(".")
        for partner in serving.GENERIC_PARTNERS.get(leaf, ()):
            if f"{parent}.{partner}" not in weights:
                problems.append(
                    f"{module}.weight: present without {parent}.{partner}.weight; vLLM fuses "
                    f"{leaf} with {partner} into one layer and cannot build it from part"
                )
    for group in serving.fused_groups(weights):
        members = [m for m in group.members if len(weights[m]) == 2]
        whole = tuple(m.rpartition(".")[2] for m in group.members) in serving.GENERIC_EQUAL_SHAPES
        keys = {m: weights[m] if whole else weights[m][1:] for m in members}
        counts = Counter(keys.values())
        if len(counts) < 2:
            continue
        reference = next(m for m in members if keys[m] == counts.most_common(1)[0][0])
        what = "shapes" if whole else "input widths"
        problems += [
            f"{m}.weight: shape {list(weights[m])}, but {reference}.weight is "
            f"{list(weights[reference])}; vLLM fuses {group.label} into one matrix, so their "
            f"{what} must agree"
            for m in members
            if keys[m] != keys[reference]
        ]
    return problems
