"""Captured states (--states) and simulated acceptance (--acceptance) end to end on a synthesized
tiny draft: the file format is validated with one-line errors naming the tensor; the states
regime reads its aux states from the file and reports acceptance against the target; the
reference verifying itself accepts every token; greedy acceptance is the matched prefix + 1."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from stand_in_target import capture_states

import qstream.eval.batches as batches
from qstream.arch.dspark_mla import load_config
from qstream.arch.dspark_mla.model import DSpark
from qstream.cli import cli
from qstream.errors import QStreamError
from qstream.eval.corpus import tokenize
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.eval.states import read_states
from qstream.synth.corpus import builtin_corpus

BLOCKS = 48
MODES = ("probabilistic/standard", "probabilistic/block", "greedy/greedy")


@pytest.fixture(scope="module")
def corpus(tiny):
    return tokenize(builtin_corpus(seed=1)[:200], f"{tiny}/tokenizer.json")


@pytest.fixture(scope="module")
def states_file(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("states") / "captured.safetensors"
    capture_states(str(tiny), str(path), n_streams=4, length=40, seed=0)
    return path


def _settings(states_file) -> DriftSettings:
    return DriftSettings(
        regime=("gauss",),
        formats=("fp32", "bf16", "nvfp4"),
        blocks=BLOCKS,
        acceptance=True,
        states=str(states_file),
    )


@pytest.fixture(scope="module")
def results(tiny, corpus, states_file):
    return evaluate_drift(replace(_settings(states_file), model=tiny), corpus)


def test_reference_verifying_itself_accepts_every_token(results):
    for regime in ("gauss", "states"):
        acc = results["regimes"][regime]["variants"]["fp32"]["acceptance"]["reference"]
        for mode in MODES:
            e = acc[mode]["emitted"]
            assert e["value"] == e["hi"] == 8.0, (regime, mode, e)
            # greedy outcomes are 0/1: a Wilson interval, not Student t's zero width
            assert (e["lo"] < 8.0) if mode == "greedy/greedy" else (e["lo"] == 8.0), (
                regime,
                mode,
                e,
            )


def test_greedy_acceptance_is_the_matched_prefix_plus_one(results):
    for name, entry in results["regimes"]["gauss"]["variants"].items():
        ceiling = entry["metrics"]["rollouts"]["greedy"]["ceiling"]["value"]
        emitted = entry["acceptance"]["reference"]["greedy/greedy"]["emitted"]["value"]
        assert emitted == pytest.approx(ceiling + 1, abs=1e-12), name


def test_acceptance_orders_as_precision_and_block_beats_token_wise(results):
    for regime in ("gauss", "states"):
        variants = results["regimes"][regime]["variants"]
        for verifier in ("reference", "target") if regime == "states" else ("reference",):
            emitted = {
                v: {m: variants[v]["acceptance"][verifier][m]["emitted"]["value"] for m in MODES}
                for v in variants
            }
            for v, e in emitted.items():
                assert 1.0 <= min(e.values()) and max(e.values()) <= 8.0, (regime, v, e)
                # per block the block rule's value is never below the token-wise one
                assert e["probabilistic/block"] >= e["probabilistic/standard"], (
                    regime,
                    verifier,
                    v,
                    e,
                )
            if verifier == "reference":
                assert (
                    emitted["bf16"]["probabilistic/block"] > emitted["nvfp4"]["probabilistic/block"]
                )
                loss = variants["nvfp4"]["acceptance"]["reference"]["loss_vs_bf16"]
                assert loss["probabilistic/block"]["lo"] > 0, loss
                assert variants["bf16"]["acceptance"]["reference"]["loss_vs_bf16"] is None


def test_states_regime_reports_the_reference_draft_against_the_target(results, states_file):
    r = results
    assert r["states"]["corpus"] == str(states_file) and r["states"]["streams"] == 4
    assert r["states"]["anchors"]["blocks"] == BLOCKS
    ref = r["regimes"]["states"]["reference_draft"]
    for mode in MODES:
        assert 1.0 <= ref["acceptance"]["target"][mode]["emitted"]["value"] <= 8.0
    # the streams were sampled from the stand-in target at top-p 0.95: none outside its nucleus
    assert ref["stream"]["stream_outside_target_nucleus"]["value"] == 0.0
    assert "acceptance" in r and "block" in r["acceptance"]["rules"]


def test_the_target_verifies_greedy_drafts_and_their_adaptive_trimming(results):
    """Against the target's stream a greedy draft's weight is its matched run (0/1 outcomes,
    the same under both rules); adaptive verification is simulated for the greedy draft only
    (a probabilistic draft's trimming reads the whole drafted block)."""
    variants = results["regimes"]["states"]["variants"]
    for name, entry in [
        *variants.items(),
        ("reference draft", results["regimes"]["states"]["reference_draft"]),
    ]:
        acc = entry["acceptance"]["target"]
        assert "probabilistic/block+adaptive" not in acc, name
        greedy_draft = acc["greedy/standard"]["emitted"]
        assert acc["greedy/block"]["emitted"] == greedy_draft, name
        adaptive = acc["greedy/standard+adaptive"]
        assert 1.0 <= adaptive["emitted"]["value"] <= greedy_draft["value"], name
        assert adaptive["mode"]["adaptive"] == {"requests": 8, "budget_share": 0.5}
    assert "probabilistic/block+adaptive" in variants["bf16"]["acceptance"]["reference"]


def test_states_aux_come_from_the_file(tiny, states_file):
    states = read_states(states_file, load_config(tiny))
    raw = load_file(states_file)
    aux = states.aux_chunks([2, 0], 50, torch.float32).rows(0, 50)
    assert torch.equal(aux[0, :40], raw["stream.2.aux_hidden_states"].float())
    assert torch.equal(aux[1, :40], raw["stream.0.aux_hidden_states"].float())
    assert bool((aux[:, 40:] == 0).all())
    assert torch.equal(states.streams[1], raw["stream.1.input_ids"])


def test_states_read_in_position_ranges_equal_the_whole(tiny, states_file):
    """A long captured stream's aux rows are read a range at a time (never held whole): the
    ranges give the whole read's rows, rounded to the requested dtype."""
    states = read_states(states_file, load_config(tiny))
    whole = states.aux_chunks([3, 1], 45, torch.float32).rows(0, 45)
    chunks = states.aux_chunks([3, 1], 45, torch.bfloat16)
    assert chunks.shape == tuple(whole.shape)
    edges = [0, 1, 17, 39, 40, 41, 45]
    parts = torch.cat([chunks.rows(a, b) for a, b in zip(edges, edges[1:])], dim=1)
    assert torch.equal(parts, whole.to(torch.bfloat16))


@pytest.mark.slow  # two whole evaluations: CI's slow lane (pyproject.toml)
def test_evaluation_with_states_never_held_whole_is_unchanged(
    tiny, corpus, states_file, results, monkeypatch
):
    monkeypatch.setattr(batches, "LAZY_AUX_BYTES", 0)
    taken: list = []  # what each context projection was handed
    original = DSpark.context

    def recorded(self, aux, *args):
        taken.append(type(aux))
        return original(self, aux, *args)

    monkeypatch.setattr(DSpark, "context", recorded)
    assert evaluate_drift(replace(_settings(states_file), model=tiny), corpus) == results
    assert taken and torch.Tensor not in taken  # every batch's states handed over by range


def _broken(states_file, tmp_path, edit) -> Path:
    tensors = load_file(states_file)
    edit(tensors)
    path = tmp_path / "broken.safetensors"
    save_file(tensors, path)
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.update(
                {
                    "stream.1.aux_hidden_states": t["stream.1.aux_hidden_states"][
                        :, :300
                    ].contiguous()
                }
            ),
            "'stream.1.aux_hidden_states' has shape [40, 300], expected [40, 320]",
        ),
        (
            lambda t: t.update({"stream.0.input_ids": t["stream.0.input_ids"].float()}),
            "'stream.0.input_ids' must be 1-D int32/int64",
        ),
        (
            lambda t: t.pop("stream.2.target_hidden_states"),
            "missing tensor 'stream.2.target_hidden_states'",
        ),
        (
            lambda t: t.update({"stream.0.extra": torch.zeros(2)}),
            "unexpected tensor 'stream.0.extra'",
        ),
        (
            lambda t: t["stream.3.input_ids"].__setitem__(5, 10**6),
            "'stream.3.input_ids' holds ids outside",
        ),
        (
            lambda t: t.update(
                {
                    "stream.1.target_hidden_states": t["stream.1.target_hidden_states"].to(
                        torch.int32
                    )
                }
            ),
            "'stream.1.target_hidden_states' has dtype I32",
        ),
    ],
)
def test_bad_states_files_are_refused_naming_the_tensor(tiny, states_file, tmp_path, edit, message):
    path = _broken(states_file, tmp_path, edit)
    with pytest.raises(QStreamError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_states(path, load_config(tiny))


def test_cli_states_and_acceptance(tiny, states_file, tmp_path):
    runner = CliRunner()
    out = tmp_path / "r.json"
    result = runner.invoke(
        cli,
        [
            "eval-drift",
            "--model",
            str(tiny),
            "--states",
            str(states_file),
            "--formats",
            "bf16",
            "--blocks",
            "16",
            "--acceptance",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert list(data["regimes"]) == ["states"]  # --states alone runs only the captured regime
    assert set(data["regimes"]["states"]["variants"]["bf16"]["acceptance"]) == {
        "reference",
        "target",
    }
    bad = runner.invoke(
        cli, ["eval-drift", "--model", str(tiny), "--states", str(tmp_path / "no"), "--blocks", "8"]
    )
    assert bad.exit_code == 1 and "no such file" in bad.stderr and bad.stderr.count("\n") == 1


def test_states_anchors_file_gives_the_blocks_it_names(tiny, corpus, states_file, tmp_path):
    """The anchors eval-drift drew, written to a file and read back, reproduce its states
    regime exactly; a block out of range or named twice is one line naming the block."""
    from qstream.eval.corpus import sample_anchors

    config = load_config(tiny)
    settings = _settings(states_file)
    states = read_states(states_file, config)
    drawn = sample_anchors(
        states,
        BLOCKS,
        config.block_size,
        settings.seed,
        max_context=config.max_position_embeddings - config.block_size,
    )
    blocks = [[int(s), int(a)] for s, a in zip(drawn.stream, drawn.anchor)]
    path = tmp_path / "anchors.json"
    path.write_text(json.dumps({"blocks": blocks[::-1]}))  # order does not matter
    from dataclasses import replace

    named = evaluate_drift(
        replace(settings, model=tiny, regime=(), states_anchors=str(path)), corpus
    )
    uniform = evaluate_drift(replace(settings, model=tiny, regime=()), corpus)
    assert named["regimes"]["states"] == uniform["regimes"]["states"]
    assert named["states"]["anchors"]["blocks"] == BLOCKS

    length = int(states.streams[0].numel())
    for bad, message in [
        ([[0, length - config.block_size]], "an anchor needs 1 <= anchor <"),
        ([[0, 0]], "an anchor needs 1 <= anchor <"),
        ([[9, 3]], "has 4 streams"),
        ([[0, 3], [0, 3]], "named twice"),
    ]:
        path.write_text(json.dumps({"blocks": bad}))
        with pytest.raises(QStreamError, match=message):
            evaluate_drift(
                replace(settings, model=tiny, regime=(), states_anchors=str(path)), corpus
            )
    path.write_text("{}")
    result = CliRunner().invoke(
        cli,
        ["eval-drift", "--model", str(tiny), "--states", str(states_file),
         "--states-anchors", str(path)],
    )  # fmt: skip
    assert result.exit_code == 1 and "expected {" in result.stderr
    assert result.stderr.count("\n") == 1
