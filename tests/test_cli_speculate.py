"""``qstream speculate`` end to end (docs/speculate.md, "Command"): a tiny transformers Qwen3
target with a real tokenizer, a Qwen3-style DSpark draft shaped for it (``synth --target``) in
speculators' saved layout, borrowing the target's embed_tokens and lm_head, and an NVFP4
checkpoint of it written by ``qstream quantize``.  The JSON is whole and consistent, greedy
verification emits the target's own greedy decoding, the read-back checkpoint decodes as its
simulated format does, the same seed gives the same JSON, and bad inputs are one line."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from chat_targets import speculate_emits_target_greedy, with_chat_template
from cli_helpers import cli_error, cli_ok
from hf_targets import VOCAB, make_qwen3_target
from qwen3_drafts import speculators_config
from safetensors.torch import load_file, save_file

from qstream.arch.registry import load_config
from qstream.capture.target import load_target
from qstream.speculate.run import PROMPT
from qstream.verification import GREEDY

QUESTIONS = (
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "A box holds 12 pens. How many pens are in 3 boxes?",
    "Sara reads 5 pages a day. How many pages does she read in a week?",
)
NEW_TOKENS = 16


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _shared_direction(target: Path) -> None:
    """Add to every lm_head row one direction, scaled per token: target and draft read the same
    lm_head, so both then favour the same few tokens and some drafts are accepted (with the
    random weights alone none is)."""
    path = target / "model.safetensors"
    tensors = load_file(path)
    head = tensors["lm_head.weight"]
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(head.shape[1], generator=gen)
    scale = 3 * torch.randn(head.shape[0], generator=gen)
    tensors["lm_head.weight"] = (head.float() + scale[:, None] * (u / u.norm())).to(head.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft, its NVFP4 checkpoint, corpus)."""
    root = tmp_path_factory.mktemp("speculate")
    target = make_qwen3_target(root / "target")
    _shared_direction(target)
    draft = root / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(draft)])
    config = load_config(draft)
    (draft / "config.json").write_text(json.dumps(speculators_config(config), indent=2))
    nvfp4 = root / "draft-nvfp4"
    cli_ok(["quantize", "--model_dir", str(draft), "--output_dir", str(nvfp4),
            "--quant_format", "nvfp4"])  # fmt: skip
    corpus = root / "questions.jsonl"
    rows = [{"question": q, "answer": "It is done.\n#### 0"} for q in QUESTIONS]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target, draft, nvfp4, corpus


