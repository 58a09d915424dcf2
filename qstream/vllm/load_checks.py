"""qstream's bookkeeping of a vLLM load (:class:`Recorder`: which stored tensor reached which
parameter, and what each held before post-processing; vLLM tracks this only for unquantized
models) and the checks of what vLLM built (:func:`check`, docs/vllm.md, "The checks").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from qstream.checkpoint.files import Checkpoint
from qstream.checkpoint.layout import format_of_layout
from qstream.checkpoint.safetensors_io import ShardReader
from qstream.formats import CODE_SUFFIXES, FORMATS, dequantize

_SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


@dataclass
class _Loaded:
    source: str  # the stored tensor's name
    shard: Any  # the shard id it was loaded as (None: the whole parameter)


class Recorder:
    """Which stored tensor went into which parameter, and the parameters before
    post-processing."""

    def __init__(self) -> None:
        self.fed_names: list[str] = []
        self._sources: dict[int, tuple[str, torch.Tensor]] = {}  # storage -> stored tensor
        self.loads: dict[str, list[_Loaded]] = defaultdict(list)  # parameter name -> loads
        self.before: dict[str, torch.Tensor] = {}
        self.output_dim: dict[str, int | None] = {}
        self.target_params: set[int] = set()
        self.products: dict[str, torch.Tensor] = {}
        self.consumed: set[str] = set()

    def fed(self, name: str, tensor: torch.Tensor) -> None:
        # Held until the end of the load, so that no storage is reused under another name; a
        # tensor the draft class loads twice (each layer's kv_a_proj_with_mqa, again into the
        # cross-layer context_kv_proj) shares its storage and so its name.
        self.fed_names.append(name)
        self._sources[tensor.untyped_storage().data_ptr()] = (name, tensor)

    def instrument(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for param_name, param in model.named_parameters():
            original = getattr(param, "weight_loader", default_weight_loader)
            setattr(param, "weight_loader", self._wrap(param_name, original))

    def _wrap(self, param_name: str, original: Any) -> Any:
        def weight_loader(param: torch.Tensor, loaded: torch.Tensor, *args: Any, **kw: Any):
            shard = (
                args[0] if args else kw.get("loaded_shard_id", getattr(loaded, "shard_id", None))
            )
            source = self._sources.get(loaded.untyped_storage().data_ptr())
            if source is not None:
                self.consumed.add(source[0])
                self.loads[param_name].append(_Loaded(source[0], shard))
            return original(param, loaded, *args, **kw)

        return weight_loader

    def snapshot(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            if id(param) not in self.target_params:
                self.before[name] = param.detach().clone()
                self.output_dim[name] = getattr(param, "output_dim", None)

    def release(self) -> None:
        self._sources.clear()


def check(
    checkpoint: Checkpoint, model: torch.nn.Module, rec: Recorder
) -> tuple[list[dict], list[str]]:
    """The modules vLLM built (runtime name, attribute path, scheme, stored sources) and the
    problems found (docs/vllm.md, "The checks")."""
    problems: list[str] = []
    dropped = getattr(model, "hf_to_vllm_mapper", None)
    for name in rec.fed_names:
        if name in rec.consumed:
            continue
        if dropped is not None and dropped._map_name(name) is None:
            continue  # the draft class's own mapper drops it (the target's copy is used)
        problems.append(f"{name}: fed to vLLM's loader but loaded into no parameter")
    for name in sorted(set(checkpoint.tensors) - set(rec.fed_names)):
        problems.append(f"{name}: stored but never read by vLLM's loader")
    reader = _Stored(checkpoint)
    runtime = _runtime_names(model)
    spared = _unloaded_by_design(checkpoint, model, rec)
    for param_name, before in rec.before.items():
        loads = rec.loads.get(param_name)
        label = runtime(param_name)
        if not loads and param_name in spared:
            continue
        if not loads:
            problems.append(f"{label}: left unloaded by vLLM (no stored tensor reached it)")
            continue
        problem = _compare_bytes(label, before, rec.output_dim[param_name], loads, reader)
        if problem:
            problems.append(problem)
    modules = _modules(model, rec)
    fmt = format_of_layout((checkpoint.config.get("quantization_config") or {}).get("format", ""))
    for module in modules:
        if module["scheme"] != "unquantized" and fmt is not None:
            problem = _compare_product(module, rec.products.get(module["name"]), fmt, reader)
            if problem:
                problems.append(problem)
    return modules, problems


# Parameters vLLM 0.32.0 builds but fills without the checkpoint (docs/vllm.md, "The checks"):
# the Qwen3 DSpark ``mask_embedding`` placeholder, which Qwen3DSparkForCausalLM.load_weights
# (qwen3_dspark.py) always drops (a mask_embedding.pt is read by the DFlash class only), and an
# attention layer's KV-cache scales, set to 1.0 when the KV cache is not quantized
# (vllm/model_executor/layers/quantization/kv_cache.py BaseKVCacheMethod).
PLACEHOLDERS = ("model.mask_embedding",)
KV_CACHE_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")


def _unloaded_by_design(checkpoint: Checkpoint, model: torch.nn.Module, rec: Recorder) -> set:
    """Parameters a good checkpoint leaves unloaded: the placeholders above, the KV-cache scales
    of an unquantized KV cache (with their zero points), and those ``load_dspark_model``
    replaced by the target's own (an embedding or lm_head the draft does not carry)."""
    shared = {n for n, p in model.named_parameters() if id(p) in rec.target_params}
    qconfig = checkpoint.config.get("quantization_config") or {}
    spared = set(PLACEHOLDERS) | shared
    if not qconfig.get("kv_cache_scheme"):
        for name in rec.before:
            owner, _, leaf = name.rpartition(".")
            kind = leaf.removesuffix("_zero_point").removesuffix("_scale") + "_scale"
            if owner.endswith(".attn") and kind in KV_CACHE_SCALES:
                spared.add(name)
    return spared


