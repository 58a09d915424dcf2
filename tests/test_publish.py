"""qstream.publish: output directories appear complete or not at all, exclusively, replace only
what qstream wrote, and leave no litter on errors and signals (docs/guarantees.md)."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from checkpoints import tree_digest

from qstream.errors import QStreamError
from qstream.publish import is_qstream_output, publishing, remove_stale_partials, write_json_atomic


def _home_like(path):
    (path / ".ssh").mkdir(parents=True)
    (path / ".ssh" / "id_ed25519").write_text("secret")
    (path / "Documents").mkdir()
    (path / ".bashrc").write_text("alias ll='ls -l'")
    return path


def _litter(parent):
    return sorted(p.name for p in parent.iterdir() if ".qstream-" in p.name)


def test_overwrite_refuses_a_directory_qstream_did_not_write(tmp_path):
    home = _home_like(tmp_path / "home")
    before = tree_digest(home)
    with pytest.raises(
        QStreamError,
        match=r"--output_dir .*home is not a directory qstream "
        r"wrote .* it holds \.bashrc, \.ssh/, Documents/",
    ):
        with publishing(home, overwrite=True):
            pytest.fail("no work may start")
    assert tree_digest(home) == before and _litter(tmp_path) == []


def test_overwrite_replaces_a_qstream_output(tmp_path):
    out = tmp_path / "out"
    with publishing(out, overwrite=False) as tmp:
        (tmp / "qstream_quantize.json").write_text("{}")
        (tmp / "old.txt").write_text("old")
    assert is_qstream_output(out)
    with publishing(out, overwrite=True) as tmp:
        (tmp / "qstream_quantize.json").write_text("{}")
    assert not (out / "old.txt").exists() and _litter(tmp_path) == []


def test_existing_output_without_overwrite_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "qstream_quantize.json").write_text("{}")
    with pytest.raises(QStreamError, match="already exists \\(use --overwrite\\)"):
        with publishing(tmp_path / "out", overwrite=False):
            pass


def test_an_empty_directory_counts_as_absent(tmp_path):
    (tmp_path / "out").mkdir()
    with publishing(tmp_path / "out", overwrite=False) as tmp:
        (tmp / "qstream_synth.json").write_text("{}")
    assert is_qstream_output(tmp_path / "out") and _litter(tmp_path) == []


def test_a_target_created_meanwhile_is_left_alone(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(QStreamError, match="was created by someone else during the run"):
        with publishing(out, overwrite=False) as tmp:
            (tmp / "mine.txt").write_text("mine")
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert _litter(tmp_path) == []


def test_an_error_removes_the_temporary_directory(tmp_path):
    with pytest.raises(ValueError):
        with publishing(tmp_path / "out", overwrite=False) as tmp:
            (tmp / "half.bin").write_bytes(b"\0" * 10)
            raise ValueError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_dead_runs_are_removed_with_a_notice(tmp_path, dead_pid):
    dead = dead_pid
    stale = tmp_path / f".out.qstream-partial-{dead}"
    stale.mkdir()
    (stale / "x").write_text("x")
    alive = tmp_path / f".out.qstream-partial-{os.getppid()}"  # a live process's
    alive.mkdir()
    other = tmp_path / f".other.qstream-partial-{dead}"  # beside another output
    other.mkdir()
    notices = []
    assert remove_stale_partials(tmp_path / "out", notices.append) == [stale]
    assert not stale.exists() and alive.exists() and other.exists()
    assert notices == [f"removed {stale}, left by an interrupted run (process {dead})"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_clean_up_like_ctrl_c(tmp_path, signum):
    # a process started in the background by a non-interactive shell inherits SIGINT ignored
    # (and Python then keeps it so): give the child the default Ctrl-C behaviour a terminal gives
    script = textwrap.dedent(f"""
        import signal, sys, time
        from qstream.publish import publishing
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with publishing(__import__("pathlib").Path({str(tmp_path / "out")!r}), False) as tmp:
            (tmp / "half.bin").write_bytes(b"0" * 1000)
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == [], err


