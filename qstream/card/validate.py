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
