"""``qstream eval-drift``: drift of each format against the FP32 reference."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qstream.cliutil import Command, greedy_option, json_option, option, write_json
from qstream.errors import QStreamError
from qstream.eval.corpus import load_corpus, tokenize
from qstream.eval.drift import VARIANT_FORMATS, DriftSettings, evaluate_drift
from qstream.eval.regimes import REGIMES
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
def _progress(total: int, console: Console):
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
@json_option()
def eval_drift(model, target, tokenizer, corpus, formats, variant, regime, blocks, seed,
               include_layers, ignore_layers, temperature, top_p, acceptance, states,
               json_path) -> None:
    """Measure how far each format moves the drafted block from an FP32 reference.

    \b
    qstream eval-drift --regime heavy
    qstream eval-drift --regime heavy --acceptance --blocks 256
    qstream eval-drift --model DRAFT --states captured.safetensors --acceptance
    qstream eval-drift --model DRAFT --target TARGET --corpus gsm8k/test.jsonl \\
        --formats bf16,fp8,mxfp4,nvfp4 --variant shipped=FP8_DIR --regime all \\
        --blocks 1024 --seed 0 --json results.json
    """
    console = Console(stderr=json_path == "-")
    settings = DriftSettings(
        regimes=_regimes(regime, states),
        formats=tuple(f.strip() for f in formats.split(",") if f.strip()),
        variant_dirs=_parse_variants(variant),
        include=tuple(include_layers) or QUANTIZE_INCLUDE, ignore=tuple(ignore_layers),
        n_blocks=blocks, seed=seed, temperature=temperature, top_p=top_p,
        acceptance=acceptance, states=states)
    if model is None:
        from qstream.eval.builtin import builtin_model_dir

        model = builtin_model_dir(console)
        console.print(f"No --model given: evaluating the built-in synthetic tiny draft ({model}) "
                      "on the built-in corpus of generated arithmetic word problems.")
    config = load_config(model)
    tok = Path(tokenizer) if tokenizer else Path(model) / "tokenizer.json"
    if corpus is None:
        from qstream.eval.builtin import builtin_corpus_docs

        text = tokenize(builtin_corpus_docs(), tok, config.vocab_size)
    else:
        text = load_corpus(corpus, tok, config.vocab_size)
    n_variants = len(settings.formats) + len(settings.variant_dirs)
    total = blocks * (1 + n_variants) * (len(settings.regimes) + (states is not None))
    with _progress(total, console) as tick:
        results = evaluate_drift(model, settings, text, target, progress=tick)
    for name, data in results["regimes"].items():
        _print_regime(console, name, data, results["block_size"])
        _print_acceptance(console, name, data, results["block_size"])
    write_json(results, json_path)
