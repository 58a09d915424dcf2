"""One ``.gguf`` file made a transformers directory once (``qstream convert-gguf``;
docs/capture.md, "A GGUF target").  ``save_pretrained`` refuses a model transformers read from
GGUF, so its tensors are saved from a fresh model of the same class and config.
"""

from __future__ import annotations

from pathlib import Path

import torch

import qstream
from qstream.capture.target import _first_line, _quiet, check_finite
from qstream.checkpoint.target import GGUF, gguf_file
from qstream.errors import QStreamError
from qstream.publish import CONVERT_RECORD, check_target, publishing, write_json_atomic


def convert_gguf(source: str | Path, output_dir: str | Path, overwrite: bool = False) -> Path:
    """``source``'s model and tokenizer as a float32 transformers directory with CONVERT_RECORD,
    complete or not at all."""
    file = gguf_file(source)
    if file is None:
        raise QStreamError(f"{source}: neither a {GGUF} file nor a folder holding one")
    output = Path(output_dir).resolve()
    check_target(output, overwrite, "--output_dir")
    try:
        import gguf
    except ImportError:
        raise QStreamError(
            f"{file}: reading a GGUF file needs the gguf package: pip install 'qstream[gguf]'"
        ) from None
    try:
        gguf.GGUFReader(file)
    except (OSError, ValueError, KeyError, IndexError, NotImplementedError) as exc:
        raise QStreamError(f"{file}: not a readable GGUF file ({_first_line(exc)})") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": str(file.parent), "gguf_file": file.name}
    try:
        with _quiet():
            tokenizer = AutoTokenizer.from_pretrained(**where)
            loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as exc:
        raise QStreamError(f"{file}: transformers cannot load it ({_first_line(exc)})") from None
    check_finite(loaded.named_parameters(), f"{file}: tensor")
    config = loaded.config
    config.__dict__.pop("quantization_config", None)  # the saved tensors are plain float32
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    output.parent.mkdir(parents=True, exist_ok=True)
    with publishing(output, overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"qstream_version": qstream.__version__, "source": file.name}
        write_json_atomic(tmp / CONVERT_RECORD, {**record, "bytes": file.stat().st_size})
    return output
