"""Is a checkpoint directory still what ``qstream quantize`` wrote (docs/guarantees.md)?
``verify`` reports :func:`check_integrity`; ``eval-drift --variant`` and ``card --checkpoint``
refuse a checkpoint that fails it (:func:`integrity_record`) unless ``--no-integrity-check``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from qstream.checkpoint.files import Checkpoint, open_checkpoint, sha256_file
from qstream.errors import QStreamError
from qstream.publish import QUANTIZE_RECORD

NO_CHECK_FLAG = "--no-integrity-check"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHANGED, MISSING, ADDED, UNREADABLE = "changed", "missing", "added", "unreadable"


@dataclass(frozen=True)
class Mismatch:
    """One file that is not what quantize recorded."""

    name: str  # relative to the checkpoint directory
    kind: str  # CHANGED, MISSING, ADDED, or UNREADABLE (the record itself)
    detail: str = ""  # UNREADABLE: why
    actual: str = ""  # CHANGED: its sha256 now
    recorded: str = ""  # CHANGED: the sha256 quantize recorded

    def problem(self) -> str:
        if self.kind == CHANGED:
            return (
                f"{self.name}: sha256 {self.actual[:12]}... differs from "
                f"{self.recorded[:12]}... recorded by quantize (changed since)"
            )
        if self.kind == MISSING:
            return f"{self.name}: recorded by quantize but missing"
        if self.kind == ADDED:
            return f"{self.name}: a weight file quantize did not record (added since)"
        return f"{self.name}: unreadable record ({self.detail})"

    def error(self, directory: Path, what: str) -> str:
        """The one-line refusal of eval-drift and card, naming the file."""
        path = directory / self.name
        if self.kind == CHANGED:
            why = (
                f"sha256 {self.actual[:12]}... differs from {self.recorded[:12]}... recorded in "
                f"{QUANTIZE_RECORD} (changed since quantize wrote it)"
            )
        elif self.kind == MISSING:
            why = f"recorded in {QUANTIZE_RECORD} but missing"
        elif self.kind == ADDED:
            why = f"a weight file {QUANTIZE_RECORD} does not record (added since)"
        else:
            why = f"unreadable ({self.detail})"
        return f"{what}: {path}: {why}"


@dataclass(frozen=True)
class Integrity:
    files: int = 0  # recorded files whose sha256 was compared
    mismatches: tuple[Mismatch, ...] = ()
    skipped: str | None = None  # why nothing was compared

    def to_json(self) -> dict:
        """The record verify, eval-drift's results and the card keep."""
        if self.skipped is not None:
            return {"sha256": "not checked", "why": self.skipped}
        return {"sha256": "checked", "files": self.files}


def check_integrity(checkpoint: Checkpoint) -> Integrity:
    """Compare every file ``qstream_quantize.json`` records with its sha256 (each read once)."""
    path = checkpoint.directory / QUANTIZE_RECORD
    if not path.is_file():
        return Integrity(skipped=f"no {QUANTIZE_RECORD}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Integrity(mismatches=(Mismatch(QUANTIZE_RECORD, UNREADABLE, str(exc)),))
    if not isinstance(record, dict):
        return Integrity(mismatches=(Mismatch(QUANTIZE_RECORD, UNREADABLE, "not a JSON object"),))
    recorded = record.get("files")
    if recorded is None:
        return Integrity(skipped=f"{QUANTIZE_RECORD} records no sha256s (an older qstream)")
    malformed = _malformed(recorded)
    if malformed:
        return Integrity(mismatches=(Mismatch(QUANTIZE_RECORD, UNREADABLE, malformed),))
    mismatches = []
    for name, digest in recorded.items():
        file = checkpoint.directory / name
        if not file.is_file():
            mismatches.append(Mismatch(name, MISSING))
        elif (actual := sha256_file(file)) != digest:
            mismatches.append(Mismatch(name, CHANGED, actual=actual, recorded=digest))
    # a shard or index quantize did not write changes what loads; a README added does not
    mismatches += [Mismatch(n, ADDED) for n in sorted(checkpoint.weight_files - set(recorded))]
    return Integrity(len(recorded), tuple(mismatches))


def _malformed(recorded: object) -> str | None:
    """Why ``"files"`` is not a map of relative file name -> sha256, or None."""
    if not isinstance(recorded, dict):
        return '"files" is not a map of file name -> sha256'
    for name, digest in recorded.items():
        parts = PurePosixPath(name).parts
        if PurePosixPath(name).is_absolute() or ".." in parts or not parts:
            return f'"files" names {name!r}, outside the checkpoint directory'
        if not isinstance(digest, str) or not _SHA256.match(digest):
            return f'"files" gives {name!r} the sha256 {digest!r}, not 64 hex digits'
    return None


def integrity_record(directory: str | Path, what: str, check: bool = True) -> dict:
    """The record of the sha256 check of ``directory`` (``what``: how the user named it, e.g.
    ``--variant fp8``); QStreamError naming the first file that fails.  ``check`` False
    (``--no-integrity-check``): nothing is read."""
    if not check:
        return {"sha256": "not checked", "why": NO_CHECK_FLAG}
    integrity = check_integrity(open_checkpoint(directory))
    if integrity.mismatches:
        first, more = integrity.mismatches[0], len(integrity.mismatches) - 1
        also = f" (and {more} more file(s))" if more else ""
        raise QStreamError(
            f"{first.error(Path(directory), what)}{also}; pass {NO_CHECK_FLAG} to use it anyway"
        )
    return integrity.to_json()
