"""The built-in default of ``qstream eval-drift``: a synthetic tiny draft, built once into a
cache directory, and the GSM8K test split shipped inside the package (1,319 problems, MIT
licence in ``qstream/data/GSM8K_LICENSE``), so that a new user sees a full report with no files
of their own and nothing downloaded."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import qstream
from qstream.arch.registry import DEFAULT_ARCH
from qstream.errors import QStreamError
from qstream.synth.draft import RECIPE, synth_checkpoint

BUILTIN_PRESET, BUILTIN_SEED = "tiny", 0
# GSM8K test split (github.com/openai/grade-school-math, MIT): question + newline + answer per
# document, as read_corpus reads a GSM8K JSONL file.  The draft never saw it (synth trains on
# generated problems).
BUILTIN_CORPUS = Path(__file__).resolve().parents[1] / "data" / "gsm8k_test.jsonl.gz"
BUILTIN_CORPUS_NAME = "built-in: GSM8K test split"


def cache_root() -> Path:
    """``$QSTREAM_CACHE``, else ``$XDG_CACHE_HOME/qstream``, else ``~/.cache/qstream``."""
    if os.environ.get("QSTREAM_CACHE"):
        return Path(os.environ["QSTREAM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qstream"


def builtin_model_dir(say: Callable[[str], None] | None = None) -> Path:
    """The built-in draft's directory, synthesized (deterministically) on first use; ``say``
    tells the user when it is being built."""
    # the preset's own hash and synth's recipe in the name: a changed preset or synth is
    # rebuilt rather than read from a cache built before the change
    preset = json.dumps(DEFAULT_ARCH.presets[BUILTIN_PRESET].to_json(), sort_keys=True).encode()
    tag = hashlib.sha256(preset).hexdigest()[:8]
    directory = (
        cache_root()
        / f"dspark-{BUILTIN_PRESET}-seed{BUILTIN_SEED}-v{qstream.__version__}-r{RECIPE}-{tag}"
    )
    if not (directory / "config.json").is_file():
        if say is not None:
            say(f"Building the built-in synthetic draft into {directory} (first use) ...")
        synth_checkpoint(BUILTIN_PRESET, directory, seed=BUILTIN_SEED, overwrite=True)
    return directory


def builtin_corpus_docs() -> list[str]:
    """The GSM8K test split shipped with the package, one document per problem."""
    try:
        with gzip.open(BUILTIN_CORPUS, "rt", encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise QStreamError(
            f"cannot read the built-in corpus {BUILTIN_CORPUS}: {exc} "
            "(reinstall qstream, or pass --corpus)"
        ) from exc
    return [f"{row['question']}\n{row['answer']}" for row in rows]
