"""Ctrl-C at any moment ends with ``Aborted!`` and exit 1, never a traceback."""

import importlib.abc
import sys

import pytest

from qstream import entry


class _InterruptingImport(importlib.abc.MetaPathFinder):
    """Ctrl-C arriving while ``qstream.cli`` is being imported."""

    def find_spec(self, name, path, target=None):
        if name == "qstream.cli":
            raise KeyboardInterrupt
        return None


@pytest.mark.parametrize("main", [entry.main, entry.quantize_main])
def test_ctrl_c_during_imports_is_aborted(monkeypatch, capsys, main):
    monkeypatch.delitem(sys.modules, "qstream.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_InterruptingImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "\nAborted!\n"


def test_ctrl_c_while_running_is_aborted(monkeypatch, capsys):
    from qstream import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    assert exit_.value.code == 1 and "Aborted!" in capsys.readouterr().err


def test_python_dash_m_qstream_is_the_qstream_command():
    import subprocess
    import sys

    from qstream import __version__

    done = subprocess.run([sys.executable, "-m", "qstream", "--version"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"qstream, version {__version__}"
