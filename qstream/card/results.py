"""Read eval-drift results files and merge them into one results set.

A card is usually built from several files: ``evals/eval_dspark_quant.py`` writes one JSON per
regime, ``qstream eval-drift --regime all`` one with every regime.  Merging keeps each regime's
numbers exactly as measured and refuses what cannot be merged honestly: results of different
models (``model.config_sha256`` differs), or the same regime and variant measured twice with
different numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qstream.card.validate import check_numbers
from qstream.checkpoint.files import read_json
from qstream.errors import QStreamError
from qstream.eval.vocabulary import SCHEMA
from qstream.regimes import REGIMES

# Top-level fields describing how a file's regimes were evaluated (reported per regime when the
# merged files disagree).
RUN_FIELDS = (
    "qstream_version",
    "torch_version",
    "model",
    "target",
    "corpus",
    "seed",
    "blocks",
    "block_size",
    "anchors",
    "sampling",
    "reference",
    "variant_compute",
    "aux_dtype",
    "selection",
)
# Per-regime sections besides the variants, carried as measured (docs/eval-drift.md).
REGIME_SECTIONS = ("sensitivity", "context_sweep")


@dataclass
class ResultsSet:
    """Regimes from one or more files of the same model, each with the run that produced it."""

    model: dict  # the results' "model" block (of the first file)
    regimes: dict[str, dict] = field(default_factory=dict)  # regime -> {variant: result}
    runs: dict[str, dict] = field(default_factory=dict)  # regime -> RUN_FIELDS of its file
    variants: dict[str, dict] = field(default_factory=dict)  # variant -> {"kind", "source"}
    sources: dict[str, list[str]] = field(default_factory=dict)  # regime -> files it came from
    sections: dict[str, dict] = field(default_factory=dict)  # regime -> {REGIME_SECTIONS key: data}
    computed: dict[str, dict] = field(default_factory=dict)  # regime -> {file: its "compute"}
    # (file, dotted key) last read from the results, to name a missing or null key
    trail: list = field(default_factory=lambda: [None, None], repr=False, compare=False)

    @property
    def block_size(self) -> int:
        sizes = {run["block_size"] for run in self.runs.values()}
        if len(sizes) != 1:
            raise QStreamError(f"results disagree on block_size: {sorted(sizes)}")
        return sizes.pop()


def read_results(path: str | Path, trail: list | None = None) -> dict:
    """A results file, checked (:func:`check_results`, and every number publishable:
    :func:`qstream.card.validate.check_numbers`); with ``trail``, its objects record every key
    read into it, so that a missing or null key is reported by name."""
    path = Path(path)
    data = check_results(read_json(path, "results file"), path)
    check_numbers(data, str(path))
    return data if trail is None else _Traced(data, str(path), "", trail)


class _Traced(dict):
    """A results object that writes (file, dotted key) of each key read into a shared trail."""

    def __init__(self, data: dict, source: str, where: str, trail: list):
        super().__init__(
            (k, _traced(v, source, f"{where}.{k}" if where else str(k), trail))
            for k, v in data.items()
        )
        self._source, self._where, self._trail = source, where, trail

    def _note(self, key) -> None:
        self._trail[:] = [self._source, f"{self._where}.{key}" if self._where else str(key)]

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)


def _traced(value, source: str, where: str, trail: list):
    if isinstance(value, dict):
        return _Traced(value, source, where, trail)
    if isinstance(value, list):
        return [_traced(v, source, f"{where}[{i}]", trail) for i, v in enumerate(value)]
    return value


@contextmanager
def malformed_results_as_error(rs: ResultsSet) -> Iterator[None]:
    """Turn the errors a missing or null key causes while reading ``rs`` into one QStreamError
    naming the file and the key last read (docs/guarantees.md)."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        source, key = rs.trail
        if source is None:
            raise QStreamError(f"results are malformed ({type(exc).__name__}: {exc})") from exc
        raise QStreamError(
            f"{source}: results have a missing or null key {key!r} ({type(exc).__name__}: {exc})"
        ) from exc


def check_results(data: Any, source: str | Path) -> dict:
    """``data`` if it is eval-drift results (schema and top-level fields), else QStreamError."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise QStreamError(
            f"{source}: not eval-drift results (schema {found!r}, expected {SCHEMA!r})"
        )
    for key in ("model", "regimes", "variants", "block_size"):
        if key not in data:
            raise QStreamError(f"{source}: results lack the {key!r} field")
    if not data["regimes"]:
        raise QStreamError(f"{source}: results hold no regime")
    return data


def merge_results(paths: list[str | Path]) -> ResultsSet:
    """One results set from ``paths``; a duplicate regime/variant must carry identical numbers."""
    if not paths:
        raise QStreamError("no results file given")
    trail = [None, None]
    probe = ResultsSet(model={}, trail=trail)
    with malformed_results_as_error(probe):
        merged = collect_results([(read_results(path, trail), str(path)) for path in paths])
    merged.trail = trail
    return merged


def collect_results(results: list[tuple[dict, str]]) -> ResultsSet:
    """One results set from (results, where they came from) pairs, each checked already: read by
    :func:`read_results`, or a run held in memory, ``[(evaluate_drift(...), "(this run)")]``."""
    merged: ResultsSet | None = None
    for data, source in results:
        if merged is None:
            merged = ResultsSet(model=data["model"])
        _check_same_model(merged, data, source)
        for regime, block in data["regimes"].items():
            _merge_regime(merged, regime, block, data, source)
        for name, info in data["variants"].items():
            merged.variants.setdefault(name, info)
    assert merged is not None  # at least one file was read
    return merged


def _check_same_model(merged: ResultsSet, data: dict, path) -> None:
    ours, theirs = merged.model.get("config_sha256"), data["model"].get("config_sha256")
    if ours != theirs:
        raise QStreamError(
            f"{path}: results of a different model (config_sha256 {theirs} of "
            f"{data['model'].get('path')}, not {ours} of "
            f"{merged.model.get('path')}); a card describes one model"
        )


def _merge_regime(merged: ResultsSet, regime: str, block: dict, data: dict, path: str) -> None:
    run = {key: data.get(key) for key in RUN_FIELDS}
    captured = regime in REGIMES and REGIMES[regime].captured
    if captured and data.get("states"):  # its streams and anchors are its own
        run.update(corpus=data["states"], anchors=data["states"].get("anchors"))
    variants = merged.regimes.setdefault(regime, {})
    merged.runs.setdefault(regime, run)
    merged.sources.setdefault(regime, [])
    for name, result in block["variants"].items():
        if name in variants and variants[name] != result:
            raise QStreamError(
                f"{path}: regime {regime!r}, variant {name!r} conflicts with "
                f"{merged.sources[regime][0]} (same regime and variant, different "
                "numbers); pass only one of them"
            )
        if name not in variants and merged.runs[regime] != run:
            raise QStreamError(
                f"{path}: regime {regime!r} was evaluated differently from "
                f"{merged.sources[regime][0]} (seed, blocks, corpus or versions "
                "differ); its variants cannot share one table"
            )
        variants[name] = result
    if path not in merged.sources[regime]:
        merged.sources[regime].append(path)
    merged.computed.setdefault(regime, {})[path] = data.get("compute")
    for key in REGIME_SECTIONS:
        if key in block:
            merged.sections.setdefault(regime, {})[key] = block[key]