def _runtime_names(model: torch.nn.Module):
    """Parameter path -> the name a user sees in vLLM's quant config: the owning module's
    runtime prefix (``model.layers.{L+i}...``), with the path where they differ in kind
    (``context_kv_proj`` is matched as layer L's ``fused_qkv_a_proj``)."""
    prefixes = {name: getattr(m, "prefix", None) for name, m in model.named_modules()}

    def label(param_name: str) -> str:
        owner, _, leaf = param_name.rpartition(".")
        prefix = prefixes.get(owner) or owner
        same_kind = prefix.rsplit(".", 1)[-1] == owner.rsplit(".", 1)[-1]
        return f"{prefix}.{leaf}" + ("" if same_kind else f" ({owner})")

    return label


class _Stored:
    """The stored tensors, read through qstream's own safetensors reader."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.names = set(checkpoint.tensor_shard)
        self._readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}

    def read(self, name: str) -> torch.Tensor:
        return self._readers[self.checkpoint.tensor_shard[name]].tensor(name).clone()


def _ordered(loads: list[_Loaded]) -> list[_Loaded]:
    def key(load: _Loaded) -> int:
        return _SHARD_ORDER.get(load.shard, load.shard) if load.shard is not None else 0

    return sorted(loads, key=key)


def _expected(output_dim: int | None, loads: list[_Loaded], reader: _Stored) -> torch.Tensor:
    """The stored tensors a parameter was loaded from, joined as vLLM lays shards out: along
    the parameter's output dim, or one value per shard for a per-tensor scale."""
    pieces = [reader.read(load.source) for load in _ordered(loads)]
    if len(pieces) == 1:
        return pieces[0]
    if output_dim is None:
        return torch.cat([p.reshape(-1) for p in pieces])
    return torch.cat(pieces, dim=output_dim)


