"""Read eval-drift results files and merge them into one results set; refused (docs/card.md,
"Inputs"): different models, a regime and variant measured twice with different numbers, and a
number that cannot be published (not finite, outside ``BOUNDED`` or its own interval)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from qstream.checkpoint.files import read_json
from qstream.errors import QStreamError
from qstream.eval.vocabulary import SCHEMA
from qstream.regimes import REGIMES
from qstream.verification import LEGACY_NAMES

# Results written before the verification modes took vLLM's names: eval-drift's keyed its
# acceptance modes, speculate's named its settings.rule, by qstream.verification.LEGACY_NAMES.
SPECULATE_SCHEMA = "qstream.speculate/2"  # qstream.speculate.run.SCHEMA
LEGACY_SCHEMAS = {"qstream.eval-drift/2": SCHEMA, "qstream.speculate/1": SPECULATE_SCHEMA}

# Top-level fields saying how a file's regimes were evaluated (shown per regime where they differ).
RUN_FIELDS = ("qstream_version", "torch_version", "model", "target", "corpus", "seed", "blocks",
              "block_size", "anchors", "sampling", "reference", "variant_compute", "aux_dtype",
              "selection")  # fmt: skip
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


def read_results(path: str | Path, trail: list) -> dict:
    """A checked results file, each key read recorded in ``trail``."""
    path = Path(path)
    raw = read_json(path, "results file")
    data = check_results(raw, path)
    check_numbers(raw, str(path))  # by the file's own keys
    return _Traced(data, str(path), "", trail)


class _Traced(dict):
    """A results object writing (file, dotted key) of each key read into a shared trail."""

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
def malformed_results_as_error(trail: list) -> Iterator[None]:
    """Turn the errors a missing or null key causes while reading results into one QStreamError
    naming the file and the key last read, from ``trail`` (docs/guarantees.md)."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        source, key = trail
        if source is None:
            raise QStreamError(f"results are malformed ({type(exc).__name__}: {exc})") from exc
        raise QStreamError(
            f"{source}: results have a missing or null key {key!r} ({type(exc).__name__}: {exc})"
        ) from exc


def of_schema(data: Any, schema: str, what: str, source: str | Path) -> dict:
    """``data`` (:func:`renamed_modes`) if it is ``what`` of ``schema``, else QStreamError."""
    data = renamed_modes(data)
    if not isinstance(data, dict) or data.get("schema") != schema:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise QStreamError(f"{source}: not {what} (schema {found!r}, expected {schema!r})")
    return data


def check_results(data: Any, source: str | Path) -> dict:
    """``data`` if it is eval-drift results, else QStreamError."""
    data = of_schema(data, SCHEMA, "eval-drift results", source)
    for key in ("model", "regimes", "variants", "block_size"):
        if key not in data:
            raise QStreamError(f"{source}: results lack the {key!r} field")
    if not data["regimes"]:
        raise QStreamError(f"{source}: results hold no regime")
    return data


def renamed_modes(data: Any) -> Any:
    """Results of a legacy schema (:data:`LEGACY_SCHEMAS`) as their current schema writes them,
    the modes renamed; any other ``data`` as it is.  The one place old mode names are read."""
    if not isinstance(data, dict) or data.get("schema") not in LEGACY_SCHEMAS:
        return data
    data = {**copy.deepcopy(data), "schema": LEGACY_SCHEMAS[data["schema"]]}
    settings = data.get("settings")  # speculate's
    if isinstance(settings, dict) and isinstance(rule := settings.get("rule"), str):
        settings["rule"] = LEGACY_NAMES[rule].name if rule in LEGACY_NAMES else rule
    for regime in (data.get("regimes") or {}).values():  # eval-drift's
        for holder in [*(regime.get("variants") or {}).values(), regime.get("reference_draft")]:
            if isinstance(holder, dict) and isinstance(holder.get("acceptance"), dict):
                holder["acceptance"] = {v: _renamed(b) for v, b in holder["acceptance"].items()}
    return data


