"""Malformed --states inputs, in every layout (docs/states.md): each is one line on stderr naming
the file and tensor (and the expected shape where there is one), exit 1, through the CLI.  A
SpecForge .ckpt whose pickle would run code is refused without running it."""

import gzip
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from qstream.arch.dspark_mla import load_config
from qstream.cli import cli

T = 40


class RunsCode:
    """Pickles as a call to os.system: what torch.load(weights_only=False) would execute."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture(scope="module")
def cfg(tiny):
    return load_config(tiny)


def _ids(cfg, n=T):
    return torch.randint(cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))


def _vllm(cfg, path: Path, slots=None, n=T, dtype=torch.bfloat16, **extra) -> Path:
    slots = cfg.num_target_layers + 1 if slots is None else slots
    hidden = torch.randn(n, slots, cfg.target_hidden_size).to(dtype)
    save_file({"hidden_states": hidden, "token_ids": _ids(cfg), **extra}, path)
    return path


def _record(cfg, **change) -> dict:
    record = {
        "input_ids": _ids(cfg),
        "loss_mask": torch.ones(T, dtype=torch.int64),
        "hidden_states": torch.randn(1, T, cfg.aux_size).to(torch.bfloat16),
        "target_last_hidden_states": torch.randn(1, T, cfg.hidden_size).to(torch.bfloat16),
    }
    record.update(change)
    return {k: v for k, v in record.items() if v is not None}


def _specforge(cfg, root: Path, record=None, compress=False) -> Path:
    (root / "rows_0-2000").mkdir(parents=True, exist_ok=True)
    path = root / "rows_0-2000" / f"data_0.ckpt{'.gz' if compress else ''}"
    record = _record(cfg) if record is None else record
    if compress:
        with gzip.open(path, "wb") as f:
            torch.save(record, f)
    else:
        torch.save(record, path)
    return root


def _qstream(cfg, path: Path, aux_width=None) -> Path:
    save_file(
        {
            "input_ids": _ids(cfg),
            "aux_hidden_states": torch.randn(T, aux_width or cfg.aux_size),
            "target_hidden_states": torch.randn(T, cfg.hidden_size),
        },
        path,
    )
    return path


def _fail(tiny, states, *extra) -> str:
    args = ["eval-drift", "--model", str(tiny), "--states", str(states), "--blocks", "8"]
    result = CliRunner().invoke(cli, [*args, "--formats", "bf16", *extra])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def _in_dir(tmp_path, make, name):
    d = tmp_path / "d"
    d.mkdir()
    make(d / name)
    return d


CASES = {
    "wrong layer count": (
        lambda c, p: _vllm(c, p / "hs_0.safetensors", slots=c.num_target_layers + 2),
        "'hidden_states' has shape [40, 7, 64], expected [40, 6, 64]",
    ),
    "missing final state (vLLM)": (
        lambda c, p: _vllm(c, p / "hs_0.safetensors", slots=c.num_target_layers),
        "5 target layers but no final state; expected [40, 6, 64]",
    ),
    "missing final state (SpecForge eagle3 strategy)": (
        lambda c, p: _specforge(c, p / "sf", _record(c, target_last_hidden_states=None)),
        "'target_last_hidden_states' is missing (SpecForge writes it with --strategy dspark)",
    ),
    "wrong width": (
        lambda c, p: _qstream(c, p / "q.safetensors", aux_width=300),
        "'aux_hidden_states' has shape [40, 300], expected [40, 320]",
    ),
    "T mismatch between token ids and states": (
        lambda c, p: _vllm(c, p / "hs_0.safetensors", n=T - 1),
        "'hidden_states' has shape [39, 6, 64], expected [40, 6, 64] (T = len(token_ids)",
    ),
    "wrong dtype": (
        lambda c, p: _specforge(
            c, p / "sf", _record(c, hidden_states=torch.zeros(1, T, c.aux_size, dtype=torch.int32))
        ),
        "'hidden_states' has dtype int32, expected one of BF16, F16, F32",
    ),
    "ids out of vocab range": (
        lambda c, p: _specforge(c, p / "sf", _record(c, input_ids=_ids(c) + c.vocab_size)),
        "'input_ids' holds ids outside [0, 975)",
    ),
    "unexpected tensor beside vLLM's two": (
        lambda c, p: _vllm(c, p / "hs_0.safetensors", positions=torch.arange(T)),
        "unexpected tensor 'positions'",
    ),
    "truncated gzip": (
        lambda c, p: _truncate(_specforge(c, p / "sf", compress=True)),
        "data_0.ckpt.gz: not a torch.save file of plain tensors",
    ),
    "empty directory": (lambda c, p: _mkdir(p / "empty"), "directory holds no .safetensors"),
    "not a states file": (
        lambda c, p: _save(p / "w.safetensors", {"model.norm.weight": torch.ones(4)}),
        "not a states file qstream knows (tensors: model.norm.weight)",
    ),
    "vLLM layout without --target": (
        lambda c, p: _vllm(c, p / "hs_0.safetensors"),
        "final state is taken before the target's final norm; pass --target HF_DIR",
    ),
    "mixed formats in one directory": (
        lambda c, p: _mixed(c, p / "mixed"),
        "mixed layouts in one directory",
    ),
    "layer ids in capture.json that disagree with the draft": (
        lambda c, p: _manifest(c, p / "cap", [0, 2, 4, 5, 6], "hidden-states-index"),
        "capture.json: layer_ids: layer ids [0, 2, 4, 5, 6] (hidden-states-index) are "
        "layers [-1, 1, 3, 4, 5]",
    ),
    "capture.json convention unknown": (
        lambda c, p: _manifest(c, p / "cap", [0, 2, 4, 5, 6], "layer-input"),
        "layer convention 'layer-input' is not one of layer-output, hidden-states-index",
    ),
}


def _save(path, tensors):
    save_file(tensors, path)
    return path


def _mkdir(path):
    path.mkdir()
    return path


def _truncate(root):
    path = root / "rows_0-2000" / "data_0.ckpt.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return root


def _mixed(cfg, root):
    root.mkdir()
    _vllm(cfg, root / "hs_0.safetensors")
    _qstream(cfg, root / "stream-000000.safetensors")
    return root


def _manifest(cfg, root, ids, convention):
    root.mkdir()
    _qstream(cfg, root / "stream-000000.safetensors")
    manifest = {"layer_convention": convention, "layer_ids": ids, "target": "t"}
    (root / "capture.json").write_text(json.dumps(manifest))
    return root


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_states_are_one_line(tiny, cfg, tmp_path, case):
    make, message = CASES[case]
    err = _fail(tiny, make(cfg, tmp_path))
    assert message in err, err


def test_non_finite_values_are_refused_naming_tensor_and_positions(tiny, cfg, tmp_path):
    path = _qstream(cfg, tmp_path / "q.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(path)
    tensors["aux_hidden_states"][0, 3] = float("nan")
    save_file(tensors, path)
    err = _fail(tiny, path)
    assert "tensor 'aux_hidden_states' holds non-finite values in positions 0.." in err


def test_a_pickle_with_code_is_refused_and_never_run(tiny, cfg, tmp_path):
    marker = tmp_path / "ran"
    root = _specforge(cfg, tmp_path / "sf", _record(cfg, loss_mask=RunsCode(f"touch {marker}")))
    err = _fail(tiny, root)
    assert "torch.load with weights_only=True refused it" in err
    assert not marker.exists()
