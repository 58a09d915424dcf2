"""Module-name patterns (docs/quantize.md, "Which modules are quantized"): the rule quantize's
``--include_layers``/``--ignore_layers`` use, and vLLM's for a ``re:`` ignore entry."""

from __future__ import annotations

import fnmatch
import re

from qstream.errors import QStreamError


def matches(pattern: str, module: str) -> bool:
    """docs/quantize.md: equal, dotted suffix, glob, or ``re:`` + Python regex (re.match).
    An invalid regex is a QStreamError naming the pattern."""
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], module) is not None
        except re.error as exc:
            raise QStreamError(
                f"pattern {pattern!r} is not a valid regular expression ({exc})"
            ) from exc
    return (
        module == pattern or module.endswith("." + pattern) or fnmatch.fnmatchcase(module, pattern)
    )
