"""eval-drift --states reads the layouts other stacks write (docs/states.md), each built here as
its source code writes it: vLLM's hidden-states connector / speculators (``hs_{i}.safetensors``:
``token_ids`` [T] int64, ``hidden_states`` [T, L+1, H] in the model dtype, the last slot the last
layer before the final norm), SpecForge's dspark strategy (``rows_0-2000/data_{i}.ckpt[.gz]``,
a torch.save dict) and qstream capture's directory (``stream-NNNNNN.safetensors`` +
capture.json).  The same data gives the same results as in qstream's one-file layout; a pre-norm
final state is normalized with the target's final norm (checked against transformers'
LlamaRMSNorm); malformed inputs are one line, exit 1."""

import gzip
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_mla import load_config
from qstream.cli import cli
from qstream.eval.states import read_states

N_STREAMS, LENGTHS, EPS = 4, (40, 36, 44, 40), 1e-6
VLLM_NAMES = ("hs_0", "hs_1", "hs_2", "hs_10")  # natural order: hs_10 is the last stream
BASE = ["--formats", "bf16", "--blocks", "16"]


@pytest.fixture(scope="module")
def data(tiny):
    """Per stream: ids [T], aux [T, L·H] bf16, pre-norm last layer [T, H] bf16."""
    cfg = load_config(tiny)
    gen = torch.Generator().manual_seed(12)
    out = []
    for T in LENGTHS:
        ids = torch.randint(cfg.vocab_size, (T,), generator=gen)
        aux = torch.randn(T, cfg.aux_size, generator=gen).to(torch.bfloat16)
        last = (3 * torch.randn(T, cfg.hidden_size, generator=gen)).to(torch.bfloat16)
        out.append((ids, aux, last))
    return cfg, out


@pytest.fixture(scope="module")
def target(tiny, data, tmp_path_factory):
    """A target checkpoint directory: the draft's stand-in head, a final norm and config.json."""
    cfg, _ = data
    path = tmp_path_factory.mktemp("target")
    head = {}
    for shard in (Path(tiny) / "target_head").glob("*.safetensors"):
        head.update(load_file(shard))
    gen = torch.Generator().manual_seed(3)
    head["model.norm.weight"] = torch.rand(cfg.hidden_size, generator=gen) + 0.5
    # a layer's norm also ends in "norm.weight": it must not be taken for the final norm
    head["model.layers.0.post_attention_layernorm.weight"] = torch.zeros(cfg.hidden_size)
    save_file(head, path / "model.safetensors")
    config = {"hidden_size": cfg.hidden_size, "num_hidden_layers": 8, "rms_norm_eps": EPS}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def normed(data):
    """Post-norm final states in the model dtype (as SpecForge stores them), and the results of
    the same data in qstream's one-file layout."""
    return [_plain_norm(last) for _, _, last in data[1]]


@pytest.fixture(scope="module")
def base_results(tiny, data, normed, tmp_path_factory):
    path = _qstream_file(tmp_path_factory.mktemp("base") / "base.safetensors", data[1], normed)
    code, err, results = _run(tiny, path)
    assert code == 0, err
    return results


def _plain_norm(last: torch.Tensor) -> torch.Tensor:
    return (last.float() / last.float().pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)


def _hf_norm(target: Path, x: torch.Tensor) -> torch.Tensor:
    """The target's final norm as transformers computes it (float32 in, float32 out)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=EPS)
    norm.weight.data = load_file(target / "model.safetensors")["model.norm.weight"]
    with torch.no_grad():
        return norm(x.float())


def _qstream_file(path: Path, streams, finals) -> Path:
    tensors = {}
    for i, ((ids, aux, _), final) in enumerate(zip(streams, finals)):
        tensors[f"stream.{i}.input_ids"] = ids
        tensors[f"stream.{i}.aux_hidden_states"] = aux
        tensors[f"stream.{i}.target_hidden_states"] = final.contiguous()
    save_file(tensors, path)
    return path


def _vllm_dir(path: Path, data) -> Path:
    """As ExampleHiddenStatesConnector writes and speculators renames them (no metadata)."""
    cfg, streams = data
    path.mkdir()
    for name, (ids, aux, last) in zip(VLLM_NAMES, streams):
        slots = torch.cat([aux.view(len(ids), cfg.num_target_layers, -1), last[:, None]], 1)
        save_file({"hidden_states": slots, "token_ids": ids}, path / f"{name}.safetensors")
    (path / "hs_1.safetensors.lock").write_text("")  # vLLM's lock files are not states
    return path


def _specforge_dir(path: Path, streams, finals, compress: bool) -> Path:
    """As prepare_hidden_states.py's _save_tensor_sync writes them (file_group_size 2000)."""
    (path / "rows_0-2000").mkdir(parents=True)
    (path / "vocab_mapping").mkdir()
    torch.save({"t2d": torch.ones(3)}, path / "vocab_mapping" / "vocab_mapping.pt")
    for i, ((ids, aux, _), final) in enumerate(zip(streams, finals)):
        record = {
            "input_ids": ids,
            "loss_mask": torch.ones_like(ids),
            "hidden_states": aux.unsqueeze(0),
            "target_last_hidden_states": final.unsqueeze(0),
        }
        file = path / "rows_0-2000" / f"data_{i}.ckpt{'.gz' if compress else ''}"
        if compress:
            with gzip.open(file, "wb", compresslevel=6) as f:
                torch.save(record, f)
        else:
            torch.save(record, file)
    return path


