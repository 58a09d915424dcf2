"""evals/regime_statistics.py (docs/calibration.md, "The regimes against SmolLM2's states"): its
statistics are right on states whose answer is known (one channel 100 times the others), the
synthetic regimes' states are the ones qstream's own generator draws, and the script writes its
JSON and figure from a states file and a draft."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import load_script
from safetensors.torch import save_file

from qstream.arch.registry import load_config
from qstream.eval.batches import AUX_DTYPE, SyntheticAuxChunks
from qstream.eval.states import read_states
from qstream.regimes import GAUSS, HEAVY

SCRIPT = Path(__file__).resolve().parents[1] / "evals" / "regime_statistics.py"
LENGTHS = (33, 17, 41)  # tokens per stream; every position but the last is taken
SCALE = 100.0  # the outlier channel's magnitude over the others' (1.0): both exact in bf16
MASSIVE = 1000.0  # each stream's first position, one other channel (exact in bf16)
# float64 sums of a few thousand exact terms and a square root: observed within 1e-15 relative
FLOAT64_REL = 1e-12
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _script():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def stats():
    return _script()


def _known(n: int, config) -> torch.Tensor:
    """[n, A]: +-1 everywhere (signs alternating over tokens), one channel of each aux layer
    (a different one per layer) SCALE times larger."""
    H, L = config.target_hidden_size, config.num_target_layers
    x = torch.ones(n, L, H)
    x[1::2] = -1.0
    for i in range(L):
        x[:, i, (7 * i + 3) % H] *= SCALE
    return x.flatten(1)


@pytest.fixture(scope="module")
def states_file(tiny, tmp_path_factory):
    """qstream's one-file layout (docs/states.md) holding the known states, each stream's
    first position with a massive value in one more channel."""
    config = load_config(tiny)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for s, n in enumerate(LENGTHS):
        tensors[f"stream.{s}.input_ids"] = torch.randint(config.vocab_size, (n,), generator=gen)
        aux = _known(n, config)
        aux[0, 10] = MASSIVE
        tensors[f"stream.{s}.aux_hidden_states"] = aux.to(torch.bfloat16)
        hidden = torch.ones(n, config.target_hidden_size, dtype=torch.bfloat16)
        tensors[f"stream.{s}.target_hidden_states"] = hidden
    path = tmp_path_factory.mktemp("states") / "known.safetensors"
    save_file(tensors, str(path), metadata={"format": "qstream.states/1"})
    return path


def test_one_channel_100x_gives_its_ratio_share_crest_and_kurtosis(stats, tiny):
    config = load_config(tiny)
    H = config.target_hidden_size
    x = _known(64, config).unflatten(1, (config.num_target_layers, H))[:, 2]
    got = stats.layer_statistics(x)
    energy = SCALE**2 + (H - 1)  # one token's sum of squares
    assert got["max_over_median_channel_rms"] == SCALE  # 100 / 1, exact
    assert got["max_abs"] == SCALE and got["channel_rms_sorted"][:2] == [SCALE, 1.0]
    assert math.isclose(got["top1_energy_share"], SCALE**2 / energy, rel_tol=FLOAT64_REL)
    assert math.isclose(got["top8_energy_share"], (SCALE**2 + 7) / energy, rel_tol=FLOAT64_REL)
    crest = SCALE / math.sqrt(energy / H)  # every token alike
    for value in got["crest"].values():
        assert math.isclose(value, crest, rel_tol=FLOAT64_REL), (value, crest)
    kurtosis = ((SCALE**4 + H - 1) / H) / (energy / H) ** 2  # mean 0: signs alternate
    assert math.isclose(got["kurtosis"], kurtosis, rel_tol=FLOAT64_REL), got["kurtosis"]


def test_gaussian_states_have_a_gaussian_kurtosis_and_a_flat_spectrum(stats):
    x = torch.randn(20_000, 64, generator=torch.Generator().manual_seed(0))
    got = stats.layer_statistics(x)
    # 1.28M normal draws: the kurtosis' standard error is sqrt(24/n) = 0.004; the largest of 64
    # channel RMS over the median is 1 + O(3/sqrt(2n)) = 1.02 at most
    assert abs(got["kurtosis"] - 3.0) < 0.03, got["kurtosis"]
    assert got["max_over_median_channel_rms"] < 1.05, got["max_over_median_channel_rms"]


def test_states_and_regimes_come_from_the_file_and_qstreams_generator(stats, tiny, states_file):
    config = load_config(tiny)
    states = read_states(states_file, config)
    seed = 3
    got = stats.statistics(states, config, ["gauss", "heavy"], seed)
    assert list(got) == ["states", "states[1:]", "gauss", "heavy", "heavy[1:]"]
    for i, (whole, after_first) in enumerate(zip(got["states"], got["states[1:]"])):
        assert whole["max_abs"] == (MASSIVE if i == 0 else SCALE), (i, whole)
        assert whole["max_over_median_channel_rms"] == SCALE or i == 0, (i, whole)
        assert after_first["max_abs"] == SCALE, (i, after_first)
        assert after_first["max_over_median_channel_rms"] == SCALE, (i, after_first)
    T = max(LENGTHS) - 1
    for regime in (GAUSS, HEAVY):
        chunks = SyntheticAuxChunks(regime, config, [0, 1, 2], list(LENGTHS), T, seed, AUX_DTYPE)
        drawn = chunks.rows(0, T)
        rows = torch.cat([drawn[s, : n - 1] for s, n in enumerate(LENGTHS)])
        layers = rows.unflatten(1, (config.num_target_layers, config.target_hidden_size))
        want = [stats.layer_statistics(layers[:, i]) for i in range(layers.shape[1])]
        assert got[regime.name] == want, regime.name
    rows = torch.cat([drawn[s, 1 : n - 1] for s, n in enumerate(LENGTHS)])  # heavy's, drawn last
    layers = rows.unflatten(1, (config.num_target_layers, config.target_hidden_size))
    want = [stats.layer_statistics(layers[:, i]) for i in range(layers.shape[1])]
    assert got["heavy[1:]"] == want
    heavy, gauss = (got[r][0]["max_over_median_channel_rms"] for r in ("heavy", "gauss"))
    assert heavy > 5 * gauss, (heavy, gauss)  # heavy's outlier channels, 20-40x the median


def test_script_writes_its_json_and_figure(stats, tiny, states_file, tmp_path, monkeypatch):
    out, png = tmp_path / "stats.json", tmp_path / "stats.png"
    argv = ["regime_statistics.py", "--states", str(states_file), "--model", str(tiny)]
    argv += ["--json", str(out), "--figure", str(png), "--seed", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    stats.main()
    record = json.loads(out.read_text())
    config = load_config(tiny)
    assert list(record["regimes"]) == [
        "states",
        "states[1:]",
        "gauss",
        "heavy",
        "heavy[1:]",
        "boot",
    ]
    assert record["positions"] == sum(n - 1 for n in LENGTHS)
    assert record["layer_ids"]["ids"] == list(config.target_layer_ids)
    want = stats.statistics(read_states(states_file, config), config, ["heavy"], 3)
    assert record["regimes"]["heavy"] == want["heavy"]
    assert all(len(v) == config.num_target_layers for v in record["regimes"].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_regime_is_one_error_line(stats, tiny, states_file, tmp_path, monkeypatch):
    argv = ["regime_statistics.py", "--states", str(states_file), "--model", str(tiny)]
    argv += ["--json", str(tmp_path / "s.json"), "--figure", str(tmp_path / "s.png")]
    monkeypatch.setattr(sys, "argv", [*argv, "--regimes", "gauss,states"])
    with pytest.raises(SystemExit, match="Error: --regimes 'states'"):
        stats.main()
    assert not (tmp_path / "s.json").exists()
