"""The variants an evaluation compares with the FP32 reference (each a serving configuration,
qstream/serving.py): the settings' variants, each one's weights, the weight SNR of the tensors its
format changed (docs/eval-drift.md), and whether each checkpoint is what its role says
(docs/guarantees.md): the ``--model`` must be unquantized (a quantized one would make its own
format look free), and a ``--variant`` derived from it (quantizing leaves every tensor it does not
quantize bit-identical; a foreign one is refused, or allowed and labelled ``foreign``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qstream.arch.interface import EMBED, LM_HEAD, DraftConfig
from qstream.arch.registry import architecture_of, load_config
from qstream.arch.weights import ServedLinears
from qstream.checkpoint.files import open_checkpoint, read_config
from qstream.checkpoint.integrity import integrity_record
from qstream.checkpoint.read import kv_scale_names, read_kv_scales
from qstream.checkpoint.safetensors_io import ShardReader, drop_resident_pages
from qstream.errors import QStreamError
from qstream.eval.settings import Selection
from qstream.formats import QUANTIZED_SUFFIXES, snr_db, snr_sums
from qstream.formats.activations import INPUT_SCHEMES
from qstream.formats.head import HEADS
from qstream.quant.schemes import kv_scales
from qstream.quant.simulate import simulate_format, simulated_selection
from qstream.serving import DEFAULTS, KV_CACHES, Variant
from qstream.vllm.profiles import KV_SCALES_NOT_LOADED, profile_for

if TYPE_CHECKING:
    from qstream.calibration import Calibration

Weights = Mapping[str, torch.Tensor]


def settings_variants(settings: Selection) -> tuple[Variant, ...]:
    """The simulated formats, then the checkpoint directories, each checked against the sha256s
    quantize recorded unless the settings say not to."""
    checkpoints = []
    for name, path in settings.variant_dirs:
        record = integrity_record(path, f"--variant {name}", not settings.no_integrity_check)
        variant = Variant.of_checkpoint(name, path, tuple(record.items()))
        if settings.kv_cache_dtype is not None:
            variant = replace(variant, kv_cache=settings.kv_cache_dtype)
        checkpoints.append(_with_kv_cache_scheme(variant, read_config(Path(path))))
    return (*settings.simulated, *checkpoints)


def _with_kv_cache_scheme(variant: Variant, config: dict) -> Variant:
    """A checkpoint declaring a ``kv_cache_scheme`` as vLLM 0.32.0 serves it: its ``auto``
    cache becomes ``fp8`` (vllm/model_executor/layers/attention/attention.py,
    ``Attention.__init__``) and an fp8 cache takes its stored k_scale / v_scale
    (``kvscale=checkpoint``; fp8_e5m2 is refused there, as vLLM refuses it).  The K3 draft's
    loader refuses them: one line saying so (docs/vllm.md, "KV-cache scales")."""
    if (config.get("quantization_config") or {}).get("kv_cache_scheme") is None:
        return variant
    refused = KV_SCALES_NOT_LOADED.get(profile_for(config).name)
    if refused:
        raise QStreamError(
            f"--variant {variant.name}: it declares a kv_cache_scheme, but {refused}"
        )
    kv_cache = "fp8" if variant.kv_cache == "auto" else variant.kv_cache
    scaled = KV_CACHES[kv_cache].quantized
    return replace(variant, kv_cache=kv_cache, kv_scale="checkpoint" if scaled else "1.0")


def variant_weights(
    variant: Variant,
    reference_weights: Weights,
    config: DraftConfig,
    settings: Selection,
    target: str | None,
) -> tuple[Weights, list[str]]:
    """The variant's weights and the names of the tensors its format changed."""
    if variant.stored:
        return reference_weights, []
    if variant.simulated:
        # Shapes a block format cannot hold stay bf16, as --skip-incompatible writes them; the
        # results list which tensors were quantized (quantized_tensors, weight_snr.tensors).
        include = settings.include_layers if variant.include is None else variant.include
        weights = simulate_format(
            reference_weights,
            variant.source,
            include=include,
            ignore=settings.ignore_layers,
            skip_incompatible=True,
            config=config,
        )
    else:  # its config.json equals the reference's (provenance.check_variants_derived)
        weights = architecture_of(config).load_weights(variant.source, target, config)
    # a shared tensor is never read (at K3 scale that would map the embedding table into memory)
    changed = [
        k
        for k, v in weights.items()
        if k != LM_HEAD
        and v is not reference_weights[k]
        and not torch.equal(v.to(reference_weights[k].dtype), reference_weights[k])
    ]
    return weights, changed


