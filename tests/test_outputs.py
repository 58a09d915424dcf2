"""What ``speculate --capture``, ``capture`` and ``card`` write, and what capture's resume accepts
(docs/guarantees.md): a signal ends a run with ``Aborted!``, exit 1 and nothing half-written; a
full disk is one ``Error:`` line naming the output and the file; the capture directory is checked
before any decoding and never lies inside an input; and a resumed capture keeps only stream files
it can vouch for (recorded sha256, this run's metadata), naming the first file it refuses.

Signals are real (a subprocess paused inside the write, then signalled); a full disk is
simulated by making ``fsync`` of a stream file raise ``ENOSPC``, as tests/test_faults.py does.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from checkpoints import tree_digest
from cli_helpers import cli_error, cli_ok
from click.testing import CliRunner
from hf_targets import make_draft_config, make_qwen3_target, make_target

import qstream.speculate.run
from qstream.cli import cli
from qstream.synth.corpus import builtin_corpus

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "data" / "card_results.json"
QUESTIONS = ("Tom has 3 apples and buys 4 more. How many apples does he have?",
             "A box holds 12 pens. How many pens are in 3 boxes?")  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft, corpus) for speculate: a tiny Qwen3 target and a draft synthesized for it."""
    root = tmp_path_factory.mktemp("pair")
    target = make_qwen3_target(root / "target")
    cli_ok(["synth", "--target", str(target), "--output_dir", str(root / "draft")])
    corpus = root / "questions.jsonl"
    corpus.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in QUESTIONS))
    return target, root / "draft", corpus


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, draft, corpus) for capture: a tiny Llama target and a draft config for it."""
    root = tmp_path_factory.mktemp("capture")
    corpus = root / "problems.txt"
    corpus.write_text("\n\n".join(builtin_corpus(n=8, seed=3)) + "\n")
    return make_target(root / "target", "llama"), make_draft_config(root / "draft"), corpus


def _speculate(pair, capture: Path, *extra: str) -> list[str]:
    target, draft, corpus = pair
    return ["speculate", "--target", str(target), "--model", str(draft), "--corpus", str(corpus),
            "--prompts", "2", "--new-tokens", "4", "--formats", "bf16", "--dtype", "float32",
            "--capture", str(capture), *extra]  # fmt: skip


def _capture(tiny, out: Path, streams: int = 3) -> list[str]:
    target, draft, corpus = tiny
    return ["capture", "--target", str(target), "--model", str(draft), "--output", str(out),
            "--corpus", str(corpus), "--dtype", "float32", "--max-tokens", "24",
            "--streams", str(streams), "--batch-size", "3"]  # fmt: skip


def _error(args: list[str]) -> str:
    """:func:`cli_error` for a failure after the target has loaded: transformers' own
    "Loading weights" bar is on stderr before the one ``Error:`` line (its last)."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if "Error: " in line]
    assert len(errors) == 1 and result.stderr.endswith(errors[0] + "\n"), result.stderr
    return errors[0][errors[0].index("Error: ") :]


def _litter(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if ".qstream-" in p.name)