def test_sigkill_leftovers_are_removed_by_the_next_run(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from qstream.publish import publishing
        with publishing(Path({str(tmp_path / "out")!r}), False) as tmp:
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait(timeout=30)
    assert _litter(tmp_path) == [f".out.qstream-partial-{proc.pid}"]
    time.sleep(0.1)
    notices = []
    with publishing(tmp_path / "out", overwrite=False, notice=notices.append) as tmp:
        (tmp / "qstream_quantize.json").write_text("{}")
    assert _litter(tmp_path) == [] and len(notices) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_unwritable_parent_is_refused_before_any_work(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    with pytest.raises(QStreamError, match="is not writable"):
        with publishing(parent / "out", overwrite=False):
            pytest.fail("no work may start")


def test_synth_overwrite_refuses_a_home_like_directory(tmp_path):
    from click.testing import CliRunner

    from qstream.cli import cli

    home = _home_like(tmp_path / "home")
    before = tree_digest(home)
    result = CliRunner().invoke(
        cli, ["synth", "--preset", "tiny", "--output_dir", str(home), "--overwrite"]
    )
    assert result.exit_code == 1
    assert (
        result.output.startswith("Error: --output_dir ")
        and "is not a directory qstream wrote" in result.output
        and len(result.output.splitlines()) == 1
    )
    assert tree_digest(home) == before and _litter(tmp_path) == []


def test_a_full_disk_during_quantize_is_one_error_line_and_no_litter(tmp_path, monkeypatch):
    """ENOSPC from the shard writer's pwrite (a real full filesystem needs a mount, which this
    sandbox cannot make), as quantize sees it through the CLI."""
    import errno

    from checkpoints import llama_tensors, write_checkpoint
    from click.testing import CliRunner

    import qstream.checkpoint.safetensors_io as io
    from qstream.cli import cli

    src = write_checkpoint(tmp_path / "in", llama_tensors(layers=1))
    before = tree_digest(src)
    real = os.pwrite

    def full(fd, data, offset):
        if offset > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(io.os, "pwrite", full)
    result = CliRunner().invoke(
        cli,
        [
            "quantize",
            "--model_dir",
            str(src),
            "--output_dir",
            str(tmp_path / "out"),
            "--quant_format",
            "nvfp4",
        ],
    )
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --output_dir ")
    assert "No space left on device" in lines[0] and lines[0].endswith("nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"] and tree_digest(src) == before


def test_two_concurrent_quantize_runs_to_one_new_directory(tmp_path):
    """Two processes race to publish the same new directory: exactly one succeeds, the other
    ends with one line, and the winner's checkpoint is intact and verifies."""
    from checkpoints import llama_tensors, write_checkpoint

    src = write_checkpoint(tmp_path / "in", llama_tensors(layers=2))
    out = tmp_path / "out"
    args = ["quantize", "--model_dir", str(src), "--output_dir", str(out), "--quant_format", "fp8"]
    script = "from qstream.entry import main; main()"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    if codes == [0, 0]:
        pytest.fail("both runs reported success")
    if codes == [1, 1]:  # the second started after the first published: refused up front
        pytest.fail(f"neither run published: {results}")
    loser = next(err for code, err in results if code == 1)
    assert loser.strip().startswith("Error: --output_dir ") and len(loser.strip().splitlines()) == 1
    from qstream.vllm.verify import verify_checkpoint

    assert verify_checkpoint(out).ok and _litter(tmp_path) == []


DATA = {"b": [1, 2.5, None], "a": {"text": "dé", "nan": float("nan")}}


@pytest.mark.parametrize(
    "form, text",
    [
        ({}, json.dumps(DATA, indent=2) + "\n"),  # records, configs, indexes, --json
        ({"indent": None}, json.dumps(DATA) + "\n"),  # speculate --capture's anchors files
        ({"indent": None, "end": ""}, json.dumps(DATA)),  # the config vLLM's loader reads
    ],
)
def test_every_json_file_is_json_dumps_in_the_dicts_order(tmp_path, form, text):
    write_json_atomic(tmp_path / "x.json", DATA, **form)
    assert (tmp_path / "x.json").read_bytes() == text.encode("ascii")


def test_a_failed_json_write_keeps_the_old_file_and_leaves_no_litter(tmp_path, monkeypatch):
    old = tmp_path / "config.json"
    old.write_text("{}\n")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(QStreamError, match=f"cannot write --x {old}: No space left"):
        write_json_atomic(old, {"new": 1}, "--x")
    assert old.read_text() == "{}\n" and _litter(tmp_path) == []


def test_a_directory_another_run_publishes_after_the_check_is_never_replaced(tmp_path, monkeypatch):
    """Without --overwrite, a qstream output that appears between the up-front check and the
    run's start (another run published it) is refused at publishing, never moved aside: the
    window the concurrent-runs test hits only sometimes, opened every time."""
    import qstream.publish as publish

    out = tmp_path / "out"

    def other_run_publishes(output, notice=None):
        out.mkdir()
        (out / publish.RECORD_FILES[0]).write_text("{}")
        return []

    monkeypatch.setattr(publish, "remove_stale_partials", other_run_publishes)
    with pytest.raises(QStreamError, match="created by someone else during the run"):
        with publishing(out, overwrite=False) as tmp:
            (tmp / "x").write_text("mine")
    assert sorted(p.name for p in out.iterdir()) == [publish.RECORD_FILES[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
