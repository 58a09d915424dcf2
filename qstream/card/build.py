"""Assemble the card from results files and checkpoint directories, and write it (docs/card.md).
What the results set lacks is listed in the card and in ``Card.missing``; no gap is filled."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qstream.card import checkpoints as ckpt
from qstream.card.document import (
    Bullets,
    Card,
    Figure,
    Section,
    check_card_target,
    figures_dir,
    publish_card,
    render,
)
from qstream.card.figures import (
    CEILING_CAPTION,
    CONTEXT_CAPTION,
    SEQ_AGREE_CAPTION,
    kl_caption,
    sweep_regimes,
    write_figures,
)
from qstream.card.measured import measured_sections, read_speculate, speculate_mode
from qstream.card.results import ResultsSet, malformed_results_as_error, merge_results
from qstream.card.serving import serving_sections
from qstream.card.tables import (
    agreement_table,
    all_acceptance_tables,
    ceiling_table,
    context_sweep_table,
    evaluation_table,
    full_metrics_table,
    regime_order,
    sensitivity_parts,
    variant_order,
)
from qstream.errors import QStreamError
from qstream.eval.vocabulary import FLOOR, ROLLOUT_MODES, VARIANT_FORMATS
from qstream.regimes import AUX_REGIMES, DEFAULT_REGIME

FORMATS = ("md", "json", "html")


def find_missing(rs: ResultsSet, checkpoints: Sequence[str], base: str | None) -> list[str]:
    """One sentence per gap in the results set (nothing is estimated in its place)."""
    missing = [f"regime {r}: not in the results" for r in AUX_REGIMES if r not in rs.regimes]
    present = variant_order(rs)
    missing += [f"format {f}: not in any results file" for f in VARIANT_FORMATS if f not in present]
    for variant in present:
        for regime in regime_order(rs):
            if variant not in rs.regimes[regime]:
                missing.append(f"variant {variant}: no results for regime {regime}")
    missing += [
        f"regime {r}: no bf16 floor, so its gaps to bf16 are n/a"
        for r in regime_order(rs)
        if FLOOR not in rs.regimes[r]
    ]
    if not checkpoints:
        missing.append("no --checkpoint given: the size and quantization tables are omitted")
    elif base is None:
        missing.append(
            "no --base given: sizes are not compared with the base and reconstructed "
            "commands are not checked"
        )
    return missing


def _full_metric_regime(rs: ResultsSet, regime: str | None, missing: list[str]) -> str:
    if regime is not None:
        if regime not in rs.regimes:
            raise QStreamError(
                f"--regime {regime}: not in the results (they hold {', '.join(regime_order(rs))})"
            )
        return regime
    if DEFAULT_REGIME.name in rs.regimes:
        return DEFAULT_REGIME.name
    chosen = regime_order(rs)[0]
    missing.append(
        f"the full metric set shows regime {chosen}: the default, {DEFAULT_REGIME.name}, "
        "is not in the results"
    )
    return chosen


def build_card(
    rs: ResultsSet,
    checkpoints: Sequence[str | Path] = (),
    base: str | Path | None = None,
    regime: str | None = None,
    figures_dir: str | None = "figures",
    integrity_check: bool = True,
    speculate: dict | None = None,
) -> Card:
    """The card as data, its figures as ``figures_dir/NAME.png`` (None: left out)."""
    missing = find_missing(rs, [str(c) for c in checkpoints], None if base is None else str(base))
    full_regime = _full_metric_regime(rs, regime, missing)

    def figure(name: str, alt: str, caption: str) -> list[Figure]:
        return [] if figures_dir is None else [Figure(f"{figures_dir}/{name}", alt, caption)]

    sections = _intro_sections(rs, speculate)
    if missing:
        incomplete = (
            "The results set is incomplete; the tables below show what exists and nothing is "
            "estimated in place of the rest:"
        )
        sections.append(Section("Missing data", [incomplete, Bullets(tuple(missing))]))
    if checkpoints:
        base_facts = ckpt.read_base(base) if base is not None else None
        facts = [ckpt.read_quantized(c, base_facts, integrity_check) for c in checkpoints]
        quantized = [p for f in facts for p in ckpt.quantization_parts(f)]
        sections.append(Section("Size", [ckpt.size_table(base_facts, facts)]))
        sections.append(Section("What is quantized to what", quantized))
    if speculate is not None:  # measured acceptance is what the rest predicts: it leads
        sections += measured_sections(speculate, rs, figure)
    # probabilistic drafting is judged by simulated acceptance: it leads
    if acceptance := all_acceptance_tables(rs):
        sections.append(Section("Acceptance under vLLM's verification rules", [*acceptance]))
    sections += serving_sections(rs, speculate)
    sections += _drift_sections(rs, full_regime, figure)
    sections += _study_sections(rs, figure)
    sections.append(Section("How it was evaluated", [evaluation_table(rs)]))
    title = f"{Path(str(rs.model.get('path'))).name}: quantized formats and their drift"
    return Card(title, sections, missing)


def _intro_sections(rs: ResultsSet, speculate: dict | None) -> list[Section]:
    notes = []
    if speculate is not None:
        notes.append(
            "The acceptance measured with the target in the loop comes from `qstream speculate` "
            f"results of the same draft ({speculate_mode(speculate).verification} verification by "
            f"`{speculate['provenance']['target']['path']}`), copied as they stand; the losses "
            "it is compared with are differences of two eval-drift numbers."
        )
    foreign = [name for name, info in rs.variants.items() if info.get("foreign")]
    if foreign:  # compared with --allow-foreign-variant
        notes.append(
            f"**Foreign variant(s): {', '.join(foreign)}.** Not derived from "
            f"`{rs.model.get('path')}` (tensors they keep unquantized differ from the model's); "
            "compared with `--allow-foreign-variant`, so their drift mixes quantization with "
            "the difference between two models."
        )
    n_files = len({path for paths in rs.sources.values() for path in paths})
    about = (
        f"Generated by `qstream card` from {n_files} eval-drift results file(s) of "
        f"`{rs.model.get('path')}` ({rs.model.get('architecture')}). Each format's "
        "drafted blocks are compared with an FP32 reference of the same draft on "
        "identical inputs: agreement is the share of drafted tokens whose accept/reject "
        "outcome is unchanged by the numerics. Under greedy drafting the mean matched "
        "prefix is a ceiling on the acceptance that survives them; under probabilistic "
        "drafting (vLLM's probabilistic draft_sample_method samples the full tempered "
        "softmax, the verifier applies top-p; its default, greedy, drafts the argmax) "
        "acceptance is measured by simulated verification, and the sampled matched "
        "prefix is only a lower bound. Confidence metrics describe the confidence "
        "head, which vLLM 0.32 runs in fp32 to size adaptive verification. Every number is "
        "copied from the results JSON or the checkpoint directories; gaps to bf16 are "
        "differences of two numbers shown beside them."
    )
    return [Section("About these numbers", [about, *notes])]


def _drift_sections(rs: ResultsSet, full_regime: str, figure) -> list[Section]:
    ceiling = figure("ceiling.png", "greedy ceiling and sampled matched prefix by format and "
                     "regime", CEILING_CAPTION)  # fmt: skip
    seq_agree = figure("seq_agree.png", "seq agree and prefix agree by position, per regime "
                       "and rollout mode", SEQ_AGREE_CAPTION)  # fmt: skip
    kl = figure("kl.png", "KL percentiles per format and regime", kl_caption(rs))
    return [
        Section("Greedy acceptance ceiling and sampled matched prefix",
                [*(ceiling_table(rs, mode) for mode in ROLLOUT_MODES), *ceiling]),
        Section("Agreement by drafted position",
                [*(agreement_table(rs, r) for r in regime_order(rs)), *seq_agree]),
        Section(f"All metrics, regime {full_regime}", [full_metrics_table(rs, full_regime), *kl]),
    ]  # fmt: skip


def _study_sections(rs: ResultsSet, figure) -> list[Section]:
    """Per-module sensitivity and the long-context sweep, for the regimes that measured them."""
    sections = []
    sens = [r for r in regime_order(rs) if "sensitivity" in rs.sections.get(r, {})]
    if sens:
        parts = [p for r in sens for p in sensitivity_parts(rs, r)]
        intro = (
            "Each row adds one module kind to the quantized set (fused partners together); the "
            "last row within the tolerance gives the include list below."
        )
        sections.append(Section("Which modules may be quantized", [intro, *parts]))
    if sweep := sweep_regimes(rs):
        drawn = figure("context.png", "acceptance ceiling against context length", CONTEXT_CAPTION)
        tables = [context_sweep_table(rs, r) for r in sweep]
        sections.append(Section("Acceptance ceiling by context length", [*tables, *drawn]))
    return sections


def write_card(
    results: Sequence[str | Path],
    output: Path,
    checkpoints: Sequence[str | Path] = (),
    base: str | Path | None = None,
    regime: str | None = None,
    fmt: str = "md",
    figures: bool = True,
    overwrite: bool = False,
    integrity_check: bool = True,
    speculate: str | Path | None = None,
) -> tuple[Card, list[Path]]:
    """Write the card (``fmt`` md, json or html) to ``output`` and its figures to
    ``<output stem>_files/``, atomically (qstream/card/document.py); the card and every path."""
    if fmt not in FORMATS:
        raise QStreamError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    output = Path(output)
    check_card_target(output, overwrite, figures)
    rs = merge_results(list(results))
    spec = None if speculate is None else read_speculate(Path(speculate), rs)
    with malformed_results_as_error(rs.trail):
        figures_name = figures_dir(output).name if figures else None
        card = build_card(rs, checkpoints, base, regime, figures_name, integrity_check, spec)
        text = render(card, fmt)

    def draw(directory: Path) -> list[Path]:
        with malformed_results_as_error(rs.trail):
            return write_figures(rs, directory, spec)

    return card, publish_card(output, text, draw if figures else None)
