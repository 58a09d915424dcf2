"""The card's measured acceptance: ``qstream speculate`` results (docs/speculate.md) beside what
eval-drift predicted from the same draft (docs/card.md, "Measured acceptance";
docs/calibration.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from qstream.card.document import Section
from qstream.card.results import (
    SPECULATE_SCHEMA,
    ResultsSet,
    check_numbers,
    of_schema,
    summary_problems,
)
from qstream.card.tables import DIGITS, difference, estimate, metrics, regime_order
from qstream.checkpoint.files import read_json
from qstream.errors import QStreamError
from qstream.eval.vocabulary import FLOOR
from qstream.regimes import STATES
from qstream.tablefit import Cell, Table
from qstream.verification import GREEDY, MODES, SPECULATE_MODES, VerificationMode

CALIBRATION_CAPTION = (
    "What each format loses against bf16, in tokens: measured with the target in the loop "
    "(`qstream speculate`, 95% interval paired over prompts), simulated by eval-drift against "
    "the target on its captured states, and what the greedy ceiling against the FP32 reference "
    "draft loses in each aux regime (drafted tokens matched, not accepted; the ceiling "
    "table's gap to bf16 with the sign turned). Points above the measured "
    "interval overstate what the format costs."
)


def read_speculate(path: Path, rs: ResultsSet) -> dict:
    """Checked ``qstream speculate --json`` results of the draft ``rs`` describes."""
    raw = read_json(path, "speculate results")
    data = of_schema(raw, SPECULATE_SCHEMA, "speculate results", path)
    lacking = next((p for p in _read_paths(data) if _at(data, p) is None), None)
    if lacking is not None:
        dotted = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in lacking)
        raise QStreamError(f"{path}: speculate results lack {dotted.lstrip('.')}")
    if data["settings"]["rule"] not in SPECULATE_MODES:
        raise QStreamError(f"{path}: settings.rule = {data['settings']['rule']!r:.60} is not one "
                           f"of {', '.join(SPECULATE_MODES)}")  # fmt: skip
    if not isinstance(data["variants"], dict):
        raise QStreamError(f"{path}: variants = {data['variants']!r:.60} is not an object")
    draft_sha = data["provenance"]["draft"]["config_sha256"]
    model_sha = rs.model.get("config_sha256")
    if draft_sha != model_sha:
        raise QStreamError(
            f"{path}: speculate results of another draft (config sha256 {draft_sha}; the "
            f"eval-drift results' is {model_sha})"
        )
    block = data["provenance"]["draft"]["block_size"]
    if type(block) is not int or block != rs.block_size:
        raise QStreamError(
            f"{path}: provenance.draft.block_size = {block!r}, but the eval-drift results' "
            f"block size is {rs.block_size}"
        )
    check_numbers({"variants": data["variants"]}, str(path))
    problem = next(summary_problems(data["variants"], block), None)
    if problem is not None:
        raise QStreamError(f"{path}: {problem}")
    return data


# What the card reads of speculate results besides the variants' summaries (SUMMARY).
READ = ("settings.rule", "settings.new_tokens", "settings.target_dtype",
        "provenance.draft.config_sha256", "provenance.draft.block_size", "provenance.target.path",
        "provenance.target.model_type", "provenance.corpus.name", "variants")  # fmt: skip
SUMMARY = ("prompts", "verifications", "mean_acceptance_length.value",
           "tokens_per_target_forward.value", "accepted_at_least")  # fmt: skip


def _read_paths(data: dict) -> list[tuple]:
    """Every key path the card reads of ``data``, each a tuple of keys and list indices."""
    paths: list[tuple] = [tuple(p.split(".")) for p in READ]
    variants = data.get("variants")
    for name in variants if isinstance(variants, dict) else ():
        summary = ("variants", name, "summary")
        paths += [summary, *((*summary, *key.split(".")) for key in SUMMARY)]
        shares = _at(data, (*summary, "accepted_at_least"))
        paths += [(*summary, "accepted_at_least", i, "value")
                  for i in range(len(shares) if isinstance(shares, list) else 1)]  # fmt: skip
    return paths


def _at(node: Any, path: tuple) -> Any:
    """The value at ``path`` (keys and list indices), None where there is none."""
    for key in path:
        if isinstance(key, int):
            node = node[key] if isinstance(node, list) and key < len(node) else None
        else:
            node = node.get(key) if isinstance(node, dict) else None
    return node


def measured_sections(spec: dict, rs: ResultsSet, figure) -> list[Section]:
    """The measured acceptance, then (greedy verification) the calibration against eval-drift."""
    s, block, target = spec["settings"], _block(spec), spec["provenance"]["target"]
    intro = (
        f"`qstream speculate` decoded the first {_prompts(spec)} prompts of "
        f"`{spec['provenance']['corpus']['name']}`, {s['new_tokens']} new tokens each, with the "
        f"target `{target['path']}` ({target['model_type']}, {s['target_dtype']}) verifying "
        f"every block by its own forward under {speculate_mode(spec).verification} verification "
        "as vLLM 0.32.0 runs it "
        "(docs/speculate.md). Tokens per verification are the accepted drafts plus the bonus or "
        f"correction token (1..{block + 1}); intervals are 95% over prompts, the independent "
        "units."
    )
    title = "Acceptance with the target in the loop (measured)"
    sections = [Section(title, [intro, measured_table(spec), shares_table(spec)])]
    if not speculate_mode(spec).greedy_verifier:
        return sections
    calibration = (
        "The same draft's formats, three ways: the acceptance each loses against bf16 "
        "as measured above; as eval-drift simulated it against the target on captured "
        "target states (regime states; uniformly drawn anchors, which a decoder does "
        "not visit uniformly: docs/calibration.md); and what the greedy ceiling, "
        "against the FP32 reference draft, loses in each aux regime. Losses are bf16's "
        "value minus the variant's: positive is worse (a ceiling loss is the ceiling "
        "table's gap to bf16 with the sign turned)."
    )
    drawn = figure("calibration.png", "acceptance lost against bf16: measured, simulated and "
                   "ceiling losses", CALIBRATION_CAPTION)  # fmt: skip
    title = "Does drift predict the acceptance a format loses?"
    return [*sections, Section(title, [calibration, calibration_table(spec, rs), *drawn])]


def measured_table(spec: dict) -> Table:
    d = DIGITS["ceiling"]
    rows = [
        [Cell(name), Cell(v.get("kind", "")), estimate(x["mean_acceptance_length"], d),
         difference(x.get("loss_vs_bf16")), estimate(x["tokens_per_target_forward"], d),
         Cell(str(x["verifications"]), x["verifications"])]
        for name, v in spec["variants"].items()
        for x in [v["summary"]]
    ]  # fmt: skip
    columns = ["variant", "kind", "tokens per verification", "loss vs bf16",
               "tokens per target forward", "verifications"]  # fmt: skip
    return Table(
        "Measured acceptance per variant (the loss against bf16 is paired over the same "
        "prompts, as `qstream speculate` reports it)",
        columns,
        rows,
        "measured_acceptance",
        align="llrrrr",
    )


def shares_table(spec: dict) -> Table:
    shares = [v["summary"]["accepted_at_least"] for v in spec["variants"].values()]
    d = DIGITS["proportion"]
    rows = [
        [Cell(str(k), k), *(Cell(f"{s[k - 1]['value']:.{d}f}", s[k - 1]["value"]) for s in shares)]
        for k in range(1, _block(spec) + 1)
    ]
    return Table(
        "Share of verifications accepting at least k drafted tokens (measured)",
        ["k", *spec["variants"]],
        rows,
        "measured_accepted_at_least",
    )


def speculate_tables(results: dict) -> list[Table]:
    """What ``qstream speculate`` prints of its ``results``."""
    s, d = results["settings"], DIGITS["ceiling"]
    rows = [
        [Cell(name), estimate(x["mean_acceptance_length"], d),
         estimate(x["tokens_per_target_forward"], d), difference(x.get("loss_vs_bf16"))]
        for name, v in results["variants"].items()
        for x in [v["summary"]]
    ]  # fmt: skip
    means = Table(
        f"{speculate_mode(results).verification} verification, {_prompts(results)} prompts x "
        f"{s['new_tokens']} new tokens (95% "
        "intervals over prompts)",
        ["variant", "mean acceptance length", "tokens / target forward", "loss vs bf16"],
        rows,
        "speculate_acceptance",
    )
    shares = shares_table(results)
    caption = "share of verifications accepting at least k drafted tokens"
    return [means, replace(shares, caption=caption, align="r" * len(shares.columns))]


def speculate_mode(spec: dict) -> VerificationMode:  # settings.rule
    return MODES[spec["settings"]["rule"]]


def _prompts(spec: dict) -> int:  # every variant's the same
    return next(iter(spec["variants"].values()))["summary"]["prompts"]


def _block(spec: dict) -> int:
    return spec["provenance"]["draft"]["block_size"]


def calibration_rows(spec: dict, rs: ResultsSet) -> dict[str, dict[str, Any]]:
    """Per speculate variant but bf16: its measured loss, eval-drift's simulated loss on captured
    states and each regime's ceiling loss (differences; None where a number is missing)."""
    sim = {}  # eval-drift's greedy acceptance against the target on captured states
    for name, result in rs.regimes.get(STATES.name, {}).items():
        target = (result.get("acceptance") or {}).get("target")
        if target and GREEDY.name in target:
            sim[name] = target[GREEDY.name]["emitted"]
    return {
        name: {
            "measured": v["summary"].get("loss_vs_bf16"),
            "simulated": _loss(sim.get(FLOOR), sim.get(name)),
            "ceiling": {
                r: _loss(_ceiling(rs, r, FLOOR), _ceiling(rs, r, name)) for r in regime_order(rs)
            },
        }
        for name, v in spec["variants"].items()
        if name != FLOOR
    }


