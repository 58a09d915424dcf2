"""A variant is a serving configuration (docs/eval-drift.md, "What is compared"): the weights a
draft serves and how its activations, KV cache and target are served.  Each field's values are
registered here, the one place their names are spelled; code asks the object
(``variant.simulated``, ``variant.kv.quantized``).  No torch at import: ``--help`` reads the names.
A user names a configuration in one token: the weights, then ``+field=value`` for each field
that is not the default, ``nvfp4+a=nvfp4+kv=fp8_e4m3`` (docs/eval-drift.md, "Serving
configurations")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from qstream.errors import QStreamError

if TYPE_CHECKING:
    import torch

# "fp32" is the reference itself (a self-check that must report exact agreement); "bf16" is the
# numerical floor every format is compared with (docs/eval-drift.md).
REFERENCE, FLOOR = "fp32", "bf16"
WEIGHT_FORMATS = ("fp8", "mxfp4", "nvfp4")  # qstream.formats.FORMATS (tests/test_help.py)


@dataclass(frozen=True)
class WeightsKind:
    """Where a variant's weights come from; ``name`` is the results' ``kind``."""

    name: str
    compute_dtype: str = "bfloat16"  # torch's name; the reference alone computes in fp32
    making: str | None = None  # the progress word while its weights are made, if it takes long


WEIGHTS = {
    k.name: k
    for k in (
        WeightsKind(REFERENCE, "float32"),
        WeightsKind(FLOOR),
        WeightsKind("simulated", making="simulating"),
        WeightsKind("checkpoint", making="loading"),
    )
}


@dataclass(frozen=True)
class Activations:
    """How a quantized linear's input is served: compressed-tensors' ``input_activations``
    (DESIGN section 8) and the scheme vLLM 0.32.0 builds for it
    (``compressed_tensors.py``, ``_get_scheme_from_parts``)."""

    name: str
    weights: tuple[str, ...]  # the weight formats it is served with; () for any
    dynamic: bool  # scales from each input at run time; else calibrated ahead
    strategy: str | None  # compressed-tensors' strategy: "token", "tensor", "tensor_group"
    vllm_scheme: str | None  # None: the weights' own weight-only scheme


ACTIVATIONS = {
    a.name: a
    for a in (
        Activations("none", (), True, None, None),
        Activations("fp8-dynamic", ("fp8",), True, "token", "CompressedTensorsW8A8Fp8"),
        Activations("fp8-static", ("fp8",), False, "tensor", "CompressedTensorsW8A8Fp8"),
        # per-16 block scales from each input, over a calibrated global scale
        Activations("nvfp4", ("nvfp4",), False, "tensor_group", "CompressedTensorsW4A4Fp4"),
    )
}


@dataclass(frozen=True)
class KVCache:
    """A ``--kv-cache-dtype`` of vLLM 0.32.0 (``vllm/config/cache.py``, ``CacheDType``) the
    draft's attention stores its KV in; ``dtype`` is torch's name, None for the compute dtype."""

    name: str
    dtype: str | None

    @property
    def quantized(self) -> bool:
        return self.dtype is not None and self.dtype.startswith("float8")

    @property
    def scaled(self) -> bool:
        """Whether vLLM 0.32.0 serves it with a scale other than 1.0: an e4m3 cache.  A scale
        reaches vLLM only in a checkpoint declaring a kv_cache_scheme (compressed-tensors' FP8,
        e4m3: ``amax / 448``), and vLLM refuses ``fp8_e5m2`` with such a checkpoint
        (vllm/model_executor/layers/attention/attention.py, ``_init_kv_cache_quant``)."""
        return self.dtype == "float8_e4m3fn"


KV_CACHES = {
    k.name: k
    for k in (
        KVCache("auto", None),
        KVCache("bfloat16", "bfloat16"),
        KVCache("fp8", "float8_e4m3fn"),  # vLLM's "fp8" is e4m3 on CUDA
        KVCache("fp8_e4m3", "float8_e4m3fn"),
        KVCache("fp8_e5m2", "float8_e5m2"),
    )
}
E5M2_UNSCALED = (
    ": vLLM 0.32.0 refuses fp8_e5m2 with a checkpoint that declares a kv_cache_scheme, the only "
    "way a scale reaches it (attention.py, _init_kv_cache_quant), and serves e5m2 at scale 1.0"
)
# An fp8 cache's per-layer scale: 1.0 (what vLLM serves when the checkpoint has none, with a
# warning), calibrated on the run's calibration inputs, or the checkpoint's own.
KV_SCALES = ("1.0", "calibrated", "checkpoint")
# The target the draft serves beside: unquantized, or its linears' weights in a format.
TARGETS = ("unquantized", *WEIGHT_FORMATS)
# The drafting head (lm_head): as stored, or a copy quantized at load as vLLM 0.33.0's
# speculative_config.draft_lm_head_quantization makes it (qstream/formats/head.py, HEADS).
HEADS = ("stored", "fp8", "nvfp4")

# A token's fields after the weights: key -> (Variant field, its values).
TOKEN_FIELDS = {
    "a": ("activations", tuple(ACTIVATIONS)),
    "kv": ("kv_cache", tuple(KV_CACHES)),
    "kvscale": ("kv_scale", KV_SCALES),
    "target": ("target", TARGETS),
    "head": ("head", HEADS),
}
TOKEN_WEIGHTS = (REFERENCE, FLOOR, *WEIGHT_FORMATS)


@dataclass(frozen=True)
class Variant:
    """One serving configuration; an unknown value is a QStreamError naming field and value."""

    name: str
    kind: str  # WEIGHTS
    source: str  # the format, or the checkpoint directory
    include: tuple[str, ...] | None = None  # simulated: own patterns (sensitivity steps);
    # None: the settings' include list
    foreign: bool = False  # checkpoint not derived from the model (--allow-foreign-variant)
    # checkpoint: its sha256 check, as qstream/checkpoint/integrity.py records it
    integrity: tuple[tuple[str, object], ...] = ()
    activations: str = "none"
    kv_cache: str = "auto"
    kv_scale: str = "1.0"
    target: str = "unquantized"
    head: str = "stored"

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("kind", self.kind, tuple(WEIGHTS)),
            *((f, getattr(self, f), values) for f, values in TOKEN_FIELDS.values()),
        ):
            if value not in allowed:
                raise QStreamError(
                    f"variant {self.name}: {field} {value!r}: choose one of {', '.join(allowed)}"
                )
        if self.reference and self.configuration() != DEFAULTS:
            raise QStreamError(f"variant {self.name}: the fp32 reference is served as stored")
        act = self.activation
        if act.weights and (self.checkpoint or self.source not in act.weights):
            raise QStreamError(
                f"variant {self.name}: activations {act.name!r} are served with "
                f"{' or '.join(act.weights)} weights, not {self.source!r}"
                + (" (a checkpoint's come from its config.json)" if self.checkpoint else "")
            )
        if self.kv_scale != "1.0" and not self.kv.scaled:
            raise QStreamError(
                f"variant {self.name}: kvscale {self.kv_scale!r} needs an fp8 e4m3 KV cache "
                f"(kv=fp8 or fp8_e4m3), not kv={self.kv_cache}"
                + (E5M2_UNSCALED if self.kv.quantized else "")
            )
        if self.kv_scale == "checkpoint" and not self.checkpoint:
            raise QStreamError(f"variant {self.name}: kvscale 'checkpoint' needs a checkpoint")

    @classmethod
    def parse(cls, token: str, kv_cache: str | None = None) -> Variant:
        """The configuration ``token`` names (``WEIGHTS[+KEY=VALUE...]``, keys TOKEN_FIELDS);
        ``kv_cache`` (``--kv-cache-dtype``) is every variant's KV cache but the reference's,
        unless the token names one.  Named by its canonical token."""
        weights, *parts = token.split("+")
        if weights not in TOKEN_WEIGHTS:
            raise QStreamError(
                f"variant {token!r}: unknown weights {weights!r}; "
                f"choose one of {', '.join(TOKEN_WEIGHTS)}"
            )
        fields: dict[str, Any] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or key not in TOKEN_FIELDS:
                raise QStreamError(
                    f"variant {token!r}: {part!r} is not KEY=VALUE with KEY one of "
                    f"{', '.join(TOKEN_FIELDS)}"
                )
            field = TOKEN_FIELDS[key][0]
            if field in fields:
                raise QStreamError(f"variant {token!r}: {key} given twice")
            fields[field] = value
        if kv_cache is not None and weights != REFERENCE:
            fields.setdefault("kv_cache", kv_cache)
        variant = cls.of_format(weights, name=token)
        probe = replace(variant, **fields)  # validates, naming the token as given
        return replace(probe, name=probe.token(weights))

    def token(self, weights: str) -> str:
        """The canonical token: ``weights`` and each field that differs from its default."""
        served = self.configuration()
        return weights + "".join(
            f"+{key}={served[f]}"
            for key, (f, _) in TOKEN_FIELDS.items()
            if served[f] != DEFAULTS[f]
        )

    @classmethod
    def of_format(
        cls, fmt: str, name: str | None = None, include: tuple[str, ...] | None = None
    ) -> Variant:
        """The reference, the floor, or ``fmt`` simulated (``include``: its own patterns)."""
        kind = fmt if fmt in (REFERENCE, FLOOR) else "simulated"
        return cls(name or fmt, kind, fmt, include)

    @classmethod
    def of_checkpoint(cls, name: str, directory: str, integrity: tuple = ()) -> Variant:
        """A quantized checkpoint directory, with the sha256 check it passed."""
        return cls(name, "checkpoint", directory, integrity=integrity)

    weights = property(lambda self: WEIGHTS[self.kind])
    reference = property(lambda self: self.kind == REFERENCE)  # the FP32 reference itself
    stored = property(lambda self: self.kind in (REFERENCE, FLOOR))  # the weights as stored
    simulated = property(lambda self: self.kind == "simulated")  # a format, simulated
    checkpoint = property(lambda self: self.kind == "checkpoint")  # read from ``source``
    compute_dtype = property(lambda self: self.weights.compute_dtype)
    activation = property(lambda self: ACTIVATIONS[self.activations])
    kv = property(lambda self: KV_CACHES[self.kv_cache])

    @property
    def calibrated(self) -> bool:
        """Whether serving it needs a calibration run: static activation scales or KV scales."""
        return not self.activation.dynamic or self.kv_scale == "calibrated"

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype as torch's: fp32 for the reference, bf16 for every other variant."""
        import torch

        return getattr(torch, self.compute_dtype)

    def configuration(self) -> dict:
        """What the variant serves, field by field (the results record it whole)."""
        return {f: getattr(self, f) for f, _ in TOKEN_FIELDS.values()}

    def served(self) -> dict:
        """What the results record of how the variant is served: nothing for the default."""
        served = self.configuration()
        return {"configuration": served} if served != DEFAULTS else {}

    def checks(self) -> dict:
        """What the results record of the checks of a checkpoint variant."""
        return {
            **({"foreign": True} if self.foreign else {}),
            **({"integrity": dict(self.integrity)} if self.integrity else {}),
        }


DEFAULTS: dict[str, Any] = {
    f: Variant.__dataclass_fields__[f].default for f, _ in TOKEN_FIELDS.values()
}
REFERENCE_VARIANT = Variant.of_format(REFERENCE)  # what the reference pass builds
FLOOR_VARIANT = Variant.of_format(FLOOR)
