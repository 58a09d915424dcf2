"""A variant is a serving configuration (docs/eval-drift.md, "What is compared"): the weights a
draft serves and how its activations, KV cache and target are served.  Each field's values are
registered here, the one place their names are spelled; code asks the object
(``variant.simulated``).  No torch at import: ``--help`` reads the names.

>>> Variant.of_format("nvfp4").simulated, Variant.of_format("bf16").compute_dtype
(True, 'bfloat16')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qstream.errors import QStreamError

if TYPE_CHECKING:
    import torch

# "fp32" is the reference itself (a self-check that must report exact agreement); "bf16" is the
# numerical floor every format is compared with (docs/eval-drift.md).
REFERENCE, FLOOR = "fp32", "bf16"


@dataclass(frozen=True)
class WeightsKind:
    """Where a variant's weights come from; ``name`` is the results' ``kind``."""

    name: str
    compute_dtype: str = "bfloat16"  # torch's name; the reference alone computes in fp32
    making: str | None = None  # the progress word while its weights are made, if it takes long


# The values of each field; the first of ACTIVATIONS, KV_CACHES and TARGETS is today's only one:
# activations unquantized, computed in the compute dtype; the KV cache in the compute dtype, as
# vLLM's ``--kv-cache-dtype auto``; the target served unquantized.
WEIGHTS = {
    k.name: k
    for k in (
        WeightsKind(REFERENCE, "float32"),
        WeightsKind(FLOOR),
        WeightsKind("simulated", making="simulating"),
        WeightsKind("checkpoint", making="loading"),
    )
}
ACTIVATIONS = ("none",)
KV_CACHES = ("auto",)
TARGETS = ("unquantized",)


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
    activations: str = ACTIVATIONS[0]
    kv_cache: str = KV_CACHES[0]
    target: str = TARGETS[0]

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("kind", self.kind, tuple(WEIGHTS)),
            ("activations", self.activations, ACTIVATIONS),
            ("kv_cache", self.kv_cache, KV_CACHES),
            ("target", self.target, TARGETS),
        ):
            if value not in allowed:
                raise QStreamError(
                    f"variant {self.name}: {field} {value!r}: choose one of {', '.join(allowed)}"
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

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype as torch's: fp32 for the reference, bf16 for every other variant."""
        import torch

        return getattr(torch, self.compute_dtype)

    def checks(self) -> dict:
        """What the results record of the checks of a checkpoint variant."""
        return {
            **({"foreign": True} if self.foreign else {}),
            **({"integrity": dict(self.integrity)} if self.integrity else {}),
        }


REFERENCE_VARIANT = Variant.of_format(REFERENCE)  # what the reference pass builds
FLOOR_VARIANT = Variant.of_format(FLOOR)