def _signalled(args: list[str], pause: str, signum: int) -> subprocess.CompletedProcess:
    """Run ``qstream ARGS`` in a subprocess that pauses (prints ready, sleeps) inside ``pause``,
    a script body given ``real`` (the patched callable) and ``hold()``; then send ``signum``."""
    script = (
        textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it
        def hold():
            print("ready", flush=True)
            time.sleep(60)
    """)
        + textwrap.dedent(pause)
        + textwrap.dedent(f"""
        from qstream.entry import main
        sys.argv = ["qstream", *{args!r}]
        main()
    """)
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    ready = proc.stdout.readline().strip()
    if ready == "ready":
        proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert ready == "ready", err
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]

# ------------------------------------------------------------------ 1. signals while writing


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_while_speculate_writes_its_capture_leaves_nothing(pair, tmp_path, signum):
    pause = """
        import qstream.speculate.run as sc
        real = sc.write_batch
        def write_batch(*args, **kwargs):
            real(*args, **kwargs)
            hold()
        sc.write_batch = write_batch
    """
    run = _signalled(_speculate(pair, tmp_path / "cap"), pause, signum)
    assert run.returncode == 1 and run.stderr.rstrip().endswith("Aborted!"), run.stderr
    assert "Traceback" not in run.stderr and sorted(os.listdir(tmp_path)) == []


def test_sigterm_while_speculate_decodes_is_aborted(pair, tmp_path):
    pause = """
        import qstream.speculate.run as sr
        def decode_prompts(*args, **kwargs):
            hold()
        sr.decode_prompts = decode_prompts
    """
    run = _signalled(_speculate(pair, tmp_path / "cap"), pause, signal.SIGTERM)
    assert run.returncode == 1 and run.stderr.rstrip().endswith("Aborted!"), run.stderr
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_card_writes_leaves_nothing(tmp_path, signum):
    pause = """
        import qstream.card.document as co
        real = co._build
        def _build(*args, **kwargs):
            written = real(*args, **kwargs)
            hold()
            return written
        co._build = _build
    """
    args = ["card", str(RESULTS), "--output", str(tmp_path / "CARD.json"), "--format", "json",
            "--no-figures"]  # fmt: skip
    run = _signalled(args, pause, signum)
    assert run.returncode == 1 and run.stderr.rstrip().endswith("Aborted!"), run.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_sigterm_while_capture_writes_its_record_leaves_no_partial(tiny, tmp_path):
    pause = """
        real = os.fsync
        def fsync(fd):
            real(fd)
            if ".capture.json.qstream-partial-" in os.readlink(f"/proc/self/fd/{fd}"):
                hold()
        os.fsync = fsync
    """
    out = tmp_path / "out"
    run = _signalled(_capture(tiny, out), pause, signal.SIGTERM)
    assert run.returncode == 1 and run.stderr.rstrip().endswith("Aborted!"), run.stderr
    assert _litter(tmp_path) == []


def test_capture_removes_what_killed_runs_left(tiny, tmp_path, dead_pid):
    out = tmp_path / "out"
    cli_ok(_capture(tiny, out, streams=1))
    stale = [out / f".capture.json.qstream-partial-{dead_pid}",
             out / f".stream-000001.safetensors.qstream-partial-{dead_pid}"]  # fmt: skip
    for path in stale:
        path.write_bytes(b"half")
    run = cli_ok(_capture(tiny, out, streams=2))
    for path in stale:
        assert f"Notice: removed {path}, left by an interrupted run" in run.stderr
    assert (
        _litter(tmp_path) == [] and json.loads((out / "capture.json").read_text())["streams"] == 2
    )


# ------------------------------------------------------------------ 2. a full disk


@pytest.fixture
def full_disk_at_streams(monkeypatch):
    """ENOSPC when a stream file is synced to disk (the write a full disk fails)."""
    real = os.fsync

    def fsync(fd):
        if ".safetensors" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_during_speculate_capture_is_one_line_and_nothing(
    pair, tmp_path, full_disk_at_streams
):
    cap = tmp_path / "cap"
    err = _error(_speculate(pair, cap))
    assert f"{cap / 'stream-000000.safetensors'}: No space left on device" in err
    assert "nothing was written" in err and ".qstream-" not in err
    assert sorted(os.listdir(tmp_path)) == []


def test_a_full_disk_during_capture_is_one_line_and_no_partial(
    tiny, tmp_path, full_disk_at_streams
):
    out = tmp_path / "out"
    err = _error(_capture(tiny, out))
    assert f"{out / 'stream-000000.safetensors'}: No space left on device" in err
    assert _litter(tmp_path) == [] and sorted(os.listdir(out)) == ["capture.json"]


# ------------------------------------------------------------------ 3, 4. checked before decoding


@pytest.fixture
def no_decoding(monkeypatch):
    def decode_prompts(*args, **kwargs):
        pytest.fail("decoding started before --capture was checked")

    monkeypatch.setattr(qstream.speculate.run, "decode_prompts", decode_prompts)


@pytest.mark.parametrize("inside", ["--model", "--target"])
def test_speculate_capture_inside_an_input_is_refused(pair, tmp_path, no_decoding, inside):
    target, draft, _ = pair
    source = draft if inside == "--model" else target
    before = tree_digest(source)
    cap = source / "cap"
    err = cli_error(_speculate(pair, cap))
    assert f"--capture {cap} is inside {inside} {source}; the input is never modified" in err
    assert tree_digest(source) == before and not cap.exists()


def test_speculate_capture_parent_is_checked_before_decoding(
    pair, tmp_path, no_decoding, monkeypatch
):
    cap = tmp_path / "no" / "cap"
    err = cli_error(_speculate(pair, cap))
    assert err.startswith(f"Error: --capture {cap}: parent directory {cap.parent} does not exist")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    real = os.access  # root writes anywhere: simulate what an unprivileged user meets
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real(path, mode))
    err = cli_error(_speculate(pair, locked / "cap"))
    assert f"--capture {locked / 'cap'}: parent directory {locked} is not writable" in err


# ------------------------------------------------------------------ 6, 7, 8. what resume accepts


@pytest.fixture
def captured(tiny, tmp_path) -> Path:
    out = tmp_path / "out"
    cli_ok(_capture(tiny, out))
    return out


def test_resume_refuses_a_stream_copied_under_another_name(tiny, captured):
    copy = captured / "stream-000003.safetensors"
    copy.write_bytes((captured / "stream-000000.safetensors").read_bytes())
    err = _error(_capture(tiny, captured, streams=4))
    assert f"{copy}: its metadata says document " in err and "move it out" in err


def test_resume_refuses_an_edited_recorded_stream(tiny, captured):
    path = captured / "stream-000001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    err = _error(_capture(tiny, captured))
    assert f"{path}: sha256 " in err and "recorded in" in err


@pytest.mark.parametrize("name", ["stream-000001.safetensors", "stream-000007.safetensors"])
def test_resume_refuses_a_garbage_stream_file(tiny, captured, name):
    path = captured / name
    path.unlink(missing_ok=True)  # stream 1 unrecorded, as if its run had been killed
    record = json.loads((captured / "capture.json").read_text())
    record["files"].pop(name, None)
    (captured / "capture.json").write_text(json.dumps(record))
    path.write_bytes(b"garbage")
    err = _error(_capture(tiny, captured))
    assert err.startswith(f"Error: {path}: ") and "move it out" in err


@pytest.mark.parametrize("text", ["[]", '"capture"', "{}", "files"])
def test_resume_names_a_malformed_record(tiny, captured, text):
    record = captured / "capture.json"
    if text == "files":
        text = json.dumps({**json.loads(record.read_text()), "files": []})
    record.write_text(text)
    err = cli_error(_capture(tiny, captured))
    assert err.startswith(f"Error: {record}: ") and "Traceback" not in err
