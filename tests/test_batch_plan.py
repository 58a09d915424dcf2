"""The run's blocks are batched once (qstream/eval/drift.py): the progress's plan (its blocks
and FLOPs) and the passes read the same batches, for every regime, context bucket and the
captured states' regime."""

from dataclasses import replace

import pytest
from stand_in_target import capture_states

import qstream.eval.batches as batches
import qstream.eval.drift as drift
import qstream.eval.passes as passes
from qstream.eval.drift import DriftSettings, evaluate_drift


@pytest.fixture(scope="module")
def states_file(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("states") / "captured.safetensors"
    capture_states(str(tiny), str(path), n_streams=4, length=40, seed=0)
    return path


def test_every_set_of_blocks_is_batched_once(tiny, corpus, states_file, monkeypatch):
    batched: list = []
    make_batches = batches.make_batches

    def counted(plan, streams, config):
        batched.append(plan)
        return make_batches(plan, streams, config)

    for module in (drift, passes):  # wherever the run batches
        monkeypatch.setattr(module, "make_batches", counted, raising=False)
    settings = DriftSettings(
        regime=("gauss", "heavy"),
        formats=("bf16",),
        blocks=8,
        context_lengths=(32, 64, 128),
        context_blocks=2,
        states=str(states_file),
    )
    results = evaluate_drift(replace(settings, model=tiny), corpus)
    # the corpus blocks, the states' blocks and two buckets' blocks, each once
    assert len(batched) == len({id(plan) for plan in batched}) == 4
    assert [
        len(r.get("context_sweep", {}).get("buckets", [])) for r in results["regimes"].values()
    ] == [2, 2, 0]
