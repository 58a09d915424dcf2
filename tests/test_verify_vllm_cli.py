"""``qstream verify --vllm`` where vLLM 0.32.0 is not what is installed: one ``Error:`` line
naming the version needed, before any work (the loads themselves are tests/test_vllm_loader.py,
in the vLLM lane)."""

import sys
import types

import pytest
from cli_helpers import cli_error

from qstream.vllm.loader import VLLM_VERSION


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError


@pytest.fixture
def other_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.2"))


def test_without_vllm_one_error_line_names_the_version(tiny, no_vllm):
    err = cli_error(["verify", tiny, "--vllm"])
    assert f"vllm {VLLM_VERSION}" in err and "not installed" in err


def test_another_vllm_version_is_refused_by_name(tiny, other_vllm):
    err = cli_error(["verify", tiny, "--vllm"])
    assert f"vllm {VLLM_VERSION}" in err and "found vllm 0.31.2" in err


def test_vllm_load_is_at_tensor_parallel_size_one(tiny):
    err = cli_error(["verify", tiny, "--vllm", "--tensor-parallel-size", "2"])
    assert "tensor_parallel_size 1" in err
