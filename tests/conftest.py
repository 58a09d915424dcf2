"""Fixtures shared by the evaluation tests: one synthesized tiny draft (and one EAGLE-3 draft) per test run (read-only:
tests that change a checkpoint copy it first) and a corpus tokenized for it: generated word
problems held out from the draft's own (seed 1), whose short documents keep the tests fast
(eval-drift's built-in GSM8K test split has contexts ~12x longer)."""

from pathlib import Path

import pytest
from hypothesis import settings

from qstream.eval.corpus import tokenize
from qstream.synth.corpus import builtin_corpus
from qstream.synth.draft import synth_checkpoint

# Property tests draw the same examples on every run (derandomize) and keep no example database
# between runs, so a failure on CI is a failure here too.
settings.register_profile("qstream", derandomize=True, database=None)
settings.load_profile("qstream")

HELD_OUT_SEED = 1  # the draft's tokenizer and Markov statistics saw seed 0's problems


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("draft") / "tiny", seed=0).output_dir


@pytest.fixture(scope="session")
def e3(tmp_path_factory):
    """``synth --preset eagle3-tiny`` (read-only, as ``tiny``)."""
    return Path(synth_checkpoint("eagle3-tiny", tmp_path_factory.mktemp("e3") / "d").output_dir)


@pytest.fixture(scope="session")
def corpus(tiny):
    return tokenize(builtin_corpus(seed=HELD_OUT_SEED), f"{tiny}/tokenizer.json")


@pytest.fixture
def dead_pid() -> str:
    """The pid of a process that has exited (what a SIGKILLed run leaves in its partial's name)."""
    import subprocess
    import sys

    script = "import os; print(os.getpid())"
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny models: on a busy machine torch's intra-op threads cost far more than they gain
    (minutes instead of seconds on two shared cores); torch's setting is restored.  A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
