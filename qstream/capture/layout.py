"""What ``qstream capture`` writes (docs/capture.md, "What it writes"): one safetensors file per
stream, whole or not at all, in a :class:`Layout`, and ``capture.json``, the settings a resumed
run must match and every stream file's sha256, rewritten as each batch's files are written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

import qstream
from qstream.capture.target import LayerTap
from qstream.checkpoint.files import sha256_file
from qstream.checkpoint.safetensors_io import serialize
from qstream.errors import QStreamError
from qstream.eval.states.layouts import LAYOUTS, RECORD, Layout
from qstream.publish import write_bytes_atomic, write_json_atomic
from qstream.serving import DEFAULTS

# Settings a resumed run must share with the run that started the directory: everything that
# changes what a stream file holds.  The device, the draft's path and the stream count may
# differ (``--streams`` can grow a capture).
CHECKED = (
    "layout layer_convention layer_ids target source sampling dtype max_tokens corpus corpus_sha256"
).split()


def capture_record(
    layout: Layout,
    ids: tuple[int, ...],
    shape: Any,
    docs: Any,
    model: str,
    device: str,
    target_format: str = DEFAULTS["target"],
    **settings,
) -> dict[str, Any]:
    """capture.json's keys (docs/capture.md); ``settings``: source, sampling, dtype, max_tokens."""
    served = {} if target_format == DEFAULTS["target"] else {"format": target_format}
    return {
        "layout": layout.name,
        "layer_convention": layout.convention.name,
        "layer_ids": layout.layer_ids(ids, shape.num_hidden_layers),
        "target": {**shape.identity(), **served},
        **settings,
        "corpus": docs.name,
        "corpus_sha256": docs.sha256,
        "device": device,
        "draft": str(Path(model).resolve()),
        "qstream_version": qstream.__version__,
    }


def write_batch(
    output: Path,
    layout: Layout,
    streams: list[int],
    rows: list[list[int]],
    tap: LayerTap,
    metadata: list[dict[str, str]],
) -> None:
    """Stream ``streams[k]`` (token ids ``rows[k]``) from row k of the tapped batch."""
    assert layout.tensors is not None, f"capture does not export the {layout.name} layout"
    if layout.final_before_norm:
        aux, final = tap.layer_stack(), tap.pre_norm()  # [S, T, L, H], [S, T, H]
    else:
        aux, final = tap.aux(), tap.final()  # [S, T, L·H], [S, T, H]
    for k, (index, row) in enumerate(zip(streams, rows)):
        T = len(row)
        ids = torch.tensor(row, dtype=torch.int64)
        tensors = layout.tensors(ids, aux[k, :T], final[k, :T])
        for name, tensor in tensors.items():  # eval-drift refuses them: never write them
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise QStreamError(
                    f"stream {index}: the target's {name} are not finite (NaN or Inf); "
                    "try --dtype float32"
                )
        # whole or not at all (serialized here: a full disk is an OSError)
        write_bytes_atomic(output / layout.stream_file(index), serialize(tensors, metadata[k]))


def _comparable(key: str, value: Any) -> Any:
    # the target is the same target when its config.json is: its path may move
    if key == "target" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "path"}
    return value


def check_output(output: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """``output`` absent, empty, or a capture with the same settings: its record, or None."""
    path = output / RECORD
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise QStreamError(f"{path}: cannot read ({exc})") from None
        if not isinstance(old, dict):
            raise QStreamError(f"{path}: holds a JSON {type(old).__name__}, not a capture's record")
        if missing := [key for key in CHECKED if key not in old]:
            raise QStreamError(f"{path}: no {missing[0]!r}, a setting a resumed run must match")
        files = old.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise QStreamError(f"{path}: 'files' is not a map of file name -> sha256")
        for key in CHECKED:
            was, now = _comparable(key, old[key]), _comparable(key, record.get(key))
            if was != now:
                raise QStreamError(
                    f"--output {output} was captured with {key} = {json.dumps(was)}, this run "
                    f"has {json.dumps(now)}; use the same settings to resume, or another --output"
                )
        return old
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise QStreamError(
            f"--output {output} exists and holds no {RECORD}; refusing to write into it"
        )
    if not output.parent.is_dir():
        raise QStreamError(f"--output {output}: directory {output.parent} does not exist")
    return None


def start_output(output: Path, record: dict[str, Any]) -> None:
    try:
        output.mkdir(exist_ok=True)
    except OSError as exc:
        raise QStreamError(f"--output {output}: cannot create ({exc.strerror or exc})") from None
    write_json_atomic(output / RECORD, record)


def present_files(
    output: Path, old: dict[str, Any] | None, layout: Layout, expected: dict[str, dict[str, str]]
) -> dict[str, str]:
    """``{file name: sha256}`` of the stream files in ``output``: each has the sha256 the old
    record holds, or is one of this run's streams with the metadata it writes (``expected``)."""
    recorded = (old or {}).get("files", {})
    present = {}
    for path in sorted(output.iterdir(), key=lambda p: layout.stream_index(p.name)):
        if layout.stream_index(path.name) < 0 or not path.is_file():
            continue
        digest, want = sha256_file(path), recorded.get(path.name)
        if want is not None and digest != want:
            raise QStreamError(
                f"{path}: sha256 {digest[:12]}... differs from {want[:12]}... recorded in "
                f"{output / RECORD} (changed since); move it out to capture it again"
            )
        if want is None or path.name in expected:  # one of this run's, as it writes them
            meta = expected.get(path.name)
            if meta is None:
                raise QStreamError(
                    f"{path}: not in {RECORD} nor one of this run's streams; move it out"
                )
            try:
                with safe_open(str(path), framework="pt") as f:
                    found = f.metadata() or {}
            except Exception as exc:  # safetensors reports a bad header with its own types
                raise QStreamError(
                    f"{path}: not a readable safetensors file ({exc}); move it out"
                ) from None
            if any(found.get(k) != v for k, v in meta.items()):
                raise QStreamError(
                    f"{path}: its metadata says document {found.get('document')!r}, prompt_tokens "
                    f"{found.get('prompt_tokens')!r}, not this run's {meta}; move it out"
                )
        present[path.name] = digest
    return present


def record_streams(output: Path, record: dict[str, Any], names: list[str]) -> None:
    files = record.setdefault("files", {})
    for name in names:
        files[name] = sha256_file(output / name)
    layout = LAYOUTS[record["layout"]]
    record["files"] = dict(sorted(files.items(), key=lambda f: layout.stream_index(f[0])))
    record["streams"] = len(record["files"])
    write_json_atomic(output / RECORD, record)