def _compare_bytes(
    name: str, before: torch.Tensor, output_dim: int | None, loads: list[_Loaded], reader: _Stored
) -> str | None:
    """The parameter holds the stored bytes: same dtype, or an exact widening (bf16 -> fp32, as
    vLLM's loader allows for scales and the fp32 confidence head) with the same values; a vocab
    table may be padded past the stored rows (``VocabParallelEmbedding``)."""
    expected = _expected(output_dim, loads, reader)
    sources = ", ".join(load.source for load in _ordered(loads))
    if expected.dtype != before.dtype:
        if not (expected.dtype in _WIDENS and before.dtype in _WIDENED):
            return (
                f"{name}: vLLM loaded {sources} ({_dtype(expected)}) into a {_dtype(before)} "
                "parameter (cast, not the stored bytes)"
            )
        expected = expected.to(before.dtype)
    rows = expected.shape[0] if expected.dim() else 0
    fits = expected.dim() == before.dim() and tuple(expected.shape[1:]) == tuple(before.shape[1:])
    if not fits or not 0 < rows <= before.shape[0]:
        return (
            f"{name}: holds {list(before.shape)}, the stored {sources} make {list(expected.shape)}"
        )
    held = before[:rows]
    if not torch.equal(expected.reshape(-1).view(torch.uint8), held.reshape(-1).view(torch.uint8)):
        return f"{name}: differs from the stored bytes of {sources}"
    return None


_WIDENS = (torch.float16, torch.bfloat16, torch.float32)
_WIDENED = (torch.float32, torch.float64)


def _modules(model: torch.nn.Module, rec: Recorder) -> list[dict]:
    out = []
    for name, module in model.named_modules():
        if not hasattr(module, "quant_method") or not hasattr(module, "prefix"):
            continue
        scheme = getattr(module, "scheme", None)
        label = "unquantized" if scheme is None else type(scheme).__name__
        if getattr(scheme, "use_a16", False):
            label += "(use_a16)"
        weight = next((p for p in CODE_SUFFIXES if f"{name}.{p}" in rec.loads), None)
        sources = [load.source for load in _ordered(rec.loads.get(f"{name}.{weight}", []))]
        out.append({"module": module.prefix, "name": name, "scheme": label, "sources": sources})
    return out


def _compare_product(
    module: dict, product: torch.Tensor | None, fmt: str, reader: _Stored
) -> str | None:
    if product is None:
        return f"{module['module']}: quantized, but vLLM's layer could not be applied"
    weights = []
    for source in module["sources"]:
        stem = source.rsplit(".", 1)[0]
        missing = [leaf for leaf in FORMATS[fmt].stored if f"{stem}.{leaf}" not in reader.names]
        if missing:
            return (
                f"{module['module']}: vLLM built it {module['scheme']}, but {stem} is stored "
                f"without {', '.join(missing)}"
            )
        stored = {leaf: reader.read(f"{stem}.{leaf}") for leaf in FORMATS[fmt].stored}
        weights.append(dequantize(fmt, stored).to(torch.bfloat16))
    expected = torch.cat(weights).t()
    if tuple(product.shape) != tuple(expected.shape):
        return (
            f"{module['module']}: vLLM's product has shape {list(product.shape)}, qstream's "
            f"dequantize {list(expected.shape)}"
        )
    # Compared by value: a product cannot carry the sign of a zero weight (eye · -0 sums to
    # +0), and that sign changes no product; every other bit must agree.
    differ = (product != expected).sum().item()
    if differ:
        return (
            f"{module['module']}: {differ} of {product.numel()} weights differ between vLLM's "
            f"loaded layer and qstream's dequantize of {', '.join(module['sources'])}"
        )
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def identity_products(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Module path -> ``apply(eye(K))`` = Wᵀ [K, N] in bf16 for every quantized Linear."""
    out = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "scheme", None)
        if scheme is None or not hasattr(module, "input_size_per_partition"):
            continue
        eye = torch.eye(module.input_size_per_partition, dtype=torch.bfloat16)
        out[name] = module.quant_method.apply(module, eye)
    return out
