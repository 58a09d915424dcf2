"""Integrity end to end (docs/guarantees.md): ``verify`` says which checks ran and which did not,
and why; a checkpoint whose bytes differ from the sha256 its ``qstream_quantize.json`` records is
refused by ``eval-drift --variant`` and ``card --checkpoint`` (one ``Error:`` line naming the
file, exit 1, nothing written) unless ``--no-integrity-check``, which the results and the card
record; a capture directory is checked against its ``capture.json`` (stream count, per-file
sha256) before any block runs."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from click.testing import CliRunner
from safetensors.torch import save_file

from qstream.arch.dspark_mla import QUANTIZE_INCLUDE, load_config
from qstream.cli import cli
from qstream.quant import quantize_checkpoint

RESULTS = Path(__file__).parent / "data" / "card_results.json"
RECORD = "qstream_quantize.json"
DRIFT = ["--blocks", "8", "--regime", "gauss", "--formats", "bf16"]


@pytest.fixture(scope="module")
def fp8(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "fp8"
    return Path(quantize_checkpoint(tiny, out, "fp8", include=QUANTIZE_INCLUDE).output_dir)


def _copy(directory, tmp_path) -> Path:
    return Path(shutil.copytree(directory, tmp_path / "copy"))


def _flip_fp8_byte(directory: Path) -> str:
    """Flip one bit of the first FP8 weight so that it still decodes to a finite value (E4M3's
    only NaN codes are 0x7F and 0xFF): what only a sha256 can catch.  Returns the file name."""
    shard = directory / "model.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F8_E4M3")
    at = 8 + n + header[name]["data_offsets"][0]
    data[at] ^= 0x02 if (data[at] ^ 0x01) & 0x7F == 0x7F else 0x01
    assert data[at] & 0x7F != 0x7F
    shard.write_bytes(bytes(data))
    return shard.name


def _verify_json(directory, *args) -> dict:
    return json.loads(cli_ok(["verify", str(directory), "--json", "-", *args]).stdout)


# ---------------------------------------------------------------------------------------------
# verify: what ran, what did not


def test_verify_deep_without_a_manifest_says_the_bytes_were_not_checked(fp8, tmp_path):
    directory = _copy(fp8, tmp_path)
    (directory / RECORD).unlink()
    _flip_fp8_byte(directory)
    report = _verify_json(directory, "--deep")
    assert report["ok"]  # it decodes: nothing but a sha256 could tell
    sha = report["checks"]["sha256"]
    assert sha["ran"] is False and f"no {RECORD}" in sha["detail"], sha
    assert "not detected" in sha["detail"], sha
    assert report["checks"]["round_trip"]["ran"] is True
    out = cli_ok(["verify", str(directory), "--deep"]).stdout
    assert out.startswith("OK (sha256 not checked: no qstream_quantize.json): "), out
    assert "not checked: sha256" in out, out


def test_verify_says_which_checks_ran(fp8):
    report = _verify_json(fp8)
    sha = report["checks"]["sha256"]
    recorded = json.loads((fp8 / RECORD).read_text())["files"]
    assert sha == {"ran": True, "detail": f"{len(recorded)} files match {RECORD}"}, sha
    deep = report["checks"]["round_trip"]
    assert deep["ran"] is False and "--deep" in deep["detail"], deep
    assert report["checks"]["vllm_loader"] == {"ran": False, "detail": "--vllm not given"}
    skipped = [name for name, check in report["checks"].items() if not check["ran"]]
    assert skipped == ["round_trip", "vllm_loader"], report["checks"]
    out = cli_ok(["verify", str(fp8)]).stdout
    assert out.startswith("OK: ") and "not checked: round_trip (--deep not given)" in out, out


def test_verify_with_a_manifest_catches_the_flipped_byte(fp8, tmp_path):
    directory = _copy(fp8, tmp_path)
    name = _flip_fp8_byte(directory)
    result = CliRunner().invoke(cli, ["verify", str(directory), "--json", "-"])
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert problems[0].startswith(f"{name}: sha256 "), problems


def test_an_added_shard_is_a_problem_and_an_added_readme_is_not(fp8, tmp_path):
    """A shard quantize did not write changes what loads; a README added to publish does not."""
    directory = _copy(fp8, tmp_path)
    (directory / "README.md").write_text("# my draft\n")
    assert _verify_json(directory)["ok"]
    save_file({"extra.weight": torch.zeros(2, 2)}, directory / "extra.safetensors")
    result = CliRunner().invoke(cli, ["verify", str(directory), "--json", "-"])
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert "extra.safetensors: a weight file quantize did not record (added since)" in problems


# ---------------------------------------------------------------------------------------------
# eval-drift --variant and card --checkpoint refuse a changed checkpoint


def test_eval_drift_refuses_a_variant_that_fails_its_sha256(tiny, fp8, tmp_path):
    directory = _copy(fp8, tmp_path)
    name = _flip_fp8_byte(directory)
    out = tmp_path / "r.json"
    args = ["eval-drift", "--model", str(tiny), *DRIFT, "--variant", f"x={directory}"]
    err = cli_error([*args, "--json", str(out)])
    assert f"--variant x: {directory / name}: sha256 " in err, err
    assert f"recorded in {RECORD}" in err and "--no-integrity-check" in err, err
    assert not out.exists()
    cli_ok([*args, "--no-integrity-check", "--json", str(out)])
    integrity = json.loads(out.read_text())["variants"]["x"]["integrity"]
    assert integrity == {"sha256": "not checked", "why": "--no-integrity-check"}, integrity


def test_eval_drift_records_the_sha256_check_of_an_intact_variant(tiny, fp8, tmp_path):
    out = tmp_path / "r.json"
    cli_ok(
        ["eval-drift", "--model", str(tiny), *DRIFT, "--variant", f"x={fp8}", "--json", str(out)]
    )
    integrity = json.loads(out.read_text())["variants"]["x"]["integrity"]
    files = len(json.loads((fp8 / RECORD).read_text())["files"])
    assert integrity == {"sha256": "checked", "files": files}, integrity


def test_card_refuses_a_checkpoint_that_fails_its_sha256(fp8, tmp_path):
    directory = _copy(fp8, tmp_path)
    name = _flip_fp8_byte(directory)
    card = tmp_path / "CARD.md"
    args = ["card", str(RESULTS), "--checkpoint", str(directory), "--output", str(card)]
    err = cli_error(args)
    assert f"--checkpoint {directory}: {directory / name}: sha256 " in err, err
    assert not card.exists() and not (tmp_path / "CARD_files").exists()
    cli_ok([*args, "--no-figures", "--no-integrity-check"])
    text = card.read_text()
    assert "sha256 not checked (`--no-integrity-check`)" in text, text


def test_card_says_the_sha256_of_a_checkpoint_was_checked(fp8, tmp_path):
    card = tmp_path / "CARD.md"
    cli_ok(["card", str(RESULTS), "--checkpoint", str(fp8), "--output", str(card), "--no-figures"])
    files = len(json.loads((fp8 / RECORD).read_text())["files"])
    assert f"The sha256s of its {files} files match `{RECORD}`." in card.read_text()


# ---------------------------------------------------------------------------------------------
# capture directories against capture.json


def _stream(cfg, path: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    save_file(
        {
            "input_ids": torch.randint(cfg.vocab_size, (40,), generator=gen),
            "aux_hidden_states": torch.randn(40, cfg.aux_size, generator=gen),
            "target_hidden_states": torch.randn(40, cfg.hidden_size, generator=gen),
        },
        path,
    )


def _capture_dir(tiny, root: Path, streams: int = 6, digests: bool = False) -> Path:
    """What ``qstream capture`` writes (qstream layout); ``digests``: with per-file sha256s,
    else as a capture written before they were recorded."""
    cfg = load_config(tiny)
    root.mkdir()
    names = [f"stream-{i:06d}.safetensors" for i in range(streams)]
    for i, name in enumerate(names):
        _stream(cfg, root / name, seed=i)
    record = {
        "layout": "qstream",
        "layer_convention": "layer-output",
        "layer_ids": list(cfg.target_layer_ids),
        "streams": streams,
    }
    if digests:
        record["files"] = {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names}
    (root / "capture.json").write_text(json.dumps(record))
    return root


def _states_args(tiny, states, out) -> list[str]:
    return ["eval-drift", "--model", str(tiny), "--states", str(states), "--blocks", "8",
            "--formats", "bf16", "--json", str(out)]  # fmt: skip


@pytest.mark.parametrize("digests", [False, True], ids=["count", "files"])
def test_a_capture_missing_a_recorded_stream_is_refused(tiny, tmp_path, digests):
    states = _capture_dir(tiny, tmp_path / "states", digests=digests)
    (states / "stream-000003.safetensors").unlink()
    out = tmp_path / "r.json"
    err = cli_error(_states_args(tiny, states, out))
    assert f"{states / 'stream-000003.safetensors'}" in err and "capture.json" in err, err
    assert not out.exists()


@pytest.mark.parametrize("digests", [False, True], ids=["count", "files"])
def test_a_stream_file_capture_json_does_not_record_is_refused(tiny, tmp_path, digests):
    states = _capture_dir(tiny, tmp_path / "states", streams=3, digests=digests)
    _stream(load_config(tiny), states / "stream-000003.safetensors", seed=9)
    out = tmp_path / "r.json"
    err = cli_error(_states_args(tiny, states, out))
    assert f"{states / 'stream-000003.safetensors'}" in err and "capture.json" in err, err
    assert not out.exists()


def test_a_stream_file_failing_its_recorded_sha256_is_refused(tiny, tmp_path):
    states = _capture_dir(tiny, tmp_path / "states", digests=True)
    _stream(load_config(tiny), states / "stream-000002.safetensors", seed=99)  # replaced
    out = tmp_path / "r.json"
    err = cli_error(_states_args(tiny, states, out))
    assert f"{states / 'stream-000002.safetensors'}: sha256 " in err, err
    assert f"recorded in {states / 'capture.json'} (changed since" in err, err
    assert not out.exists()


def test_an_intact_capture_is_read_and_its_check_recorded(tiny, tmp_path):
    states = _capture_dir(tiny, tmp_path / "states", digests=True)
    out = tmp_path / "r.json"
    cli_ok(_states_args(tiny, states, out))
    check = json.loads(out.read_text())["states"]["manifest_check"]
    assert check == {"streams": 6, "sha256": "checked"}, check


def test_capture_records_the_sha256_of_every_stream_file(tmp_path):
    from hf_targets import make_draft_config, make_target

    from qstream.capture.run import CaptureSettings, run_capture
    from qstream.synth.corpus import builtin_corpus

    target = make_target(tmp_path / "target", "llama")
    draft = make_draft_config(tmp_path / "draft")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(builtin_corpus(n=8, seed=3)) + "\n")
    out = tmp_path / "out"
    settings = dict(dtype="float32", max_tokens=24, batch_size=2, corpus=str(corpus))
    run_capture(CaptureSettings(str(target), str(draft), str(out), streams=2, **settings))
    record = json.loads((out / "capture.json").read_text())
    assert record["streams"] == 2 and sorted(record["files"]) == [
        "stream-000000.safetensors",
        "stream-000001.safetensors",
    ]
    for name, digest in record["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    # a capture written before sha256s were recorded gains them when resumed
    del record["files"]
    (out / "capture.json").write_text(json.dumps(record))
    run_capture(CaptureSettings(str(target), str(draft), str(out), streams=3, **settings))
    record = json.loads((out / "capture.json").read_text())
    assert record["streams"] == 3 and len(record["files"]) == 3
