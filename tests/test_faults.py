"""Fault injection for eval-drift's and card's outputs (docs/guarantees.md): a bad output path, a
full disk, a permission error, a results file with a missing or null key, a user file in the
way.  Each case asserts one ``Error:`` line, exit status 1, the inputs unchanged, and no litter.

A full filesystem is simulated by making a write raise ``OSError(ENOSPC)``: a real small
filesystem (a tiny tmpfs) needs a mount, which tests cannot do.  Permission errors are real
where the tests run unprivileged and simulated (the write raises ``PermissionError``) otherwise.
"""

import errno
import json
import os
from pathlib import Path

import pytest
from cli_helpers import cli_error, cli_ok

import qstream.card.build
import qstream.card.document
import qstream.cli
import qstream.errors
from qstream.card.document import MARKER

DATA = Path(__file__).parent / "data"
RESULTS = DATA / "card_results.json"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """RESULTS cut to one regime and two variants: these tests are about where the card's files
    go, not what they say, and a card of the whole file draws its figures for ~3 s each time."""
    data = json.loads(RESULTS.read_text())
    keep = ("bf16", "fp8")
    data["regimes"] = {"heavy": data["regimes"]["heavy"]}
    data["regimes"]["heavy"]["variants"] = {
        name: entry for name, entry in data["regimes"]["heavy"]["variants"].items() if name in keep
    }
    data["variants"] = {name: entry for name, entry in data["variants"].items() if name in keep}
    path = tmp_path_factory.mktemp("results") / "results.json"
    path.write_text(json.dumps(data))
    return path


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --------------------------------------------------------------------------- card --output


def test_card_refuses_a_user_file_without_overwrite(tmp_path, results):
    notes = tmp_path / "CARD.md"
    notes.write_text("my own notes\n")
    err = cli_error(["card", str(results), "--output", str(notes)])
    assert f"--output {notes} already exists and is not a card qstream wrote" in err
    assert "use --overwrite" in err
    assert notes.read_text() == "my own notes\n" and _names(tmp_path) == ["CARD.md"]
    cli_ok(["card", str(results), "--output", str(notes), "--overwrite"])
    assert MARKER in notes.read_text().splitlines()[0]


@pytest.mark.parametrize("fmt", ["md", "json", "html"])
def test_a_card_qstream_wrote_is_replaced_without_asking(tmp_path, results, fmt):
    out = tmp_path / f"card.{fmt}"
    cli_ok(["card", str(results), "--output", str(out), "--format", fmt])
    cli_ok(["card", str(results), "--output", str(out), "--format", fmt])
    assert _names(tmp_path) == sorted([out.name, "card_files"])
    if fmt == "json":
        assert json.loads(out.read_text())["generated_by"] == MARKER


def test_card_refuses_a_user_directory_where_its_figures_go(tmp_path, results):
    photos = tmp_path / "CARD_files"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"\xff\xd8")
    err = cli_error(["card", str(results), "--output", str(tmp_path / "CARD.md"), "--overwrite"])
    assert "CARD_files is in the way of the card's figures" in err and "holiday.jpg" in err
    assert _names(tmp_path) == ["CARD_files"] and _names(photos) == ["holiday.jpg"]


def _broken(tmp_path: Path, regime: str, variant: str, key: str, null: bool) -> Path:
    data = json.loads(RESULTS.read_text())
    metrics = data["regimes"][regime]["variants"][variant]["metrics"]
    if null:
        metrics[key] = None
    else:
        del metrics[key]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("null", [False, True], ids=["missing", "null"])
def test_card_names_the_file_and_key_of_malformed_results(tmp_path, null):
    broken = _broken(tmp_path, "heavy", "fp8", "rollouts", null)
    before = broken.read_bytes()
    err = cli_error(["card", str(broken), "--output", str(tmp_path / "CARD.md")])
    assert f"{broken}: results have a missing or null key " in err
    assert "'regimes.heavy.variants.fp8.metrics.rollouts" in err
    assert broken.read_bytes() == before and _names(tmp_path) == ["broken.json"]


