"""Publishing outputs safely (docs/guarantees.md, "Output directories"): a directory is built in
``.<name>.qstream-partial-<pid>`` beside the target and published with one rename (only a
directory holding a qstream record file is replaced, with ``overwrite``); a single file is
written whole or not at all (:func:`write_bytes_atomic`, :func:`write_json_atomic`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qstream.errors import QStreamError

# Files marking a directory qstream wrote; --overwrite replaces nothing else.
QUANTIZE_RECORD = "qstream_quantize.json"  # quantize's provenance: command, summary, sha256s
SYNTH_RECORD = "qstream_synth.json"
CONVERT_RECORD = "qstream_convert.json"  # qstream convert-gguf's output
RECORD_FILES = (QUANTIZE_RECORD, SYNTH_RECORD, CONVERT_RECORD)
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.qstream-(?:partial|old)-(?P<pid>\d+)$")


def check_target(output: Path, overwrite: bool, option: str) -> None:
    """Refuse ``output`` before any work: an existing path without ``overwrite``, one qstream
    did not write, a missing or unwritable parent.  An empty directory is replaced as if it did
    not exist."""
    if (output.exists() or output.is_symlink()) and not _empty_dir(output):
        if not overwrite:
            raise QStreamError(f"{option} {output} already exists (use --overwrite)")
        if not is_qstream_output(output):
            if output.is_dir():
                holds = listing(output) or "nothing (an empty directory)"
            else:
                holds = "a file" if output.is_file() else "something that is not a directory"
            raise QStreamError(
                f"{option} {output} is not a directory qstream wrote "
                f"(no {' or '.join(RECORD_FILES)}; it holds {holds}); refusing to replace it"
            )
    check_parent(output, option, "parent directory")


def check_parent(output: str | Path, option: str, what: str = "directory") -> None:
    """Refuse ``output`` (named as given) whose parent is missing or not a writable directory."""
    parent = Path(output).parent
    if not parent.is_dir():
        raise QStreamError(f"{option} {output}: {what} {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise QStreamError(f"{option} {output}: {what} {parent} is not writable")


def check_outside(output: str | Path, option: str, inputs: Mapping[str, str | Path]) -> None:
    """Refuse ``output`` inside one of ``inputs`` (option -> directory), or containing one."""
    out = Path(output).resolve()
    for name, given in inputs.items():
        source = Path(given).resolve()
        if out == source or source in out.parents:
            raise QStreamError(
                f"{option} {output} is inside {name} {given}; the input is never modified"
            )
        if out in source.parents:
            raise QStreamError(f"{option} {output} contains {name} {given}")


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def is_qstream_output(path: Path) -> bool:
    return (
        path.is_dir()
        and not path.is_symlink()
        and any((path / name).is_file() for name in RECORD_FILES)
    )


def listing(directory: Path, limit: int = 4) -> str:
    """The first ``limit`` names in ``directory`` (a directory's with a slash), and how many
    more."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def remove_stale_partials(output: Path, notice: Callable[[str], None] | None = None) -> list[Path]:
    """:func:`remove_stale_partials_in` for ``output``'s."""
    return remove_stale_partials_in(output.parent, notice, output.name)


def remove_stale_partials_in(
    directory: Path, notice: Callable[[str], None] | None = None, name: str | None = None
) -> list[Path]:
    """Remove the ``.<name>.qstream-partial-<pid>`` (and ``-old-``) directories or files in
    ``directory`` (of every name, or of ``name``) whose process no longer exists (what SIGKILL
    left); the paths removed."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in sorted(directory.iterdir()):
        m = _PARTIAL.match(entry.name)
        if not m or name not in (None, m.group("name")) or _alive(int(m.group("pid"))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
        if notice is not None:
            notice(f"removed {entry}, left by an interrupted run (process {m.group('pid')})")
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True


def stderr_notice(message: str) -> None:
    print(f"Notice: {message}", file=sys.stderr)


def partial_dir(output: Path, option: str) -> Path:
    """A fresh ``.<name>.qstream-partial-<pid>`` directory beside ``output``, where a run
    builds what it will publish (QStreamError if it cannot be made)."""
    tmp = output.parent / f".{output.name}.qstream-partial-{os.getpid()}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise QStreamError(f"{option} {output}: cannot create {tmp}: {exc.strerror}") from exc
    return tmp


@contextmanager
def publishing(
    output: Path,
    overwrite: bool,
    option: str = "--output_dir",
    notice: Callable[[str], None] | None = stderr_notice,
) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``output``; publish it as ``output`` when the
    block ends normally, remove it otherwise (also on SIGTERM and SIGHUP)."""
    output = Path(output)
    check_target(output, overwrite, option)
    remove_stale_partials(output, notice)
    # what --overwrite replaces: without it, a directory that appears after check_target is
    # another run's, which _publish refuses to replace
    existed = overwrite and output.exists() and not _empty_dir(output)
    tmp = partial_dir(output, option)
    try:
        with signals_as_interrupt():
            yield tmp
            _publish(tmp, output, existed, option)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # a file that could not be written, named as it would be published
        if isinstance(exc, QStreamError) and str(tmp) in str(exc):
            said = str(exc).replace(str(tmp), str(output))
            raise QStreamError(f"{said}; nothing was written") from exc
        if isinstance(exc, OSError):  # disk full, permissions, I/O error: one line, nothing left
            where = exc.filename or tmp
            raise QStreamError(
                f"{option} {output}: {exc.strerror or exc} (writing {where}); nothing was written"
            ) from exc
        raise


def _publish(tmp: Path, output: Path, existed: bool, option: str) -> None:
    old = None
    if existed:
        if not is_qstream_output(output):
            raise QStreamError(
                f"{option} {output} changed during the run and is no longer a "
                "directory qstream wrote; refusing to replace it"
            )
        old = output.parent / f".{output.name}.qstream-old-{os.getpid()}"
        output.rename(old)
    elif (output.exists() or output.is_symlink()) and not _empty_dir(output):
        raise QStreamError(
            f"{option} {output} was created by someone else during the run; nothing was replaced"
        )
    try:
        os.rename(tmp, output)  # fails if another run published a non-empty directory first
    except OSError as exc:
        if old is not None:
            old.rename(output)
        raise QStreamError(
            f"{option} {output} was created by someone else during the run "
            f"({exc.strerror}); nothing was replaced"
        ) from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so that clean-up runs as for Ctrl-C."""


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Terminated` (a KeyboardInterrupt) while the block runs:
    clean-up runs as for Ctrl-C, and click ends the command with ``Aborted!`` and exit 1."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGTERM", "SIGHUP")
    previous = {s: signal.getsignal(s) for s in (getattr(signal, n, None) for n in names) if s}

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        raise Terminated(signal.Signals(signum).name)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def write_bytes_atomic(path: str | Path, data: bytes, option: str = "") -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file beside it, synced to
    disk, then one rename; an OSError becomes a QStreamError naming the path."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.qstream-partial-{os.getpid()}")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        label = f"{option} {path}" if option else str(path)
        raise QStreamError(f"cannot write {label}: {exc.strerror or exc}") from exc


def write_text_atomic(path: str | Path, text: str, option: str = "") -> None:
    write_bytes_atomic(path, text.encode("utf-8"), option)


def json_text(data: Any, indent: int | None = 2, end: str = "\n") -> str:
    """``data`` as qstream writes JSON: ``json.dumps`` (the dicts' key order, ASCII) + ``end``."""
    return json.dumps(data, indent=indent) + end


def write_json_atomic(
    path: str | Path, data: Any, option: str = "", indent: int | None = 2, end: str = "\n"
) -> None:
    write_text_atomic(path, json_text(data, indent, end), option)