def _run(tiny, states, *extra) -> tuple[int, str, dict | None]:
    out = Path(str(states).rstrip("/") + ".json")
    args = ["eval-drift", "--model", str(tiny), "--states", str(states), *BASE, *extra]
    result = CliRunner().invoke(cli, [*args, "--json", str(out)])
    data = json.loads(out.read_text()) if result.exit_code == 0 else None
    return result.exit_code, result.stderr, data


def _same_results(a: dict, b: dict) -> None:
    assert a["regimes"] == b["regimes"]
    for key in ("streams", "tokens", "anchors"):
        assert a["states"][key] == b["states"][key], key


def test_vllm_layout_gives_the_qstream_results_with_the_final_state_normalized(
    tiny, data, target, tmp_path
):
    cfg, streams = data
    finals = [_hf_norm(target, last) for _, _, last in streams]
    base = _qstream_file(tmp_path / "base.safetensors", streams, finals)
    code, err, want = _run(tiny, base, "--target", str(target))
    assert code == 0, err
    code, err, got = _run(tiny, _vllm_dir(tmp_path / "hs", data), "--target", str(target))
    assert code == 0, err
    _same_results(got, want)
    states = got["states"]
    assert states["format"] == "vllm" and states["files"] == N_STREAMS
    assert states["final_state"]["normalized_with"]["eps"] == EPS
    assert states["layers"]["convention"] == "hidden-states-index"
    assert states["layers"]["ids"] == [i + 1 for i in cfg.target_layer_ids]
    assert states["layers"]["named_by"] == []


def test_pre_norm_state_matches_transformers_rms_norm(tiny, data, target, tmp_path):
    cfg, streams = data
    states = read_states(_vllm_dir(tmp_path / "hs", data), cfg, target=str(target))
    anchor = torch.tensor([3, 20])
    got = states.target_hidden(torch.tensor([3, 3]), anchor, cfg.block_size)
    last = streams[3][2]  # hs_10, the fourth stream in natural order
    want = _hf_norm(target, last)[anchor[:, None] + torch.arange(cfg.block_size)]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, last.float()[anchor[:, None] + torch.arange(cfg.block_size)])
    aux = states.aux_chunks([1], 40, torch.float32).rows(0, 40)[0, :36]
    assert torch.equal(aux, streams[1][1].float())


@pytest.mark.parametrize("compress", [False, True])
def test_specforge_layout_gives_the_qstream_results(
    tiny, data, normed, base_results, tmp_path, compress
):
    code, err, got = _run(tiny, _specforge_dir(tmp_path / "sf", data[1], normed, compress))
    assert code == 0, err
    _same_results(got, base_results)
    assert got["states"]["format"] == "specforge" and got["states"]["files"] == N_STREAMS
    assert got["states"]["final_state"]["normalized_with"] is None
    assert got["states"]["layers"]["convention"] == "layer-output"


def test_qstream_capture_directory_and_its_manifest(tiny, data, normed, base_results, tmp_path):
    cfg, streams = data
    out = tmp_path / "captured"
    out.mkdir()
    for i in range(N_STREAMS):
        _qstream_file(out / f"stream-{i:06d}.safetensors", [streams[i]], [normed[i]])
    manifest = {
        "layer_convention": "hidden-states-index",
        "layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "target": "tiny-target",
    }
    (out / "capture.json").write_text(json.dumps(manifest))
    code, err, got = _run(tiny, out)
    assert code == 0, err
    _same_results(got, base_results)
    assert got["states"]["manifest"] == manifest
    assert got["states"]["layers"]["convention"] == "hidden-states-index"
    assert got["states"]["layers"]["named_by"] == [{"by": "capture.json", "ids": [1, 3, 5, 6, 7]}]


def test_layer_ids_option_is_read_in_its_convention(tiny, data, target, tmp_path):
    cfg = data[0]
    hs = _vllm_dir(tmp_path / "hs", data)
    # speculators' launch_vllm.py list for this draft: layers 1, 3, 5, 6, 7 and the last (8)
    states = read_states(hs, cfg, layer_ids="1,3,5,6,7,8", target=str(target))
    assert states.identity()["layers"]["named_by"][0]["ids"] == [1, 3, 5, 6, 7, 8]
    # the draft's own ids are layer outputs: read as vLLM indices they are one layer early
    args = ("--target", str(target), "--states-layer-ids", "0,2,4,5,6")
    code, err, _ = _run(tiny, hs, *args)
    assert code == 1 and err.count("\n") == 1
    assert "are layers [-1, 1, 3, 4, 5] in the layer-output convention" in err
    states = read_states(
        hs, cfg, layer_ids="0,2,4,5,6", layer_convention="layer-output", target=str(target)
    )
    assert states.identity()["layers"]["convention"] == "layer-output"
