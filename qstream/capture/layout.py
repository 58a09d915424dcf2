"""What ``qstream capture`` writes (docs/capture.md, "What it writes"): one safetensors file
per stream, each written whole or not at all, in qstream's layout (``stream-000000.safetensors``
…, docs/states.md) or vLLM's / speculators' (``--export vllm``, ``hs_0.safetensors`` …); and
``capture.json``, the settings a resumed run must match and the sha256 of every stream file,
rewritten as each batch's files are written (read back by qstream/eval/states/manifest.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qstream.capture.hooks import LayerTap
from qstream.checkpoint.files import sha256_file
from qstream.errors import QStreamError
from qstream.eval.states.manifest import RECORD, STREAM_NAMES, stream_file
from qstream.publish import write_atomic, write_text_atomic

EXPORTS = ("qstream", "vllm")
# Settings a resumed run must share with the run that started the directory: everything that
# changes what a stream file holds.  The device, the draft's path and the stream count may
# differ (``--streams`` can grow a capture).
CHECKED = (
    "layout layer_convention layer_ids target source sampling dtype max_tokens corpus corpus_sha256"
).split()


def _stream_tensors(
    ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor
) -> dict[str, torch.Tensor]:
    """qstream's single-stream layout (docs/states.md)."""
    return {
        "input_ids": ids.to(torch.int64).contiguous(),
        "aux_hidden_states": aux.contiguous(),  # [T, L·H]
        "target_hidden_states": final.contiguous(),  # [T, H] after the final norm
    }


def _vllm_tensors(
    ids: torch.Tensor, layers: torch.Tensor, pre_norm: torch.Tensor
) -> dict[str, torch.Tensor]:
    """vLLM's / speculators' layout: ``hidden_states`` [T, L+1, H] = the aux layers, then the
    last layer's output before the final norm."""
    return {
        "hidden_states": torch.cat((layers, pre_norm[:, None]), dim=1).contiguous(),
        "token_ids": ids.to(torch.int64).contiguous(),
    }


def write_batch(
    output: Path,
    export: str,
    streams: list[int],
    rows: list[list[int]],
    tap: LayerTap,
    metadata: list[dict[str, str]],
) -> None:
    """Write stream ``streams[k]`` (token ids ``rows[k]``) from row k of the tapped batch, cut
    to the row's length (the right padding's states discarded)."""
    if export == "vllm":
        layers, pre_norm = tap.layer_stack(), tap.pre_norm()  # [S, T, L, H], [S, T, H]
    else:
        aux, final = tap.aux(), tap.final()  # [S, T, L·H], [S, T, H]
    for k, (index, row) in enumerate(zip(streams, rows)):
        T = len(row)
        ids = torch.tensor(row, dtype=torch.int64)
        if export == "vllm":
            tensors = _vllm_tensors(ids, layers[k, :T], pre_norm[k, :T])
        else:
            tensors = _stream_tensors(ids, aux[k, :T], final[k, :T])
        _write_stream(output / stream_file(index, export), tensors, metadata[k])


def _write_stream(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """One stream's file, whole or not at all."""
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def write_record(output: Path, record: dict[str, Any]) -> None:
    """``capture.json``, replaced in one rename."""
    write_text_atomic(output / RECORD, json.dumps(record, indent=2) + "\n")


def _comparable(key: str, value: Any) -> Any:
    # the target is the same target when its config.json is: its path may move
    if key == "target" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "path"}
    return value


def check_output(output: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """Before any work: ``output`` must be absent, empty, or a capture with the same settings
    (resume; one line naming the first setting that differs).  The capture's record, or None
    when there is none yet."""
    path = output / RECORD
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise QStreamError(f"{path}: cannot read ({exc})") from None
        for key in CHECKED:
            was, now = _comparable(key, old.get(key)), _comparable(key, record.get(key))
            if was != now:
                raise QStreamError(
                    f"--output {output} was captured with {key} = {json.dumps(was)}, this run "
                    f"has {json.dumps(now)}; use the same settings to resume, or another --output"
                )
        return old if isinstance(old, dict) else {}
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise QStreamError(
            f"--output {output} exists and holds no {RECORD}; refusing to write into it"
        )
    if not output.parent.is_dir():
        raise QStreamError(f"--output {output}: directory {output.parent} does not exist")
    return None


def start_output(output: Path, record: dict[str, Any]) -> None:
    """Create ``output`` with its ``capture.json`` (once the target has loaded)."""
    try:
        output.mkdir(exist_ok=True)
    except OSError as exc:
        raise QStreamError(f"--output {output}: cannot create ({exc.strerror or exc})") from None
    write_record(output, record)


def present_files(output: Path, old: dict[str, Any] | None, export: str) -> dict[str, str]:
    """``{file name: sha256}`` of the stream files already in ``output``: the digests the old
    record holds, and those of files it lacks computed now (a capture from before qstream
    recorded them, or a file written whole just before a run was killed)."""
    recorded = (old or {}).get("files")
    recorded = recorded if isinstance(recorded, dict) else {}
    present = {}
    for path in sorted(output.iterdir(), key=lambda p: _index(p.name, export)):
        if _index(path.name, export) >= 0 and path.is_file():
            digest = recorded.get(path.name)
            present[path.name] = digest if isinstance(digest, str) else sha256_file(path)
    return present


def _index(name: str, export: str) -> int:
    """The stream index a file name of ``export``'s layout gives, or -1 for another file."""
    match = STREAM_NAMES[export].match(name)
    return int(match.group(1)) if match else -1


def record_streams(output: Path, record: dict[str, Any], names: list[str]) -> None:
    """Add the sha256 of the stream files ``names`` just written to ``record`` (``files``, and
    ``streams`` their count) and replace ``capture.json``."""
    files = record.setdefault("files", {})
    for name in names:
        files[name] = sha256_file(output / name)
    record["files"] = dict(sorted(files.items(), key=lambda f: _index(f[0], record["layout"])))
    record["streams"] = len(record["files"])
    write_record(output, record)
