"""``qstream eval-drift`` as one library call: the command's defaults resolved (the built-in
draft and corpus, the draft's own tokenizer, the default regime and context buckets), the corpus
loaded, and :func:`~qstream.eval.drift.evaluate_drift` run.  ``evals/eval_dspark_quant.py`` uses
the same call.

>>> settings = DriftSettings(regimes=resolve_regimes("all", None), n_blocks=256)
>>> results = run_drift(settings, model="DRAFT", corpus="gsm8k/test.jsonl", say=print)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from qstream.arch.interface import DraftConfig
from qstream.arch.registry import load_config
from qstream.device import resolve_device
from qstream.errors import QStreamError
from qstream.eval.context_sweep import default_edges, parse_edges
from qstream.eval.corpus import (
    BUILTIN_CORPUS_NAME,
    Corpus,
    builtin_corpus_docs,
    builtin_model_dir,
    load_corpus,
    tokenize,
)
from qstream.eval.drift import evaluate_drift
from qstream.eval.settings import DriftSettings
from qstream.progress import Progress
from qstream.regimes import ALL_REGIMES, AUX_REGIMES, DEFAULT_REGIME

DEFAULT_EDGES = "default"  # --context-lengths given bare


def resolve_regimes(regime: str | None, states: str | None) -> tuple[str, ...]:
    """``--regime``: one regime, ``all``, or (None) heavy; none when captured states are given."""
    if regime is None:
        return () if states else (DEFAULT_REGIME.name,)
    return AUX_REGIMES if regime == ALL_REGIMES else (regime,)


def parse_variants(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=DIR`` values (``--variant``) -> ((name, dir), ...), each dir checked to exist."""
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise QStreamError(f"--variant expects NAME=DIR, got {value!r}")
        if not Path(path).is_dir():
            raise QStreamError(f"--variant {name}: {path} is not a directory")
        out.append((name, path))
    return tuple(out)


def resolve_edges(text: str, config: DraftConfig) -> tuple[int, ...]:
    """``--context-lengths``: comma-separated edges, or ``default`` (docs/context-sweep.md)."""
    return default_edges(config) if text == DEFAULT_EDGES else parse_edges(text)


def load_run_corpus(
    model_dir: str | Path,
    corpus: str | None,
    tokenizer: str | None,
    config: DraftConfig,
    target: str | None = None,
) -> Corpus:
    """The corpus file (or the built-in one) tokenized with ``tokenizer`` (default: the
    draft's own tokenizer.json, else ``target``'s, as speculate uses; the path used is
    recorded in the results' ``corpus.tokenizer``)."""
    tok = Path(tokenizer) if tokenizer else Path(model_dir) / "tokenizer.json"
    if not tokenizer and target is not None and not tok.is_file():
        tok = Path(target) / "tokenizer.json"
    if corpus is None:
        return tokenize(builtin_corpus_docs(), tok, config.vocab_size, name=BUILTIN_CORPUS_NAME)
    return load_corpus(corpus, tok, config.vocab_size)


def run_drift(
    settings: DriftSettings,
    *,
    model: str | None = None,
    target: str | None = None,
    tokenizer: str | None = None,
    corpus: str | None = None,
    context_lengths: str | None = None,
    say: Callable[[str], None] | None = None,
    progress: Progress | None = None,
) -> dict:
    """Resolve the defaults, load the corpus and evaluate; returns the results (docs/eval-drift.md).
    ``model`` None: the built-in synthetic draft (built on first use), announced through ``say``."""
    resolve_device(settings.device)  # a missing GPU is one line, before anything is built
    if model is None:
        model = str(builtin_model_dir(say))
        if say is not None:
            say(
                f"No --model given: evaluating the built-in synthetic tiny draft ({model})"
                + (" on the GSM8K test split shipped with qstream." if corpus is None else ".")
            )
    config = load_config(model)
    if context_lengths is not None:
        settings = replace(settings, context_lengths=resolve_edges(context_lengths, config))
    text = load_run_corpus(model, corpus, tokenizer, config, target)
    return evaluate_drift(model, settings, text, target, progress)