def _renamed(block: Any) -> Any:
    if not isinstance(block, dict):
        return block
    out = {(LEGACY_NAMES[k].name if k in LEGACY_NAMES else k): v for k, v in block.items()}
    if "loss_vs_bf16" in out:
        out["loss_vs_bf16"] = _renamed(out["loss_vs_bf16"])
    return out


def merge_results(paths: list[str | Path]) -> ResultsSet:
    """One results set from ``paths``; a duplicate regime/variant must carry identical numbers."""
    if not paths:
        raise QStreamError("no results file given")
    trail: list = [None, None]
    with malformed_results_as_error(trail):
        merged = collect_results([(read_results(path, trail), str(path)) for path in paths])
    merged.trail = trail
    return merged


def collect_results(results: list[tuple[dict, str]]) -> ResultsSet:
    """One results set from checked (results, where they came from) pairs, at least one."""
    merged = ResultsSet(model=results[0][0]["model"])
    for data, source in results:
        ours, theirs = merged.model.get("config_sha256"), data["model"].get("config_sha256")
        if ours != theirs:
            raise QStreamError(
                f"{source}: results of a different model (config_sha256 {theirs} of "
                f"{data['model'].get('path')}, not {ours} of "
                f"{merged.model.get('path')}); a card describes one model"
            )
        for regime, block in data["regimes"].items():
            run = {key: data.get(key) for key in RUN_FIELDS}
            captured = regime in REGIMES and REGIMES[regime].captured
            if captured and data.get("states"):  # its streams and anchors are its own
                run.update(corpus=data["states"], anchors=data["states"].get("anchors"))
            variants = merged.regimes.setdefault(regime, {})
            merged.runs.setdefault(regime, run)
            sources = merged.sources.setdefault(regime, [])
            for name, result in block["variants"].items():
                if name in variants and variants[name] != result:
                    raise QStreamError(
                        f"{source}: regime {regime!r}, variant {name!r} conflicts with "
                        f"{sources[0]} (same regime and variant, different numbers); pass only "
                        "one of them"
                    )
                if name not in variants and merged.runs[regime] != run:
                    raise QStreamError(
                        f"{source}: regime {regime!r} was evaluated differently from "
                        f"{sources[0]} (seed, blocks, corpus or versions differ); its variants "
                        "cannot share one table"
                    )
                variants[name] = result
            if source not in sources:
                sources.append(source)
            merged.computed.setdefault(regime, {})[source] = data.get("compute")
            for key in REGIME_SECTIONS:
                if key in block:
                    merged.sections.setdefault(regime, {})[key] = block[key]
        for name, info in data["variants"].items():
            merged.variants.setdefault(name, info)
    return merged


# The results keys (docs/eval-drift.md, "Metrics") holding a share or a correlation: an estimate,
# or a list of one per drafted position, and its range.
_PROPORTION = (0.0, 1.0)
BOUNDED = {
    "greedy_agree": _PROPORTION,  # teacher-forced top-1 match, per position
    "greedy_agree_overall": _PROPORTION,
    "one_minus_tv": _PROPORTION,  # sum min(p, q), per position
    "one_minus_tv_overall": _PROPORTION,
    "sched_flip_rate": _PROPORTION,
    "seq_agree": _PROPORTION,  # rollouts' token k equal
    "prefix_agree": _PROPORTION,  # rollouts' tokens 1..k all equal
    "prefix_accept": _PROPORTION,  # acceptance rate of drafted position k (docs/acceptance.md)
    "accepted_at_least": _PROPORTION,  # qstream speculate: verifications accepting >= k
    "confidence_r": (-1.0, 1.0),  # Pearson r
}
ESTIMATE_KEYS = ("value", "lo", "hi")


def results_problems(data: object, where: str = "", field: str = "") -> Iterator[str]:
    """Each number of ``data`` that cannot be published, as ``PATH = VALUE is ...``."""
    if isinstance(data, dict):
        estimate = all(key in data for key in ESTIMATE_KEYS)
        if estimate:
            yield from _estimate_problems(data, where, field)
        for key, value in data.items():
            if not (estimate and key in ESTIMATE_KEYS):  # those were checked together
                yield from results_problems(value, f"{where}.{key}" if where else str(key), key)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from results_problems(value, f"{where}[{i}]", field)
    elif _number(data) and not math.isfinite(data):
        yield f"{where} = {data!r} is not a finite number"
    elif _number(data) and (problem := _range_problem(data, where, field)):
        yield problem


