"""``qstream eval-drift``: drift of each format against the FP32 reference."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qstream.cliutil import (
    Command, greedy_option, json_option, make_console, option, write_json,
)
from qstream.errors import QStreamError
from qstream.eval.context_sweep import default_edges, parse_edges
from qstream.eval.corpus import load_corpus, tokenize
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.eval.vocabulary import VARIANT_FORMATS
from qstream.eval.regimes import REGIMES
from qstream.formats import FORMATS
from qstream.model.load import QUANTIZE_INCLUDE, load_config


def _parse_variants(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise QStreamError(f"--variant expects NAME=DIR, got {value!r}")
        if not Path(path).is_dir():
            raise QStreamError(f"--variant {name}: {path} is not a directory")
        out.append((name, path))
    return tuple(out)


@contextmanager
def _progress(total: int | None, console: Console):
    """A rich bar on a terminal; silence otherwise."""
    if not console.is_terminal:
        yield lambda what, n: None
        return
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("blocks"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("eval-drift", total=total)
        yield lambda what, n: bar.update(task, advance=n, description=what)


def _ci(e: dict, digits: int = 3) -> str:
    """``value ±h`` with h the larger side of the 95% interval (the JSON has both sides)."""
    if e["value"] is None:
        return "n/a"
    if e["lo"] is None:
        return f"{e['value']:.{digits}f}"
    half = max(e["value"] - e["lo"], e["hi"] - e["value"])
    return f"{e['value']:.{digits}f}±{half:.{digits}f}"


def _sci(x) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def _print_regime(console: Console, regime: str, data: dict, block_size: int) -> None:
    table = Table(title=f"regime {regime}: drift against the FP32 reference "
                  "(± = 95% CI, larger side)")
    for col in ("variant", "greedy agree", "1−TV", "KL mean", "KL p99", "rKL p99",
                "conf r", "flip", "ceil greedy", "ceil sampled", "SNR dB"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, v in data["variants"].items():
        m = v["metrics"]
        snr = v["weight_snr"]["overall_db"]
        table.add_row(
            name, _ci(m["greedy_agree_overall"]), _ci(m["one_minus_tv_overall"], 4),
            _sci(m["kl"]["mean"]["value"]), _sci(m["kl"]["p99"]), _sci(m["reverse_kl"]["p99"]),
            _ci(m["confidence_r"]), _ci(m["sched_flip_rate"]),
            _ci(m["rollouts"]["greedy"]["ceiling"], 2), _ci(m["rollouts"]["sampled"]["ceiling"], 2),
            "exact" if snr is None else f"{snr:.1f}")
    console.print(table)
    per_pos = Table(title=f"regime {regime}: per position k (greedy agree / seq agree, greedy rollout)")
    per_pos.add_column("variant")
    for k in range(block_size):
        per_pos.add_column(str(k + 1), justify="right")
    for name, v in data["variants"].items():
        m = v["metrics"]
        seq = m["rollouts"]["greedy"]["seq_agree"]
        per_pos.add_row(name, *(f"{g['value']:.2f}/{s['value']:.2f}"
                                for g, s in zip(m["greedy_agree"], seq)))
    console.print(per_pos)


def _regimes(regime: str | None, states: str | None) -> tuple[str, ...]:
    if regime is None:
        return () if states else ("heavy",)
    return tuple(REGIMES) if regime == "all" else (regime,)


def _print_acceptance(console: Console, regime: str, data: dict, block_size: int) -> None:
    """Expected tokens per block (≤ B+1) by verifier, per variant; the loss against bf16."""
    verifiers = [v for v in ("reference", "target")
                 if any(v in e.get("acceptance", {}) for e in data["variants"].values())]
    for verifier in verifiers:
        table = Table(title=f"regime {regime}: tokens per block verified by the "
                      f"{'FP32 reference' if verifier == 'reference' else 'target'} "
                      f"(≤ {block_size + 1}; loss = bf16 − variant)")
        for col in ("draft", "token-wise", "block", "greedy", "loss tw", "loss block",
                    "loss greedy"):
            table.add_column(col, justify="left" if col == "draft" else "right")
        rows = [(name, e["acceptance"][verifier]) for name, e in data["variants"].items()]
        if verifier == "target" and "reference_draft" in data:
            rows.insert(0, ("reference (fp32)", data["reference_draft"]["acceptance"]["target"]))
        for name, a in rows:
            loss = a.get("loss_vs_bf16") or {}
            table.add_row(name, *(_ci(a[m]["emitted"], 2) for m in
                                  ("sampled_token_wise", "sampled_block", "greedy")),
                          *(_ci(loss[m], 2) if m in loss else "" for m in
                            ("sampled_token_wise", "sampled_block", "greedy")))
        console.print(table)


def _print_sensitivity(console: Console, regime: str, data: dict) -> None:
    """One module kind at a time, then cumulatively (least harmful first), and the suggestion."""
    sens = data.get("sensitivity")
    if sens is None:
        return
    floor = sens["floor"]
    for title, entries, key in (("each kind alone", sens["single"], "kind"),
                                ("cumulative, least harmful first", sens["cumulative"], "add")):
        table = Table(title=f"regime {regime}: {sens['format']} sensitivity, {title} (bf16 floor: "
                      f"ceiling {_ci(floor['ceiling'], 2)}, KL p99 {_sci(floor['kl_p99'])})")
        for col in ("kind" if key == "kind" else "+ kind", "tensors", "ceil greedy",
                    "gap to bf16", "KL p99", "within tol"):
            table.add_column(col, justify="left" if col in ("kind", "+ kind") else "right")
        for e in entries:
            ok = e.get("within_tolerance")
            table.add_row(e[key], str(len(e["quantized_tensors"])), _ci(e["ceiling"], 2),
                          f"{e['ceiling_gap']:+.2f}", _sci(e["kl_p99"]),
                          "" if ok is None else ("yes" if ok else "no"))
        console.print(table)
    best = sens["suggested"]
    if best["command"] is None:
        console.print(f"No module kind keeps the greedy ceiling within {sens['tolerance']} tokens "
                      f"of bf16 under {sens['format']}.")
    else:
        console.print(f"Largest include list within {sens['tolerance']} tokens of bf16 "
                      f"(ceiling {_ci(best['ceiling'], 2)}, gap {best['ceiling_gap']:+.2f}):\n"
                      f"  --quant_format {sens['format']} {best['command']}")


def _print_context_sweep(console: Console, regime: str, data: dict) -> None:
    """Greedy ceiling and KL p99 per context-length bucket, one column pair per variant."""
    sweep = data.get("context_sweep")
    if sweep is None:
        return
    names = list(sweep["buckets"][0]["variants"])
    table = Table(title=f"regime {regime}: by context length (YaRN boundary "
                  f"{sweep['yarn_boundary']}; ceiling greedy ± 95% CI / KL p99)")
    table.add_column("context")
    table.add_column("side")
    for name in names:
        table.add_column(name, justify="right")
    for b in sweep["buckets"]:
        table.add_row(f"[{b['lo']}, {b['hi']})", b["side"], *(
            f"{_ci(b['variants'][n]['metrics']['rollouts']['greedy']['ceiling'], 2)} / "
            f"{_sci(b['variants'][n]['metrics']['kl']['p99'])}" for n in names))
    console.print(table)


@click.command("eval-drift", cls=Command)
@option("model", type=click.Path(file_okay=False),
        help="Draft checkpoint directory. Default: the built-in synthetic tiny draft.")
@option("target", type=click.Path(file_okay=False),
        help="Target checkpoint to borrow lm_head (and embed_tokens) from.")
@option("tokenizer", type=click.Path(dir_okay=False),
        help="tokenizer.json to use. Default: the draft's own.")
@option("corpus", type=click.Path(dir_okay=False),
        help="GSM8K-style JSONL (question, answer) or plain text. Default: built-in.")
@option("formats", default=",".join(VARIANT_FORMATS), show_default=True,
        help="Comma-separated simulated variants.")
@option("variant", multiple=True, metavar="NAME=DIR",
        help="A quantized checkpoint to read back from disk; repeatable.")
@option("regime", type=click.Choice([*REGIMES, "all"]), default=None,
        help="Aux regime. Default: heavy, or none when --states is given.")
@option("blocks", type=int, default=1024, show_default=True, help="Blocks per regime.")
@option("seed", type=int, default=0, show_default=True)
@greedy_option("include_layers", help="Modules the simulated formats quantize "
               f"(default: {' '.join(QUANTIZE_INCLUDE)}).")
@greedy_option("ignore_layers", help="Modules never quantized.")
@option("temperature", type=float, default=1.0, show_default=True)
@option("top_p", type=float, default=0.95, show_default=True)
@option("acceptance", is_flag=True,
        help="Also verify each variant's drafts with the FP32 reference: expected tokens per "
             "block under token-wise and block verification, and greedy (docs/acceptance.md).")
@option("states", type=click.Path(dir_okay=False),
        help="Captured target states (safetensors, docs/states.md): adds the 'states' regime "
             "and the acceptance of every draft against the target itself.")
@option("sensitivity", is_flag=True,
        help="Quantize one module kind at a time, then cumulatively (least harmful first), and "
             "suggest the largest --include_layers list within --tolerance (docs/sensitivity.md).")
@option("sensitivity_format", type=click.Choice(list(FORMATS)), default=None,
        help="Format of --sensitivity. Default: nvfp4, or the first 4-bit format of --formats.")
@option("tolerance", type=float, default=0.1, show_default=True,
        help="Greedy ceiling (tokens) the suggested include list may lose against bf16.")
@option("context_lengths", is_flag=False, flag_value="default", default=None,
        metavar="EDGES",
        help="Also sweep context length: comma-separated bucket edges in tokens; bare: "
             "0.25..32 x original_max_position_embeddings (docs/context-sweep.md).")
@option("context_blocks", type=int, default=256, show_default=True,
        help="Blocks per context-length bucket.")
@json_option()
def eval_drift(model, target, tokenizer, corpus, formats, variant, regime, blocks, seed,
               include_layers, ignore_layers, temperature, top_p, acceptance, states,
               sensitivity, sensitivity_format, tolerance, context_lengths, context_blocks,
               json_path) -> None:
    """Measure how far each format moves the drafted block from an FP32 reference.

    \b
    qstream eval-drift --regime heavy
    qstream eval-drift --regime heavy --acceptance --blocks 256
    qstream eval-drift --model DRAFT --states captured.safetensors --acceptance
    qstream eval-drift --regime heavy --formats bf16 --sensitivity --tolerance 0.1
    qstream eval-drift --regime heavy --formats bf16,nvfp4 --context-lengths
    qstream eval-drift --model DRAFT --target TARGET --corpus gsm8k/test.jsonl \\
        --formats bf16,fp8,mxfp4,nvfp4 --variant shipped=FP8_DIR --regime all \\
        --blocks 1024 --seed 0 --json results.json
    """
    console = make_console(stderr=json_path == "-")
    settings = DriftSettings(
        regimes=_regimes(regime, states),
        formats=tuple(f.strip() for f in formats.split(",") if f.strip()),
        variant_dirs=_parse_variants(variant),
        include=tuple(include_layers) or QUANTIZE_INCLUDE, ignore=tuple(ignore_layers),
        n_blocks=blocks, seed=seed, temperature=temperature, top_p=top_p,
        acceptance=acceptance, states=states, sensitivity=sensitivity,
        sensitivity_format=sensitivity_format, tolerance=tolerance,
        context_blocks=context_blocks)
    if model is None:
        from qstream.eval.builtin import builtin_model_dir

        model = builtin_model_dir(console)
        console.print(f"No --model given: evaluating the built-in synthetic tiny draft ({model}) "
                      "on the built-in corpus of generated arithmetic word problems.")
    config = load_config(model)
    if context_lengths is not None:
        edges = default_edges(config) if context_lengths == "default" \
            else parse_edges(context_lengths)
        settings = replace(settings, context_lengths=edges)
    tok = Path(tokenizer) if tokenizer else Path(model) / "tokenizer.json"
    if corpus is None:
        from qstream.eval.builtin import builtin_corpus_docs

        text = tokenize(builtin_corpus_docs(), tok, config.vocab_size)
    else:
        text = load_corpus(corpus, tok, config.vocab_size)
    n_variants = len(settings.formats) + len(settings.variant_dirs)
    total = blocks * (1 + n_variants) * (len(settings.regimes) + (states is not None))
    if settings.sensitivity or settings.context_lengths:
        total = None  # their step and bucket counts are known only once they run: no percentage
    with _progress(total, console) as tick:
        results = evaluate_drift(model, settings, text, target, progress=tick)
    for name, data in results["regimes"].items():
        _print_regime(console, name, data, results["block_size"])
        _print_acceptance(console, name, data, results["block_size"])
        _print_sensitivity(console, name, data)
        _print_context_sweep(console, name, data)
    write_json(results, json_path)
