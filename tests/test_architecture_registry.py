"""The architecture interface (docs/model.md, "Architectures"): a second draft architecture is a
descriptor plus a registry line, and eval-drift runs it with no edit to qstream/eval/.  The toy
here is the DSpark-MLA forward under another name and model_type, registered from the test."""

import json
import shutil
from dataclasses import dataclass, replace

import pytest

from qstream.arch import registry
from qstream.arch.dspark_mla import DSparkConfig, DSparkMLA
from qstream.errors import QStreamError
from qstream.eval.drift import DriftSettings, evaluate_drift

TOY = "ToyDSparkModel"


@dataclass(frozen=True)
class ToyConfig(DSparkConfig):
    def to_json(self) -> dict:
        return {**super().to_json(), "architectures": [TOY], "model_type": "toy_dspark"}

    @classmethod
    def from_json(cls, data):
        rest = {k: v for k, v in data.items() if k not in ("architectures", "model_type")}
        return super().from_json(rest)


class ToyArch(DSparkMLA):
    config_type = ToyConfig

    def __init__(self):
        self.built = []

    def recognises(self, data):
        return data.get("model_type") == "toy_dspark"

    def parse_config(self, data):
        return ToyConfig.from_json(dict(data))

    def build(self, config, weights, variant, device="cpu", served=None):
        self.built.append(variant.dtype)
        return super().build(config, weights, variant, device, served)


@pytest.fixture
def toy(tiny, tmp_path, monkeypatch):
    arch = ToyArch()
    monkeypatch.setattr(registry, "ARCHITECTURES", [*registry.ARCHITECTURES, arch])  # its line
    directory = tmp_path / "toy"
    shutil.copytree(tiny, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=[TOY], model_type="toy_dspark")
    (directory / "config.json").write_text(json.dumps(config))
    return arch, directory


def test_a_registered_architecture_is_recognised_and_leads_back_to_itself(toy, tiny):
    arch, directory = toy
    config = registry.load_config(directory)
    assert type(config) is ToyConfig and registry.architecture_of(config) is arch
    assert type(registry.load_config(tiny)) is DSparkConfig


def test_eval_drift_runs_a_second_architecture_through_the_interface(toy, tiny, corpus):
    """Same forward, same weights: the toy's results equal the DSpark draft's, built by the
    toy's own descriptor (the reference once, then each variant)."""
    arch, directory = toy
    settings = DriftSettings(regime=("gauss",), formats=("bf16", "fp8"), blocks=16)
    results = evaluate_drift(replace(settings, model=directory), corpus)
    assert results["model"]["architecture"] == TOY
    assert len(arch.built) == 3  # the FP32 reference, bf16, fp8
    assert results["regimes"] == evaluate_drift(replace(settings, model=tiny), corpus)["regimes"]


def test_an_unrecognised_config_is_read_by_the_default_and_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    with pytest.raises(QStreamError, match=r"config.json: architectures = \['Nope'\]"):
        registry.load_config(tmp_path)
