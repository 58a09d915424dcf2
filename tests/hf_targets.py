"""Tiny real-architecture Hugging Face targets for the capture tests (built by
``examples/make_tiny_target.py``: Llama and DeepSeek-V3 from a config, random weights, fixed
seed, a BPE tokenizer; nothing downloaded) and a draft config.json shaped for them."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

from qstream.arch.dspark_mla.config import PRESETS

_EXAMPLE = Path(__file__).parent.parent / "examples" / "make_tiny_target.py"
_spec = importlib.util.spec_from_file_location("make_tiny_target", _EXAMPLE)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

VOCAB, HIDDEN, LAYERS = _module.VOCAB, _module.HIDDEN, _module.LAYERS
make_target = _module.make_target


def make_draft_config(directory: Path, layer_ids=(0, 2, 3), layers: int = LAYERS) -> Path:
    """A draft config.json shaped for the tiny targets (capture reads only the config)."""
    config = replace(
        PRESETS["tiny"],
        hidden_size=HIDDEN,
        target_hidden_size=HIDDEN,
        vocab_size=VOCAB,
        target_num_hidden_layers=layers,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=len(layer_ids),
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return directory
