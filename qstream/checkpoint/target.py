"""What qstream needs to know of a Hugging Face target from its ``config.json`` alone (no
transformers, no weights): its width, depth, vocabulary and identity (docs/capture.md)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from qstream.errors import QStreamError

FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")
GGUF = ".gguf"  # llama.cpp's one-file format: qstream convert-gguf makes it a directory


def gguf_file(source: str | Path) -> Path | None:
    """The GGUF file a target path names: itself, or the one ``.gguf`` file of a folder without
    a config.json (None: a transformers directory)."""
    path = Path(source)
    if path.suffix == GGUF and not path.is_dir():
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob(f"*{GGUF}"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise QStreamError(f"{source}: holds {len(found)} {GGUF} files ({names}); name one")
    return found[0] if found else None


@dataclass(frozen=True)
class TargetShape:
    path: str  # the target directory as given
    model_type: str  # config.json's model_type ("llama", "deepseek_v3", ...)
    hidden_size: int  # H of the target's residual stream
    num_hidden_layers: int  # N decoder layers
    vocab_size: int  # rows of its embed_tokens / lm_head
    config_sha256: str  # of config.json's bytes: which target the states came from

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in ("path", "model_type", "config_sha256")}


def refuse_gguf(target: str | Path) -> None:
    """A GGUF target is converted once, not read on every run: the line says how."""
    if gguf_file(target) is not None:
        raise QStreamError(
            f"--target {target}: a GGUF target; convert it once with "
            f"qstream convert-gguf {target} --output_dir DIR, then pass DIR"
        )


def read_target_shape(target: str | Path) -> TargetShape:
    """The target's shape from ``target/config.json`` (a multimodal config's ``text_config``
    when the top level lacks the fields)."""
    path = Path(target) / "config.json"
    refuse_gguf(target)
    if not Path(target).is_dir():
        raise QStreamError(f"--target {target}: not a directory")
    try:
        raw = path.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise QStreamError(f"{path}: cannot read the target's config ({exc})") from None
    if not isinstance(config, dict):
        raise QStreamError(f"{path}: not a JSON object")
    section = config
    if not all(k in config for k in FIELDS) and isinstance(config.get("text_config"), dict):
        section = config["text_config"]
    values = {}
    for key in FIELDS:
        value = section.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise QStreamError(f"{path}: {key} = {value!r}, expected a positive integer")
        values[key] = value
    return TargetShape(
        str(target),
        str(config.get("model_type", "")),
        config_sha256=hashlib.sha256(raw).hexdigest(),
        **values,
    )
