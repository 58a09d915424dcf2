"""The variants an evaluation compares with the FP32 reference (each a serving configuration,
qstream/serving.py): the settings' variants, each one's weights, and the weight SNR of the
tensors its format changed (docs/eval-drift.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qstream.arch.interface import LM_HEAD, DraftConfig
from qstream.arch.registry import architecture_of
from qstream.checkpoint.integrity import integrity_record
from qstream.checkpoint.safetensors_io import drop_resident_pages
from qstream.eval.settings import Selection
from qstream.formats import snr_db, snr_sums
from qstream.quant.simulate import simulate_format
from qstream.serving import Variant

Weights = Mapping[str, torch.Tensor]


def settings_variants(settings: Selection) -> tuple[Variant, ...]:
    """The simulated formats, then the checkpoint directories, in the order the user gave;
    each directory checked against the sha256s quantize recorded, unless the settings say not
    to (one line naming the first file that fails)."""
    simulated = [Variant.of_format(f) for f in settings.formats]
    checkpoints = []
    for name, path in settings.variant_dirs:
        record = integrity_record(path, f"--variant {name}", not settings.no_integrity_check)
        checkpoints.append(Variant.of_checkpoint(name, path, tuple(record.items())))
    return (*simulated, *checkpoints)


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
    changed = [k for k, v in weights.items() if k != LM_HEAD and _differs(v, reference_weights[k])]
    return weights, changed


def _differs(tensor: torch.Tensor, reference: torch.Tensor) -> bool:
    """A variant's tensor differs from the reference's; a shared tensor is never read (at K3
    scale reading the 1.2 B-parameter embedding table would map it all into memory)."""
    if tensor is reference:
        return False
    return not torch.equal(tensor.to(reference.dtype), reference)


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