def _args(pair, *extra: str) -> list[str]:
    target, draft, _, corpus = pair
    return ["speculate", "--target", str(target), "--model", str(draft), "--corpus", str(corpus),
            "--prompts", "3", "--new-tokens", str(NEW_TOKENS), "--dtype", "float32", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def results(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "spec.json"
    run = cli_ok(_args(pair, "--formats", "bf16,nvfp4", "--variant", f"shipped={pair[2]}",
                       "--json", str(out)))  # fmt: skip
    assert "mean acceptance length" in run.stdout and "shipped" in run.stdout
    return json.loads(out.read_text())


def test_the_json_is_whole_and_consistent(pair, results):
    target, draft, _, corpus = pair
    assert results["schema"] == "qstream.speculate/2"
    settings = results["settings"]
    assert (settings["prompts"], settings["new_tokens"], settings["rule"]) == (3, 16, GREEDY.name)
    where = results["provenance"]
    sha = hashlib.sha256((target / "config.json").read_bytes()).hexdigest()
    assert where["target"]["config_sha256"] == sha
    assert where["draft"]["path"] == str(draft) and where["draft"]["block_size"] == 7
    assert where["corpus"]["name"] == str(corpus) and len(where["corpus"]["sha256"]) == 64
    assert where["qstream_version"]
    assert list(results["variants"]) == list(results["runs"]) == ["bf16", "nvfp4", "shipped"]
    for name, entry in results["variants"].items():
        summary, runs = entry["summary"], results["runs"][name]
        shares = [s["value"] for s in summary["accepted_at_least"]]
        mean = summary["mean_acceptance_length"]["value"]
        assert mean == pytest.approx(1 + sum(shares), rel=1e-12)
        assert summary["prompts"] == len(runs) == 3
        assert summary["verifications"] == sum(len(r["accepted"]) for r in runs)
        emitted = sum(a + 1 for r in runs for a in r["accepted"])
        assert mean == pytest.approx(emitted / summary["verifications"], rel=1e-12)
        forwards = sum(1 + len(r["accepted"]) for r in runs)
        per_forward = summary["tokens_per_target_forward"]["value"]
        assert per_forward == pytest.approx(3 * NEW_TOKENS / forwards, rel=1e-12)
        for i, run in enumerate(runs):
            assert run["document"] == i and len(run["tokens"]) == NEW_TOKENS
            # the first anchor is the prefill's token; each step moves it by what it emitted
            anchors, accepted = run["anchors"], run["accepted"]
            assert anchors[0] == run["prompt_tokens"] and len(anchors) == len(accepted)
            assert all(b - a == n + 1 for a, b, n in zip(anchors, anchors[1:], accepted))
    assert any(r["accepted"] != [0] * len(r["accepted"]) for r in results["runs"]["bf16"])
    means = {n: e["summary"]["mean_acceptance_length"]["value"]
             for n, e in results["variants"].items()}  # fmt: skip
    for name, entry in results["variants"].items():
        loss = entry["summary"]["loss_vs_bf16"]
        assert loss["value"] == pytest.approx(means["bf16"] - means[name], abs=1e-12)
    assert results["variants"]["bf16"]["summary"]["loss_vs_bf16"] == {
        "value": 0.0, "lo": 0.0, "hi": 0.0, "n": 3}  # fmt: skip


def test_greedy_verification_emits_the_targets_greedy_decoding(pair, results):
    from qstream.speculate.decode import target_greedy

    target = load_target(pair[0], torch.float32)
    for i, question in enumerate(QUESTIONS):
        prompt = target.tokenizer(question + "\n", add_special_tokens=False)["input_ids"]
        greedy = target_greedy(target.model, prompt, NEW_TOKENS)
        for name, runs in results["runs"].items():
            assert runs[i]["prompt_tokens"] == len(prompt)
            assert runs[i]["tokens"] == greedy, name


def test_chat_template_prompts_decode_to_the_targets_greedy_continuation(pair, tmp_path):
    """--apply-chat-template: each question one user turn through the target's template; the
    default's prompts (the bare question) are not what it decodes from."""
    target, draft, _, corpus = pair
    chat = with_chat_template(target, tmp_path / "chat-target")
    out = tmp_path / "chat.json"
    results = speculate_emits_target_greedy(chat, draft, corpus, out, 2, 8, "--formats", "bf16")
    assert results["settings"]["prompt"] != PROMPT
    bare = len(load_target(target, torch.float32).tokenizer(QUESTIONS[0] + "\n")["input_ids"])
    assert results["runs"]["bf16"][0]["prompt_tokens"] > bare


def test_chat_template_without_one_is_one_line(pair, tmp_path):
    out = tmp_path / "spec.json"
    refused = cli_error(_args(pair, "--apply-chat-template", "--json", str(out)))
    assert f"the target's tokenizer ({pair[0]}) has no chat template" in refused
    assert not out.exists()


def test_the_read_back_checkpoint_decodes_as_its_simulated_format(pair, results):
    """quantize writes exactly the weights the simulation makes (36 tensors, bit for bit), so the
    checkpoint drafts the same blocks: the same summary and the same runs."""
    from qstream.arch.registry import architecture_of
    from qstream.eval.settings import Selection
    from qstream.eval.variants import Variant, variant_weights

    target, draft, checkpoint, _ = pair
    config = load_config(draft)
    arch = architecture_of(config)
    weights = arch.load_weights(draft, target, config)
    selection = Selection(include_layers=arch.quantize_include)
    simulated, _ = variant_weights(Variant("nvfp4", "simulated", "nvfp4"), weights, config,
                                   selection, str(target))  # fmt: skip
    read_back, _ = variant_weights(Variant("shipped", "checkpoint", str(checkpoint)), weights,
                                   config, selection, str(target))  # fmt: skip
    assert simulated.keys() == read_back.keys()
    for name, w in simulated.items():
        assert w.dtype == read_back[name].dtype and torch.equal(w, read_back[name]), name
    shipped, nvfp4 = results["variants"]["shipped"], results["variants"]["nvfp4"]
    assert (shipped["kind"], nvfp4["kind"]) == ("checkpoint", "simulated")
    assert "integrity" in shipped
    assert shipped["quantized_tensors"] == nvfp4["quantized_tensors"]
    assert len(nvfp4["quantized_tensors"]) == 36
    assert shipped["summary"] == nvfp4["summary"]
    assert results["runs"]["shipped"] == results["runs"]["nvfp4"]
    assert results["runs"]["nvfp4"] != results["runs"]["bf16"], "the formats must differ"


def test_the_same_seed_gives_the_same_json(pair):
    """Also: --rule's old value is the mode it names now, with one warning line saying so."""
    args = _args(pair, "--formats", "bf16", "--rule", "probabilistic/standard", "--new-tokens",
                 "8", "--temperature", "0.7", "--json", "-")  # fmt: skip
    old = cli_ok([*args, "--rule", "probabilistic"])
    assert old.stderr == "Warning: 'probabilistic' is deprecated; use 'probabilistic/standard'\n"
    first, second = json.loads(cli_ok(args).stdout), json.loads(old.stdout)
    assert first == second and first["settings"]["rule"] == "probabilistic/standard"
    other = json.loads(cli_ok([*args, "--seed", "5"]).stdout)
    assert other["runs"] != first["runs"]


def _target_with(tmp_path: Path, target: Path, **changes) -> Path:
    """A target directory holding only its config.json, with ``changes``: the draft is checked
    against it before anything is loaded."""
    fake = tmp_path / "fake-target"
    fake.mkdir()
    config = json.loads((target / "config.json").read_text())
    (fake / "config.json").write_text(json.dumps({**config, **changes}))
    return fake


def test_bad_inputs_are_one_line_and_write_nothing(pair, tmp_path):
    target, draft, nvfp4, corpus = pair
    out = tmp_path / "spec.json"

    def error(*args: str) -> str:
        return cli_error([*args, "--json", str(out)])

    def run(target=target, model=draft, *extra: str) -> list[str]:
        return ["speculate", "--target", str(target), "--model", str(model),
                "--corpus", str(corpus), *extra]  # fmt: skip

    wide = _target_with(tmp_path, target, vocab_size=VOCAB + 64)
    assert f"draft vocab_size = {VOCAB} does not match the target's vocab_size = {VOCAB + 64}" in (
        error(*run(wide))
    )
    (wide / "config.json").write_text(
        json.dumps({**json.loads((target / "config.json").read_text()), "hidden_size": 32})
    )
    assert "draft target_hidden_size = 64 does not match the target's hidden_size = 32" in (
        error(*run(wide))
    )
    assert f"--model {nvfp4} is a quantized checkpoint" in error(*run(model=nvfp4))
    bad = _reduced_draft(pair, tmp_path / "bad-d2t", torch.arange(VOCAB // 2) * 2)
    d2t = load_file(bad / "model.safetensors")["d2t"]
    d2t[3] = VOCAB
    save_file({**load_file(bad / "model.safetensors"), "d2t": d2t}, bad / "model.safetensors")
    assert f"d2t[3] = {VOCAB} maps draft id 3 to target id {VOCAB + 3}, outside" in (
        error(*run(model=bad))
    )
    assert "--variant x: " in error(*run(target, draft, "--variant", f"x={tmp_path / 'none'}"))
    assert "variant names must be unique" in error(
        *run(target, draft, "--formats", "nvfp4", "--variant", f"nvfp4={nvfp4}")
    )
    assert "nothing to evaluate" in error(*run(target, draft, "--formats", ""))
    assert "cannot read corpus" in error(*run(target, draft, "--corpus", str(tmp_path / "no.txt")))
    assert not out.exists()


def test_activation_variants_decode_after_their_calibration(pair, tmp_path):
    """Quantized activations are served in the decoder too, and a calibrated KV cache; the
    static scales calibrated on the documents after the decoded prompts, which the corpus must
    hold (one line, nothing written, when it does not)."""
    target, draft, _, corpus = pair
    out = tmp_path / "spec.json"
    formats = ("fp8,fp8+a=fp8-dynamic,fp8+a=fp8-static,nvfp4+a=nvfp4,"
               "bf16+kv=fp8+kvscale=calibrated,bf16+head=nvfp4")  # fmt: skip
    args = ["speculate", "--target", str(target), "--model", str(draft), "--corpus", str(corpus),
            "--new-tokens", str(NEW_TOKENS), "--dtype", "float32", "--formats", formats,
            "--json", str(out)]  # fmt: skip
    assert "calibrating scales needs documents after the --prompts 3" in cli_error(
        [*args, "--prompts", "3"]
    )
    assert not out.exists()
    cli_ok([*args, "--prompts", "2"])
    results = json.loads(out.read_text())
    assert results["calibration"]["documents"] == [2, 3]
    variants = results["variants"]
    assert "configuration" not in variants["fp8"]
    assert variants["nvfp4+a=nvfp4"]["configuration"]["activations"] == "nvfp4"
    assert variants["bf16+kv=fp8+kvscale=calibrated"]["configuration"]["kv_scale"] == "calibrated"
    assert variants["bf16+head=nvfp4"]["configuration"]["head"] == "nvfp4"
    for entry in variants.values():
        assert 1 <= entry["summary"]["mean_acceptance_length"]["value"] <= 8


def test_bad_option_values_are_usage_errors(pair, tmp_path):
    from click.testing import CliRunner

    from qstream.cli import cli

    out = tmp_path / "spec.json"
    for extra in (["--new-tokens", "1"], ["--prompts", "0"], ["--rule", "nucleus"],
                  ["--formats", "int4"], ["--temperature", "0"]):  # fmt: skip
        result = CliRunner().invoke(cli, _args(pair, *extra, "--json", str(out)))
        assert result.exit_code == 2, result.output
        assert extra[0] in result.stderr and "Traceback" not in result.output
    assert not out.exists()


def test_eval_drift_at_the_decoders_anchors_measures_what_it_measured(pair, tmp_path):
    """``--capture``: eval-drift's greedy acceptance against the target, at the anchors each
    variant's decoder visited, is the decoder's mean acceptance length (the same blocks, the
    same draft, the same target): the two agree block for block."""
    target, draft, _, _ = pair
    out, capture = tmp_path / "spec.json", tmp_path / "capture"
    cli_ok(_args(pair, "--formats", "bf16,nvfp4", "--capture", str(capture), "--json", str(out)))
    measured = json.loads(out.read_text())
    assert sorted(p.name for p in capture.glob("anchors-*.json")) == [
        "anchors-bf16.json", "anchors-nvfp4.json"]  # fmt: skip
    for name in ("bf16", "nvfp4"):
        drift = tmp_path / f"drift-{name}.json"
        cli_ok(["eval-drift", "--model", str(draft), "--target", str(target),
                "--states", str(capture), "--states-anchors", str(capture / f"anchors-{name}.json"),
                "--formats", name, "--acceptance", "--json", str(drift)])  # fmt: skip
        data = json.loads(drift.read_text())
        plan = capture / f"anchors-{name}.json"
        recorded = data["states"]["anchors"]  # named blocks: the results say which file
        assert recorded["file"] == str(plan)
        assert recorded["file_sha256"] == hashlib.sha256(plan.read_bytes()).hexdigest()
        regime = data["regimes"]["states"]
        emitted = regime["variants"][name]["acceptance"]["target"][GREEDY.name]["emitted"]
        summary = measured["variants"][name]["summary"]
        assert emitted["value"] == pytest.approx(
            summary["mean_acceptance_length"]["value"], abs=1e-9
        ), name
    refused = cli_error(_args(pair, "--rule", "greedy/block", "--capture", str(tmp_path / "c2")))
    assert f"--capture needs --rule {GREEDY.name} (got greedy/block)" in refused
    refused = cli_error(_args(pair, "--capture", str(capture)))
    assert "is not an empty directory" in refused


def test_the_card_puts_measured_acceptance_beside_what_eval_drift_predicted(pair, tmp_path):
    """``card --speculate``: the measured table is speculate's numbers, and the calibration
    table's losses are differences of the eval-drift results' numbers (docs/card.md,
    "Measured acceptance"); speculate results of another draft are refused in one line."""
    target, draft, _, _ = pair
    spec, capture, drift = tmp_path / "spec.json", tmp_path / "capture", tmp_path / "drift.json"
    cli_ok(_args(pair, "--formats", "bf16,nvfp4", "--capture", str(capture), "--json", str(spec)))
    cli_ok(["eval-drift", "--model", str(draft), "--target", str(target), "--states",
            str(capture), "--regime", "gauss", "--formats", "bf16,nvfp4", "--blocks", "48",
            "--acceptance", "--json", str(drift)])  # fmt: skip
    card = tmp_path / "tables.json"
    cli_ok(["card", str(drift), "--speculate", str(spec), "--output", str(card),
            "--format", "json", "--no-figures"])  # fmt: skip
    tables = {t["key"]: t for section in json.loads(card.read_text())["sections"]
              for t in section["tables"]}  # fmt: skip
    measured, results = json.loads(spec.read_text()), json.loads(drift.read_text())["regimes"]
    rows = {row["variant"]: row for row in tables["measured_acceptance"]["rows"]}
    for name in ("bf16", "nvfp4"):
        summary = measured["variants"][name]["summary"]
        assert rows[name]["tokens per verification"] == summary["mean_acceptance_length"]
        assert rows[name]["loss vs bf16"] == summary["loss_vs_bf16"]
    (row,) = tables["calibration"]["rows"]
    assert list(row) == ["variant", "measured loss", "simulated loss (states)",
                         "ceiling loss, gauss", "ceiling loss, states"]  # fmt: skip

    def value(regime, name, *keys):
        node = results[regime]["variants"][name]
        for key in keys:
            node = node[key]
        return node["value"]

    emitted = ("acceptance", "target", GREEDY.name, "emitted")
    ceiling = ("metrics", "rollouts", "greedy", "ceiling")
    assert row["measured loss"] == measured["variants"]["nvfp4"]["summary"]["loss_vs_bf16"]
    simulated = value("states", "bf16", *emitted) - value("states", "nvfp4", *emitted)
    assert row["simulated loss (states)"] == simulated
    for regime in ("gauss", "states"):
        gap = value(regime, "bf16", *ceiling) - value(regime, "nvfp4", *ceiling)
        assert row[f"ceiling loss, {regime}"] == gap
    md = tmp_path / "card.md"
    cli_ok(["card", str(drift), "--speculate", str(spec), "--output", str(md)])
    text = md.read_text()
    assert "## Acceptance with the target in the loop (measured)" in text
    assert "comes from `qstream speculate` results of the same draft" in text
    assert (
        "(card_files/calibration.png)" in text
        and (tmp_path / "card_files" / "calibration.png").is_file()
    )
    other = json.loads(spec.read_text())
    other["provenance"]["draft"]["config_sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    refused = cli_error(["card", str(drift), "--speculate", str(tmp_path / "other.json"),
                         "--output", str(tmp_path / "x.md")])  # fmt: skip
    assert "speculate results of another draft" in refused and "other.json" in refused
    assert not (tmp_path / "x.md").exists()


def _reduced_draft(pair, directory: Path, kept: torch.Tensor) -> Path:
    """The pair's draft cut to the draft vocabulary ``kept`` (target ids, increasing): its own
    lm_head (the target's rows), markov_w2's rows and d2t = kept - draft id, as a
    reduced-vocabulary checkpoint is laid out (docs/qwen3-dspark.md)."""
    target, draft, _, _ = pair
    tensors = load_file(draft / "model.safetensors")
    w2 = "markov_head.markov_w2.weight"
    tensors[w2] = tensors[w2][kept].contiguous()
    tensors["lm_head.weight"] = load_file(target / "model.safetensors")["lm_head.weight"][kept]
    tensors["d2t"] = kept - torch.arange(len(kept))
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = replace(load_config(draft), draft_vocab_size=len(kept))
    (directory / "config.json").write_text(json.dumps(speculators_config(config)))
    return directory


def test_a_reduced_vocabulary_draft_decodes_with_its_ids_mapped(pair, tmp_path):
    """Half the target's vocabulary, the tokens the target decodes among it and the rest of the
    draft ids off their target ids: greedy verification still emits the target's greedy
    decoding, and drafts are accepted only if each drafted id is mapped to its target id;
    probabilistic drafts (q zero off the draft vocabulary) are verified in every mode; and
    eval-drift's greedy acceptance against the target (its own lm_head: the draft's covers half
    the vocabulary) at the decoder's anchors is the decoder's mean acceptance length."""
    from qstream.capture.target import load_target
    from qstream.speculate.decode import target_greedy

    loaded = load_target(pair[0], torch.float32)
    greedy = []
    for question in QUESTIONS:
        prompt = loaded.tokenizer(question + "\n", add_special_tokens=False)["input_ids"]
        greedy.append(target_greedy(loaded.model, prompt, NEW_TOKENS))
    decoded = torch.tensor(sorted({t for g in greedy for t in g}))
    rest = torch.tensor([t for t in range(VOCAB - 1, -1, -1) if t not in set(decoded.tolist())])
    kept = torch.cat((decoded, rest[: VOCAB // 2 - len(decoded)])).sort().values
    reduced = _reduced_draft(pair, tmp_path / "reduced", kept)
    args = ["speculate", "--target", str(pair[0]), "--model", str(reduced), "--corpus",
            str(pair[3]), "--prompts", "3", "--new-tokens", str(NEW_TOKENS), "--dtype",
            "float32", "--formats", "bf16", "--json", "-"]  # fmt: skip
    capture = tmp_path / "capture"
    measured = json.loads(cli_ok([*args, "--capture", str(capture)]).stdout)
    runs = measured["runs"]["bf16"]
    assert [run["tokens"] for run in runs] == greedy
    assert any(a > 0 for run in runs for a in run["accepted"])
    for rule in ("probabilistic/standard", "probabilistic/block"):
        out = json.loads(cli_ok([*args, "--rule", rule, "--temperature", "0.7"]).stdout)
        summary = out["variants"]["bf16"]["summary"]
        assert summary["prompts"] == 3 and 1 <= summary["mean_acceptance_length"]["value"]
        assert all(0 <= t < VOCAB for run in out["runs"]["bf16"] for t in run["tokens"])
    drift = tmp_path / "drift.json"
    cli_ok(["eval-drift", "--model", str(reduced), "--target", str(pair[0]), "--states",
            str(capture), "--states-anchors", str(capture / "anchors-bf16.json"), "--formats",
            "bf16", "--acceptance", "--json", str(drift)])  # fmt: skip
    states = json.loads(drift.read_text())["regimes"]["states"]["variants"]["bf16"]
    emitted = states["acceptance"]["target"][GREEDY.name]["emitted"]["value"]
    summary = measured["variants"]["bf16"]["summary"]
    assert emitted == pytest.approx(summary["mean_acceptance_length"]["value"], abs=1e-9)
