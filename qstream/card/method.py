"""The card's "How the numbers were measured" table: reference, regimes, corpus, blocks,
sampling, intervals, seed and versions, every entry read from the results (docs/card.md)."""

from __future__ import annotations

from pathlib import Path

from qstream.card.results import ResultsSet
from qstream.card.tables import per_regime, regime_order
from qstream.eval.vocabulary import CONFIDENCE_NOTE, rollout_label, verifier_label
from qstream.regimes import REGIMES
from qstream.tablefit import Cell, Table


def _corpus(run: dict) -> str:
    c = run["corpus"] or {}
    return (
        f"{c.get('corpus')} (sha256 {c.get('sha256')}, {c.get('streams')} streams, "
        f"{c.get('tokens')} tokens)"
    )


def _anchors(run: dict) -> str:
    a = run["anchors"] or {}
    source = (
        f"the blocks {a['file']} names (sha256 {a.get('file_sha256')}); "
        if a.get("file")
        else "drawn uniformly; "
    )
    return (
        f"{source}context length mean {a.get('context_length_mean'):.1f}, min "
        f"{a.get('context_length_min')}, max {a.get('context_length_max')} tokens"
    )


def _sampling(run: dict) -> str:
    s = run["sampling"] or {}
    return f"drafter {rollout_label('sampled', s)}; verifier {verifier_label(s)}; {s.get('noise')}"


def _selection(run: dict) -> str:
    s = run["selection"] or {}
    return (
        f"include {' '.join(s.get('include') or []) or '(default)'}; "
        f"ignore {' '.join(s.get('ignore') or []) or '(none)'}"
    )


def _setup_rows(rs: ResultsSet, regimes: list[str]) -> list[tuple[str, str]]:
    """What was compared: the model, the reference, the variants and the regimes."""
    model, params = rs.model, rs.model.get("parameters")
    params = f"{params:,}" if isinstance(params, int) else params
    return [
        (
            "model",
            f"{model.get('path')} ({model.get('architecture')}, {params} "
            "parameters as eval-drift loads it: its own tensors and the embed_tokens it borrows "
            "from the target, if any, without lm_head; config.json sha256 "
            f"{model.get('config_sha256')})",
        ),
        ("target head from", per_regime(rs, regimes, lambda r: r["target"] or "not given")),
        ("reference", per_regime(rs, regimes, lambda r: r["reference"])),
        (
            "variants",
            "; ".join(
                f"{name}: {info.get('kind')} ({info.get('source')})"
                for name, info in rs.variants.items()
            ),
        ),
        ("variant compute", per_regime(rs, regimes, lambda r: r["variant_compute"])),
        ("confidence head", CONFIDENCE_NOTE),
        (
            "aux states",
            per_regime(
                rs, regimes, lambda r: f"shared by reference and variants, {r['aux_dtype']}"
            ),
        ),
        (
            "regimes",
            "; ".join(
                f"{r}: {REGIMES[r].description if r in REGIMES else 'see the results'}"
                for r in regimes
            ),
        ),
    ]


def _computed_on(rs: ResultsSet, regimes: list[str]) -> str:
    """Device, torch's CPU kernels and threads of every file: float results follow all three."""
    seen = [c for r in regimes for c in rs.computed.get(r, {}).values()]
    return "; ".join(dict.fromkeys(_compute_text(c) for c in seen)) or "not recorded"


def _compute_text(compute: dict | None) -> str:
    if not compute:
        return "not recorded in the results"
    where = f"{compute['device']} ({compute['device_name']})"
    if compute["device"] != "cpu":
        return where
    kernels = compute.get("cpu_capability") or "not recorded"
    return f"{where}, torch CPU kernels {kernels}, {compute['threads']} threads"


def _data_rows(rs: ResultsSet, regimes: list[str]) -> list[tuple[str, str]]:
    """What it was measured on, and how: corpus, blocks, sampling, intervals, versions."""
    return [
        ("corpus", per_regime(rs, regimes, _corpus)),
        (
            "tokenizer",
            per_regime(
                rs,
                regimes,
                lambda r: (r.get("corpus") or {}).get("tokenizer") or "not recorded in the results",
            ),
        ),
        (
            "blocks per regime",
            per_regime(rs, regimes, lambda r: f"{r['blocks']} blocks of {r['block_size']} tokens"),
        ),
        ("anchors", per_regime(rs, regimes, _anchors)),
        ("sampled rollouts", per_regime(rs, regimes, _sampling)),
        ("modules the simulated formats quantize", per_regime(rs, regimes, _selection)),
        ("seed", per_regime(rs, regimes, lambda r: str(r["seed"]))),
        (
            "intervals",
            "95%, two-sided: Wilson score for per-position proportions; Wilson on "
            "Kish's effective sample size for pooled proportions and B times them "
            "(matched prefix, greedy acceptance); Student-t over blocks for other "
            "means; a seeded block bootstrap for r",
        ),
        (
            "versions",
            per_regime(
                rs, regimes, lambda r: f"qstream {r['qstream_version']}, torch {r['torch_version']}"
            ),
        ),
        ("computed on", _computed_on(rs, regimes)),
        (
            "results files",
            "; ".join(f"{r}: {', '.join(Path(p).name for p in rs.sources[r])}" for r in regimes),
        ),
    ]


def evaluation_table(rs: ResultsSet) -> Table:
    """Reference, regimes, corpus, blocks, intervals, seed, versions: all from the results."""
    regimes = regime_order(rs)
    rows = _setup_rows(rs, regimes) + _data_rows(rs, regimes)
    return Table(
        "How the numbers were measured (from the results JSON)",
        ["", "value"],
        [[Cell(k), Cell(v)] for k, v in rows],
        key="evaluation",
        align="ll",
    )
