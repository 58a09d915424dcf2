"""Refuse a results file whose numbers cannot be published as they stand (docs/card.md,
"Inputs"): a number that is not finite, a share or correlation outside its range
(``BOUNDED``), or a point estimate outside its own 95% interval.  Quantities that are not
shares (KL, lengths, SNR, differences against bf16) are left unbounded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TypeGuard

from qstream.errors import QStreamError

# The results keys (docs/eval-drift.md, "Metrics") holding a share of blocks, positions or
# tokens, and the range of each; a key names the estimate itself, or the list of one estimate
# per drafted position.
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
    """Each number of ``data`` that cannot be published, as ``PATH = VALUE is ...`` (PATH in
    the dotted form of docs/eval-drift.md); ``field`` is the results key the value sits under."""
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


def _number(x: object) -> TypeGuard[float]:
    """A JSON number (an int or a float, not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _estimate_problems(e: dict, where: str, field: str) -> Iterator[str]:
    """A ``{value, lo, hi}`` estimate: finite numbers, the value inside its interval, and the
    interval inside the quantity's range (one problem per estimate).  A null bound (no
    interval) is not checked."""
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
    """The problem with ``x`` if ``field`` is bounded and ``x`` outside its range."""
    if field not in BOUNDED:
        return None
    low, high = BOUNDED[field]
    if low <= x <= high:
        return None
    kind = "a proportion" if (low, high) == _PROPORTION else "a correlation"
    return f"{where} = {x!r} is outside [{low:g}, {high:g}] ({field} is {kind})"


def check_numbers(data: dict, source: str) -> None:
    """QStreamError naming ``source``, the first unpublishable number and how many more there
    are; nothing when every number can be published."""
    problems = list(results_problems(data))
    if problems:
        more = f" ({len(problems) - 1} more such numbers)" if len(problems) > 1 else ""
        raise QStreamError(f"{source}: {problems[0]}{more}")


def summary_problems(variants: dict, block: int) -> Iterator[str]:
    """What cannot be published in ``qstream speculate``'s per-variant summaries, block size
    ``block`` (docs/speculate.md, "Measured acceptance"): an estimate that is not ``{value, lo,
    hi}`` numbers, tokens per verification or per target forward outside [1, B+1], a loss
    against bf16 outside [-B, B] (a t interval's bounds may reach past those ranges), not B
    shares or shares growing with k, a count that is not a non-negative integer.  Finiteness,
    intervals and the shares' [0, 1] are check_numbers'."""
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
            if e is not None and not _is_estimate(e):
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


def _is_estimate(e: object) -> bool:
    """``{value, lo, hi}``: a number, and bounds that are numbers or null (no interval)."""
    return (
        isinstance(e, dict)
        and _number(e.get("value"))
        and all(_number(e.get(x)) or e.get(x) is None for x in ("lo", "hi"))
    )