def _number(x: object) -> TypeGuard[float]:  # an int or a float, not a bool
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _estimate_problems(e: dict, where: str, field: str) -> Iterator[str]:
    """At most one problem of a ``{value, lo, hi}`` estimate: not finite, the value outside its
    interval, or outside the quantity's range (a null bound is not checked)."""
    value, lo, hi = (e[key] for key in ESTIMATE_KEYS)
    numbers = [(key, e[key]) for key in ESTIMATE_KEYS if _number(e[key])]
    bad = [
        f"{where}.{key} = {x!r} is not a finite number"
        for key, x in numbers
        if not math.isfinite(x)
    ]
    if bad:
        yield from bad
        return
    if _number(value) and ((_number(lo) and value < lo) or (_number(hi) and value > hi)):
        yield f"{where}.value = {value!r} is outside its interval [{lo!r}, {hi!r}]"
        return
    for key, x in numbers:  # the first of the three out of the quantity's range, if any
        if problem := _range_problem(x, f"{where}.{key}", field):
            yield problem
            return


def _range_problem(x: float, where: str, field: str) -> str | None:
    if field not in BOUNDED:
        return None
    low, high = BOUNDED[field]
    if low <= x <= high:
        return None
    kind = "a proportion" if (low, high) == _PROPORTION else "a correlation"
    return f"{where} = {x!r} is outside [{low:g}, {high:g}] ({field} is {kind})"


def check_numbers(data: dict, source: str) -> None:
    """QStreamError naming ``source``, the first unpublishable number and how many more."""
    problems = list(results_problems(data))
    if problems:
        more = f" ({len(problems) - 1} more such numbers)" if len(problems) > 1 else ""
        raise QStreamError(f"{source}: {problems[0]}{more}")


def summary_problems(variants: dict, block: int) -> Iterator[str]:
    """What cannot be published in ``qstream speculate``'s per-variant summaries of block size
    ``block`` (docs/speculate.md, "Measured acceptance"; a t interval's bounds may leave the
    ranges, its value may not); finiteness and intervals are check_numbers'."""
    ranges = {"mean_acceptance_length": (1, block + 1), "tokens_per_target_forward": (1, block + 1),
              "loss_vs_bf16": (-block, block)}  # fmt: skip
    if not variants:
        yield "variants = {} names no variant"
    for name, v in variants.items():
        where, s = f"variants.{name}.summary", v["summary"]
        for key in ("prompts", "verifications"):
            if not (isinstance(s[key], int) and not isinstance(s[key], bool) and s[key] >= 0):
                yield f"{where}.{key} = {s[key]!r} is not a non-negative integer"
        shares = s["accepted_at_least"]
        named = [(key, s.get(key)) for key in ranges] + [
            (f"accepted_at_least[{k}]", e) for k, e in enumerate(shares)
        ]
        for key, e in named:  # a null loss_vs_bf16 (no bf16 run) is shown as n/a
            bounds = isinstance(e, dict) and all(_number(e.get(x)) or e.get(x) is None
                                                 for x in ("lo", "hi"))  # fmt: skip
            if e is not None and not (bounds and _number(e.get("value"))):
                yield f"{where}.{key} = {e!r:.80} is not a {{value, lo, hi}} estimate of numbers"
        for key, (low, high) in ranges.items():
            e = s.get(key)
            value = e.get("value") if isinstance(e, dict) else None
            if _number(value) and not low <= value <= high:
                yield f"{where}.{key}.value = {value!r} is outside [{low}, {high}] (B = {block})"
        if len(shares) != block:
            yield f"{where}.accepted_at_least holds {len(shares)} entries, not one per k = 1..{block}"
        values = [e["value"] for e in shares]
        for k in range(1, len(values)):
            if _number(values[k]) and _number(values[k - 1]) and values[k] > values[k - 1]:
                yield (f"{where}.accepted_at_least[{k}].value = {values[k]!r} exceeds the share "
                       f"of k = {k}: at least k+1 accepted is at least k accepted")  # fmt: skip