def _old_card(tmp_path: Path, results: Path) -> tuple[Path, dict]:
    out = tmp_path / "CARD.md"
    cli_ok(["card", str(results), "--output", str(out)])
    files = [out, *sorted((tmp_path / "CARD_files").iterdir())]
    return out, {p: p.read_bytes() for p in files}


def test_disk_full_while_drawing_keeps_the_old_card_and_figures(tmp_path, results, monkeypatch):
    out, before = _old_card(tmp_path, results)

    def half_then_full(rs, directory, speculate=None):
        directory.mkdir()
        (directory / "seq_agree.png").write_bytes(b"half")
        _disk_full()

    monkeypatch.setattr(qstream.card.build, "write_figures", half_then_full)
    err = cli_error(["card", str(results), "--output", str(out)])
    assert f"cannot write --output {out}: No space left on device" in err
    assert {p: p.read_bytes() for p in before} == before
    assert _names(tmp_path) == ["CARD.md", "CARD_files"]


def test_disk_full_writing_the_card_publishes_nothing(tmp_path, results, monkeypatch):
    monkeypatch.setattr(qstream.card.document.os, "replace", _disk_full)
    err = cli_error(["card", str(results), "--output", str(tmp_path / "CARD.md")])
    assert "No space left on device" in err
    assert _names(tmp_path) == []


def test_disk_full_publishing_the_card_puts_the_old_figures_back(tmp_path, results, monkeypatch):
    out, before = _old_card(tmp_path, results)
    monkeypatch.setattr(qstream.card.document.os, "replace", _disk_full)
    assert "No space left on device" in cli_error(["card", str(results), "--output", str(out)])
    assert {p: p.read_bytes() for p in before} == before
    assert _names(tmp_path) == ["CARD.md", "CARD_files"]


def test_a_killed_card_run_leaves_nothing_after_the_next_run(tmp_path, results, dead_pid):
    dead = dead_pid
    stale = tmp_path / f".CARD.md.qstream-partial-{dead}"  # what SIGKILL mid-card leaves
    (stale / "figures").mkdir(parents=True)
    result = cli_ok(["card", str(results), "--output", str(tmp_path / "CARD.md")])
    assert f"Notice: removed {stale}" in result.stderr
    assert _names(tmp_path) == ["CARD.md", "CARD_files"]


def test_card_to_a_missing_directory_fails_before_reading_results(tmp_path):
    err = cli_error(["card", str(tmp_path / "absent.json"), "--output", str(tmp_path / "no/c.md")])
    assert "directory" in err and "does not exist" in err and _names(tmp_path) == []


# --------------------------------------------------------------------------- --json


@pytest.mark.parametrize("where", ["missing parent", "a directory"])
def test_eval_drift_json_path_is_checked_before_any_work(tmp_path, monkeypatch, where):
    def no_work(*args, **kwargs):
        pytest.fail("the computation started before --json was checked")

    monkeypatch.setattr(
        "qstream.eval.drift.evaluate_drift", no_work
    )  # eval-drift imports it when run
    path = tmp_path / "no" / "r.json" if where == "missing parent" else tmp_path
    err = cli_error(["eval-drift", "--json", str(path)])
    assert f"--json {path}:" in err


def test_json_to_an_unwritable_directory_is_refused(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: simulate what an unprivileged user meets
        monkeypatch.setattr(qstream.cli.os, "access", lambda path, mode: False)
    err = cli_error(["formats", "--json", str(locked / "r.json")])
    assert f"--json {locked / 'r.json'}: directory {locked} is not writable" in err
    assert _names(locked) == []


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EACCES])
def test_write_json_fault_keeps_the_old_file_and_leaves_no_litter(tmp_path, monkeypatch, fault):
    old = tmp_path / "r.json"
    old.write_text('{"old": true}\n')

    def failing(*args, **kwargs):
        raise OSError(fault, os.strerror(fault))

    monkeypatch.setattr(qstream.cli.os, "fsync", failing)
    with pytest.raises(
        qstream.errors.QStreamError, match=f"cannot write --json {old}: {os.strerror(fault)}"
    ):
        qstream.cli.write_json({"new": [1, 2]}, str(old))
    assert old.read_text() == '{"old": true}\n' and _names(tmp_path) == ["r.json"]
