"""The draft architectures qstream knows (docs/model.md, "Architectures"): a config.json is
recognised by each descriptor in turn, and a config object leads back to its descriptor.

>>> arch = architecture_for(read_config("DRAFT_DIR"))   # recognised, else the default
>>> config = load_config("DRAFT_DIR")                    # QStreamError naming key and value
>>> architecture_of(config).build(config, weights, REFERENCE_VARIANT, "cpu")  # qstream.serving
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qstream.arch import family
from qstream.arch.dflash_qwen3 import ARCH as DFLASH_QWEN3
from qstream.arch.dspark_mla import ARCH as DSPARK_MLA
from qstream.arch.dspark_qwen3 import ARCH as DSPARK_QWEN3
from qstream.arch.eagle3 import ARCH as EAGLE3
from qstream.arch.interface import Architecture, DraftConfig
from qstream.errors import QStreamError

# The first is the default: a config.json that names no known architecture is read as its.
# DFlash and EAGLE-3 before the Qwen3-style DSpark, which reads every other speculators config.
ARCHITECTURES: list[Architecture] = [DSPARK_MLA, DFLASH_QWEN3, EAGLE3, DSPARK_QWEN3]
DEFAULT_ARCH: Architecture = DSPARK_MLA


def architecture_for(data: Mapping[str, Any]) -> Architecture:
    """The architecture a config.json's contents name (else the default, whose parser says why)."""
    return next((a for a in ARCHITECTURES if a.recognises(data)), DEFAULT_ARCH)


def architecture_of(config: DraftConfig) -> Architecture:
    """The architecture that parsed ``config``."""
    if arch := next((a for a in ARCHITECTURES if type(config) is a.config_type), None):
        return arch
    raise TypeError(f"no registered architecture parses {type(config).__name__}")


def load_config(directory: str | Path, evaluated: bool = True, captured: bool = False) -> Any:
    """config.json of a draft checkpoint -> its architecture's config (QStreamError naming the
    file, key and value; ``evaluated``: or saying why eval-drift and speculate cannot run it
    yet; ``captured``: why capture cannot)."""
    config = family.load_config(directory, lambda data: architecture_for(data).parse_config(data))
    arch = architecture_of(config)
    why = (arch.not_evaluated if evaluated else None) or (arch.not_captured if captured else None)
    if why is not None:
        raise QStreamError(f"{directory}: {why}")
    return config
