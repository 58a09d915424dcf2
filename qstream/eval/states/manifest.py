"""A capture directory checked against its ``capture.json`` before any block runs
(docs/capture.md, docs/guarantees.md): ``qstream capture`` records the sha256 of every stream
file it writes (``files``) and their count (``streams``).  A recorded file that is missing, a
stream file the record lacks, or a file whose sha256 differs is one line naming the file.  A
capture written before sha256s were recorded is checked by its count and file names; a
``capture.json`` that records neither (written by hand) is not checked, and the results say so.
"""

from __future__ import annotations

import re
from pathlib import Path

from qstream.errors import QStreamError

# The names in a capture directory, written by ``qstream capture`` (qstream/capture/layout.py)
# and read here: the record, and each layout's stream files (the index as group 1).
RECORD = "capture.json"
STREAM_NAMES = {
    "qstream": re.compile(r"^stream-(\d{6,})\.safetensors$"),
    "vllm": re.compile(r"^hs_(\d+)\.safetensors$"),
}


def stream_file(index: int, export: str) -> str:
    """The name of stream ``index``'s file in the ``export`` layout (``STREAM_NAMES``)."""
    return f"hs_{index}.safetensors" if export == "vllm" else f"stream-{index:06d}.safetensors"


RESUME = "resume the capture (qstream capture, same settings)"


def check_manifest(root: Path, manifest: dict, digests: dict[str, str]) -> dict:
    """Check the states files of ``root`` (``digests``: relative name -> sha256) against
    ``manifest``; returns what was checked, as the results record it."""
    where = root / RECORD
    recorded = manifest.get("files")
    if recorded is not None:
        if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
            raise QStreamError(f"{where}: 'files' is not a map of file name -> sha256")
        _same_names(root, list(recorded), digests, f"{len(recorded)} streams")
        for name, digest in recorded.items():
            if digests[name] != digest:
                raise QStreamError(
                    f"{root / name}: sha256 {digests[name][:12]}... differs from "
                    f"{digest[:12]}... recorded in {where} (changed since capture wrote it)"
                )
        return {"streams": len(recorded), "sha256": "checked"}
    count, layout = manifest.get("streams"), manifest.get("layout")
    if count is None:
        return {"streams": "not recorded", "sha256": "not recorded"}
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise QStreamError(f"{where}: 'streams' is {count!r}, not a count of stream files")
    if layout in ("qstream", "vllm"):
        names = [stream_file(i, layout) for i in range(count)]
        _same_names(root, names, digests, f"{count} streams")
    elif len(digests) != count:
        raise QStreamError(
            f"--states {root}: holds {len(digests)} states files, but {where} records "
            f"{count} streams"
        )
    return {"streams": count, "sha256": "not recorded"}


def _same_names(root: Path, recorded: list[str], digests: dict[str, str], what: str) -> None:
    """Every recorded file is there, and every states file there is recorded."""
    where = root / RECORD
    missing = [name for name in recorded if name not in digests]
    if missing:
        raise QStreamError(
            f"{root / missing[0]}: missing, but {where} records it (one of {what}); {RESUME} "
            "to write it again"
        )
    unrecorded = sorted(set(digests) - set(recorded))
    if unrecorded:
        raise QStreamError(
            f"{root / unrecorded[0]}: a states file {where} does not record ({what}); {RESUME} "
            "to record it, or move it out"
        )