def served_linears(
    variant: Variant,
    reference_weights: Weights,
    config: DraftConfig,
    settings: Selection,
    calibration: Calibration | None,
) -> ServedLinears | None:
    """The variant's input quantizer at every linear its format quantizes (None: activations
    unquantized), each with its calibrated scale when the scheme has one: from the module's
    input amax in its weight's dtype (compressed-tensors), a fused group keeping its members'
    largest, as vLLM 0.32.0 does (``process_weights_after_loading`` of
    ``CompressedTensorsW8A8Fp8``: ``input_scale.max()``, of ``CompressedTensorsW4A4Fp4``:
    ``input_global_scale.max()``)."""
    kv_scales = kv_cache_scales(variant, reference_weights, calibration)
    inputs = _input_quantizers(variant, reference_weights, config, settings, calibration)
    products = head_product(variant, reference_weights)
    if inputs is None and not kv_scales and not products:
        return None
    return ServedLinears(inputs or {}, kv_scales=kv_scales, products=products)


def head_product(variant: Variant, reference_weights: Weights) -> dict[str, Callable]:
    """The drafting head as ``variant.head`` serves it: {} as stored, else lm_head quantized at
    load from its copy in the model's dtype, as vLLM 0.33.0 quantizes the bf16 head it holds
    (qstream/formats/head.py); a hidden size NVFP4 cannot block is one line naming it."""
    if variant.head == DEFAULTS["head"]:
        return {}
    weight = reference_weights[LM_HEAD].to(variant.dtype)
    try:
        return {LM_HEAD: HEADS[variant.head](weight)}
    except ValueError as exc:
        raise QStreamError(f"variant {variant.name}: {LM_HEAD} {exc}") from exc


def _input_quantizers(
    variant: Variant,
    reference_weights: Weights,
    config: DraftConfig,
    settings: Selection,
    calibration: Calibration | None,
) -> dict[str, Callable] | None:
    strategy = variant.activation.strategy
    if strategy is None:
        return None
    include = settings.include_layers if variant.include is None else variant.include
    selection = simulated_selection(
        reference_weights, variant.source, include, settings.ignore_layers, True, config
    )
    scheme = INPUT_SCHEMES[strategy]
    scales: dict[str, torch.Tensor | None] = dict.fromkeys(selection.quantized)
    if scheme.calibrated is not None:
        if calibration is None:
            raise ValueError(f"variant {variant.name}: its activations need a calibration")
        for m in selection.quantized:
            amax = calibration.input_amax(m).to(reference_weights[f"{m}.weight"].dtype)
            scales[m] = scheme.calibrated(amax)
        for group in selection.fused_groups:
            top = max((scales[m] for m in group.members), key=lambda t: float(t))  # type: ignore[arg-type]
            scales.update(dict.fromkeys(group.members, top))
    return {f"{m}.weight": _bound(scheme.quantize, scales[m]) for m in scales}


def _bound(quantize: Callable, scale: torch.Tensor | None) -> Callable:
    return lambda x: quantize(x, scale)


def kv_cache_scales(
    variant: Variant, reference_weights: Weights, calibration: Calibration | None
) -> dict[str, tuple[float, float]]:
    """Each attention's (k_scale, v_scale) as vLLM 0.32.0 holds them (``_k_scale_float``: the
    stored scale as float32, ``BaseKVCacheMethod.process_weights_after_loading``,
    vllm/model_executor/layers/quantization/kv_cache.py); {} at scale 1.0.  Calibrated: what
    ``quantize --kv-cache-scheme`` stores from the amax of what the cache holds,
    compressed-tensors' ``amax / 448`` in the weight dtype (qstream/quant/schemes.py,
    ``kv_scales``); the K3 MLA's one entry takes its K amax for both.  Checkpoint: its own."""
    if variant.kv_scale == "checkpoint":
        return read_kv_scales(Path(variant.source))
    if variant.kv_scale != "calibrated":
        return {}
    if calibration is None:
        raise ValueError(f"variant {variant.name}: its KV-cache scales need a calibration")
    attentions: dict[str, torch.dtype] = {}  # each attention module and its weights' dtype
    for name, tensor in reference_weights.items():
        if ".self_attn." in name:
            attention = name[: name.index(".self_attn.")] + ".self_attn"
            attentions.setdefault(attention, tensor.dtype)
    out = {}
    for attention, dtype in attentions.items():
        k, v = calibration.kv_amax(attention)
        v = k if v is None else v
        scales = kv_scales((float(k), float(v)), dtype)
        out[attention] = (float(scales["k_scale"]), float(scales["v_scale"]))
    return out


