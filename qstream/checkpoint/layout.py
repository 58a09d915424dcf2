"""The ``quantization_config`` block of a quantized checkpoint (docs/quantize.md) and the stored
tensors of each quantized module.  ``targets`` is ``["Linear"]`` and ``ignore`` names every other
weight-holding module: a class target, because vLLM 0.32.0 matches a fused-MoE layer by its class
(``"Linear"`` reaches it as ``"RoutedExperts"``:
``CompressedTensorsConfig._add_fused_moe_to_target_scheme_map``, called by
``CompressedTensorsMoEMethod.get_moe_method``), as llm-compressor's ``model_free_ptq`` writes.
"""

from __future__ import annotations

from importlib import metadata

from qstream.checkpoint.safetensors_io import PlannedTensor, TensorInfo
from qstream.formats import FORMATS, Format
from qstream.serving import ACTIVATIONS, KV_CACHES, Activations

# The compressed-tensors release qstream's formats are tested against; written as the config's
# "version" when compressed-tensors itself is not installed.
TESTED_COMPRESSED_TENSORS = "0.20.1"
# compressed-tensors' FP8 KV cache: one static scale per attention layer for K and one for V
# (k_scale, v_scale), as llm-compressor's kv_cache_scheme writes it (docs/quantize.md).
KV_CACHE_SCHEME = dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
# --kv-cache-scheme: the vLLM cache dtypes that scheme serves (E4M3; attention.py turns an
# "auto" cache into "fp8" for it)
KV_CACHE_SCHEMES = tuple(k.name for k in KV_CACHES.values() if k.dtype == "float8_e4m3fn")
KV_SCALES = ("k_scale", "v_scale")  # on the attention module, as compressed-tensors names them
# The stored input scale of a static activation scheme, by its compressed-tensors strategy.
INPUT_SCALE = {"tensor": "input_scale", "tensor_group": "input_global_scale"}


def quantization_config(
    spec: Format,
    ignore: list[str],
    targets: list[str],
    activations: Activations,
    kv_cache: bool,
) -> dict:
    """The ``quantization_config`` block for format ``spec``; ``targets``: ``["Linear"]`` plus
    any quantized module vLLM builds as another class (a DSpark draft's ParallelLMHead
    markov_w2, docs/vllm.md); ``activations``: how the quantized linears' inputs are served;
    ``kv_cache``: an FP8 KV cache scheme."""
    try:
        version = metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        version = TESTED_COMPRESSED_TENSORS
    return {
        "quant_method": "compressed-tensors",
        "format": spec.layout,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(targets),
                "weights": dict(spec.weights_args),
                "input_activations": input_activations_args(spec, activations),
                "output_activations": None,
                "format": spec.layout,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv_cache else None,
        "sparsity_config": {},
        "transform_config": {},
        "version": version,
    }


def format_of_layout(layout: str) -> str | None:
    """compressed-tensors format string -> qstream format name (None if not one of ours)."""
    return next((f for f, spec in FORMATS.items() if spec.layout == layout), None)


def config_format(config: dict) -> str | None:
    """The qstream format ``config``'s quantization_config names (None: none of ours)."""
    qc = config.get("quantization_config")
    layout = qc.get("format") if isinstance(qc, dict) else None
    return format_of_layout(layout) if isinstance(layout, str) else None


def stored_tensors(spec: Format, module: str, weight: TensorInfo) -> list[PlannedTensor]:
    """Names, dtypes and shapes of what ``module`` stores once quantized to ``spec``."""
    shapes = spec.stored_shapes(*weight.shape)
    return [
        PlannedTensor(f"{module}.{suffix}", dtype or weight.dtype, shapes[suffix])
        for suffix, dtype in spec.stored_dtypes.items()
    ]


def input_activations_args(spec: Format, activations: Activations) -> dict | None:
    """compressed-tensors' ``input_activations`` for ``activations`` beside ``spec``'s weights,
    as its presets (``FP8_DYNAMIC``, ``FP8``, ``NVFP4``) write them: the weights' element type
    with the activations' strategy; NVFP4's per-block scales at run time are dynamic "local"."""
    if activations.vllm_scheme is None:
        return None
    assert spec.name in activations.weights, (spec.name, activations.name)
    args = {k: v for k, v in spec.weights_args.items() if k != "dynamic"}
    args["strategy"] = activations.strategy
    args["dynamic"] = "local" if activations.strategy == "tensor_group" else activations.dynamic
    return args


def input_scale_name(activations: Activations) -> str | None:
    """The tensor a static scheme stores per quantized linear (None: dynamic, or none)."""
    return None if activations.dynamic else INPUT_SCALE[str(activations.strategy)]


def activations_of(spec: Format, args: object) -> Activations | None:
    """The activation scheme served with ``spec``'s weights whose ``input_activations`` are
    ``args`` (None: none that qstream writes)."""
    served = [a for a in ACTIVATIONS.values() if not a.weights or spec.name in a.weights]
    return next((a for a in served if input_activations_args(spec, a) == args), None)
