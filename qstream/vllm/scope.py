"""What one ``qstream verify`` run covered: each check, whether it ran, and what it found or why
it did not run (docs/guarantees.md).  verify prints the checks that did not run, and its
``--json`` holds them all, so that "OK" never hides a check that was skipped.

>>> checks_run("fp8", profile, 12, deep=False, integrity=Integrity(skipped="no ..."))
{"config": {"ran": True, "detail": ...}, ..., "sha256": {"ran": False, "detail": "no ..."}}
"""

from __future__ import annotations

from qstream.checkpoint.integrity import Integrity
from qstream.formats import get_format
from qstream.publish import QUANTIZE_RECORD
from qstream.vllm.profiles import Profile

CHECKS = ("config", "tensors", "vllm_rules", "fused_groups", "sha256", "scales", "round_trip")
VLLM_LOADER = "vllm_loader"  # run by ``verify --vllm`` (qstream/commands/verify.py)


def _check(ran: bool, detail: str) -> dict:
    return {"ran": ran, "detail": detail}


def _sha256_check(integrity: Integrity) -> dict:
    if integrity.skipped is not None:
        return _check(
            False,
            f"{integrity.skipped}: byte-level integrity not checked; a changed weight byte "
            "that still decodes to a finite value is not detected",
        )
    differ = len(integrity.mismatches)
    found = f"{differ} differ from" if differ else "match"
    return _check(True, f"{integrity.files} files {found} {QUANTIZE_RECORD}")


def checks_run(
    fmt: str | None,
    profile: Profile,
    runtime_layers: int,
    deep: bool,
    integrity: Integrity | None,
) -> dict[str, dict]:
    """Every check of :func:`qstream.vllm.verify.verify_checkpoint`, in order, plus vLLM's
    own loader (not run unless ``--vllm``).  ``fmt`` None: the config names no format qstream
    checks, and nothing after the config was reached."""
    if fmt is None or integrity is None:
        skipped = _check(False, "not reached: quantization_config names no format qstream checks")
        checks = {name: skipped for name in CHECKS}
        return {**checks, "config": _check(True, "quantization_config"), VLLM_LOADER: skipped}
    if profile.renames_layers:
        rules = f"vLLM's decision replayed for {runtime_layers} runtime Linear layers"
    else:
        rules = "each weight-holding module quantized or ignored (no serving profile to replay)"
    return {
        "config": _check(True, f"one config group, {fmt} weight arguments, weight-only"),
        "tensors": _check(True, "stored dtypes and shapes of every quantized module, the index"),
        "vllm_rules": _check(True, rules),
        "fused_groups": _check(True, "all members or none quantized; NVFP4: one global scale"),
        "sha256": _sha256_check(integrity),
        "scales": _check(True, get_format(fmt).scales_checked),
        "round_trip": _check(True, "every quantized weight dequantized to finite values")
        if deep
        else _check(False, "--deep not given"),
        VLLM_LOADER: _check(False, "--vllm not given"),
    }