def weight_snr(weights: Weights, reference_weights: Weights, changed: list[str]) -> dict:
    """Weight SNR over the tensors a format changed (bf16: over every draft tensor)."""
    names = changed or [k for k in reference_weights if k != LM_HEAD]
    if all(
        weights[n] is reference_weights[n] and weights[n].dtype == torch.bfloat16 for n in names
    ):
        # the bf16 floor of a bf16 checkpoint: no error anywhere, nothing to read
        return {"tensors": len(names), "overall_db": None, "worst_db": None}
    sums = []
    for n in names:
        sums.append(snr_sums(reference_weights[n], weights[n].to(torch.bfloat16)))
        drop_resident_pages(reference_weights[n])  # a mapped original leaves memory again
    signal, noise = sum(s for s, _ in sums), sum(e for _, e in sums)
    finite = [snr_db(*pair) for pair in sums if pair[1] > 0]
    return {
        "tensors": len(names),
        "overall_db": None if noise == 0 else snr_db(signal, noise),
        "worst_db": min(finite) if finite else None,
    }


def quantized_modules(names) -> set[str]:
    return {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in QUANTIZED_SUFFIXES}


def refuse_quantized_model(model_dir: str | Path) -> None:
    checkpoint = open_checkpoint(model_dir)
    modules = quantized_modules(checkpoint.tensor_shard)
    if "quantization_config" in checkpoint.config:
        why = "its config.json has a quantization_config"
    elif modules:
        why = f"it stores quantized tensors, e.g. {min(modules)}.weight_scale"
    else:
        return
    raise QStreamError(
        f"--model {model_dir} is a quantized checkpoint ({why}); the reference "
        "must be unquantized: pass its unquantized base as --model and this "
        f"directory as --variant NAME={model_dir}"
    )


def foreign_tensors(
    variant_dir: str | Path, model_weights: Mapping[str, torch.Tensor]
) -> list[str]:
    """Tensors the variant keeps unquantized that are not bit-identical to the model's (dtype
    and every bit); tensors the variant lacks (e.g. a borrowed embedding) are not compared,
    nor the KV-cache scales its kv_cache_scheme adds, nor a stored embed_tokens the architecture
    never serves (``embeds_with_target``)."""
    checkpoint = open_checkpoint(variant_dir)
    quantized = quantized_modules(checkpoint.tensor_shard)
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    unserved = {EMBED} if architecture_of(load_config(variant_dir)).embeds_with_target else set()
    unserved |= kv_scale_names(checkpoint)
    differ = []
    for name, shard in checkpoint.tensor_shard.items():
        if name.rpartition(".")[0] in quantized or name in unserved:
            continue
        ours = model_weights.get(name)
        theirs = readers[shard].tensor(name)
        if ours is None or ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
            differ.append(name)
    return differ


def check_variants_derived(
    variants: tuple[Variant, ...],
    model_dir: str | Path,
    model_weights: Mapping[str, torch.Tensor],
    allow_foreign: bool,
) -> tuple[Variant, ...]:
    """The variants, each checkpoint checked to be derived from ``model_dir``: a foreign one is
    refused, or with ``allow_foreign`` marked ``foreign=True``."""
    config = load_config(model_dir)
    out = []
    for variant in variants:
        if not variant.checkpoint:
            out.append(variant)
            continue
        if load_config(variant.source) != config:
            raise QStreamError(
                f"--variant {variant.name}: {variant.source} is a different "
                f"architecture than --model {model_dir} (config.json differs)"
            )
        differ = foreign_tensors(variant.source, model_weights)
        if differ and not allow_foreign:
            raise QStreamError(
                f"--variant {variant.name}: {variant.source} is not derived from --model "
                f"{model_dir}: {len(differ)} tensor(s) it keeps unquantized differ, e.g. "
                f"{differ[0]}; quantizing keeps those bit-identical (use "
                "--allow-foreign-variant to compare it anyway, labelled foreign)"
            )
        out.append(replace(variant, foreign=bool(differ)))
    return tuple(out)