def calibration_table(spec: dict, rs: ResultsSet) -> Table:
    regimes = regime_order(rs)
    rows = [
        [Cell(name), difference(r["measured"]), _value(r["simulated"]),
         *(_value(r["ceiling"][g]) for g in regimes)]
        for name, r in calibration_rows(spec, rs).items()
    ]  # fmt: skip
    return Table(
        "Acceptance lost against bf16 (tokens; positive is worse): measured, eval-drift's "
        "simulation against the target (regime states), and the greedy ceiling's loss per "
        "regime. The simulated and ceiling columns are differences of two numbers of the "
        "eval-drift results; n/a where the results lack one",
        [
            "variant",
            "measured loss",
            "simulated loss (states)",
            *(f"ceiling loss, {g}" for g in regimes),
        ],
        rows,
        "calibration",
    )


def _ceiling(rs: ResultsSet, regime: str, variant: str) -> dict | None:
    m = metrics(rs, regime, variant)
    return None if m is None else m["rollouts"]["greedy"]["ceiling"]


def _loss(base: dict | None, other: dict | None) -> dict | None:
    """bf16's value minus the variant's, a plain difference (no interval)."""
    if base is None or other is None:
        return None
    return {"value": base["value"] - other["value"], "lo": None, "hi": None}


def _value(e: dict | None) -> Cell:  # a _loss has no interval
    return difference(None if e is None else e["value"])
