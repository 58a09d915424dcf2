"""Fixtures shared by the evaluation tests: one synthesized tiny draft per test run (read-only:
tests that change a checkpoint copy it first) and the built-in corpus tokenized for it."""

import pytest

from qstream.eval.builtin import builtin_corpus_docs
from qstream.eval.corpus import tokenize
from qstream.model.synth import synth_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("draft") / "tiny", seed=0).output_dir


@pytest.fixture(scope="session")
def corpus(tiny):
    return tokenize(builtin_corpus_docs(), f"{tiny}/tokenizer.json")
