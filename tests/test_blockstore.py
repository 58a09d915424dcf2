"""What a regime keeps between its passes (qstream/bounded.py; docs/eval-drift.md,
"Memory"): tensors round-trip bit-exactly by key in memory and in the scratch file, in any
order; a store stays within its memory budget; the scratch file has no name, so nothing is left
behind, also after an error; a disk too small is one error line; a recorded source reads back
by any range; and a whole evaluation gives the same results with its stores on disk and the
target's lm_head upcast per use as with everything in memory."""

import os
import weakref
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from stand_in_target import capture_states

import qstream.arch.weights as weights_module
import qstream.bounded as blockstore
import qstream.eval.batches as batches
from qstream.bounded import Recorded, Store
from qstream.cli import cli
from qstream.errors import QStreamError
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.regimes import AUX_REGIMES

SHAPE = (11, 3, 5)  # [N, B, V]
TOTAL = 4 * 11 * 3 * 5
# the blocks of a regime in batches, as make_batches gives them: out of order, of uneven sizes
BATCHES = [torch.tensor([7, 2, 3, 4]), torch.tensor([10]), torch.tensor([0, 9, 1, 5, 6, 8])]


def _rows(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, *SHAPE[1:], generator=gen)
    x[0, 0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0])  # every bit pattern kept
    return x


@pytest.mark.parametrize("memory_bytes", [None, 0], ids=["memory", "disk"])
def test_round_trip_by_key_in_any_order(tmp_path, memory_bytes):
    rows = _rows(SHAPE[0])
    with Store(str(tmp_path), memory_bytes=memory_bytes, total_bytes=TOTAL) as store:
        assert (store.fd is not None) == (memory_bytes == 0)
        for number, idx in enumerate(BATCHES):
            view = torch.cat([rows[idx], rows[idx]])[: len(idx)]  # a view of a bigger tensor
            store.put(number, view)  # kept alone
        assert store.held_bytes == (TOTAL if memory_bytes is None else 0)
        for number in (2, 0, 1, 2):
            got = store.get(number)
            assert got.shape == (len(BATCHES[number]), *SHAPE[1:]) and got.dtype == torch.float32
            assert torch.equal(got.view(torch.int32), rows[BATCHES[number]].view(torch.int32))
        assert 3 not in store and 1 in store
    assert os.listdir(tmp_path) == []


def test_a_store_without_a_total_holds_what_fits_and_spills_the_rest(tmp_path):
    """The aux states kept between passes: in memory up to the budget, then the scratch file
    (boot's, which cost a causal pass), or dropped (gauss and heavy's, drawn again)."""
    parts = [torch.full((3, 4), float(i)).bfloat16() for i in range(4)]  # 24 bytes each
    spilling = Store(str(tmp_path), memory_bytes=50)
    dropping = Store(str(tmp_path), memory_bytes=50, spill=False)
    assert [spilling.put(i, t) for i, t in enumerate(parts)] == [True] * 4
    assert [dropping.put(i, t) for i, t in enumerate(parts)] == [True, True, False, False]
    assert spilling.held_bytes == dropping.held_bytes == 48
    assert spilling.fd is not None and dropping.fd is None
    assert 2 not in dropping
    for i, t in enumerate(parts):
        assert torch.equal(spilling.get(i).view(torch.int16), t.view(torch.int16))
    spilling.close()
    assert os.listdir(tmp_path) == []


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to see open files")
def test_disk_store_leaves_nothing_behind_even_on_error(tmp_path):
    before = _open_fds()
    with pytest.raises(ValueError, match="boom"):
        with Store(str(tmp_path), memory_bytes=0, total_bytes=TOTAL) as store:
            store.put(0, _rows(SHAPE[0]))
            assert os.listdir(tmp_path) == []  # unlinked from the start
            assert len(_open_fds() - before) == 1  # the one open, nameless file
            raise ValueError("boom")
    assert os.listdir(tmp_path) == []
    assert _open_fds() == before  # closed: the kernel frees its blocks


def test_full_disk_is_one_error_line(tmp_path, monkeypatch):
    free = 600  # bytes: less than the 660 the store needs

    def small_disk(path):
        return type("usage", (), {"total": free, "used": 0, "free": free})()

    monkeypatch.setattr(blockstore.shutil, "disk_usage", small_disk)
    with pytest.raises(QStreamError) as e:
        Store(str(tmp_path), memory_bytes=0, total_bytes=TOTAL)
    assert str(e.value) == (
        f"--scratch-dir {tmp_path}: {TOTAL} bytes needed for the per-block outputs, "
        f"{free} free (pass --scratch-dir on a bigger disk, or fewer --blocks)"
    )
    assert os.listdir(tmp_path) == []


def test_full_scratch_disk_from_the_cli(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(blockstore, "MEMORY_BYTES", 0)
    monkeypatch.setattr(blockstore.shutil, "disk_usage", lambda p: type("usage", (), {"free": 0}))
    result = CliRunner().invoke(
        cli,
        ["eval-drift", "--model", str(tiny), "--regime", "gauss", "--blocks", "8",
         "--scratch-dir", str(tmp_path), "--formats", "bf16"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and f"--scratch-dir {tmp_path}: " in lines[0], result.output


@pytest.fixture(scope="module")
def states_file(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("states") / "captured.safetensors"
    capture_states(str(tiny), str(path), n_streams=4, length=40, seed=0)
    return path


@pytest.mark.slow  # two whole evaluations: CI's slow lane (pyproject.toml)
def test_evaluation_unchanged_with_stores_on_disk(tiny, corpus, states_file, tmp_path, monkeypatch):
    settings = DriftSettings(
        regime=AUX_REGIMES,
        formats=("bf16", "nvfp4"),
        blocks=24,
        seed=3,
        acceptance=True,
        states=str(states_file),
    )
    in_memory = evaluate_drift(replace(settings, model=tiny), corpus)

    opened = []
    scratch_file = blockstore._scratch_file

    def counted(directory, nbytes):
        opened.append(directory)
        return scratch_file(directory, nbytes)

    monkeypatch.setattr(blockstore, "MEMORY_BYTES", 0)
    monkeypatch.setattr(blockstore, "_scratch_file", counted)
    # no aux cache: gauss and heavy are drawn again per variant, boot's go to a scratch file
    monkeypatch.setattr(batches, "AUX_CACHE_BYTES", 0)
    # the target's lm_head (--states) held bf16 and upcast per use, in uneven row chunks
    monkeypatch.setattr(weights_module, "HOLD_ELEMENTS", 0)
    monkeypatch.setattr(weights_module, "UPCAST_CHUNK_ELEMENTS", 0)
    monkeypatch.setattr(weights_module, "UPCAST_MIN_ROWS", 40)
    on_disk = evaluate_drift(replace(settings, model=tiny, scratch_dir=str(tmp_path)), corpus)
    # logits and U per regime (3 aux regimes and the states regime), and boot's aux states
    assert opened == [str(tmp_path)] * (2 * (len(AUX_REGIMES) + 1) + 1)
    assert os.listdir(tmp_path) == []
    assert on_disk == in_memory


def test_target_head_upcast_per_use_matches_the_fp32_copy(monkeypatch):
    """--states' target logits: ``hidden @ lm_head.float().T`` (the fp32 copy it replaced) is
    bit-identical to the bf16 lm_head upcast 40 rows at a time, which holds no fp32 copy (the
    tiny preset's shapes: at [50, 64] this CPU's GEMM already differs in the last bit, and so
    do chunks of 7 rows)."""
    monkeypatch.setattr(weights_module, "HOLD_ELEMENTS", 0)
    monkeypatch.setattr(weights_module, "UPCAST_CHUNK_ELEMENTS", 0)
    monkeypatch.setattr(weights_module, "UPCAST_MIN_ROWS", 40)
    gen = torch.Generator().manual_seed(11)
    lm_head = torch.randn(1024, 64, generator=gen).bfloat16()  # [V, H]
    hidden = torch.randn(4, 7, 64, generator=gen)  # [n, B, H]
    held = weights_module.ComputeWeights({"lm_head.weight": lm_head}, torch.float32)
    assert held.stored["lm_head.weight"].data_ptr() == lm_head.data_ptr()
    got = held.linear("lm_head.weight", hidden)
    assert torch.equal(got, hidden @ lm_head.float().T), (
        (got - hidden @ lm_head.float().T).abs().max()
    )


def test_spilled_tensors_round_trip_any_shape_and_dtype(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(3, 5, 7, generator=gen).bfloat16(),  # boot's aux states are bf16
        torch.randn(1, 2, generator=gen),
        torch.empty(0, 4, dtype=torch.bfloat16),
        torch.tensor([float("nan"), -0.0, float("inf")]).bfloat16(),
    ]
    store = Store(str(tmp_path), memory_bytes=0)
    for i, t in enumerate(tensors):
        store.put(i, t)
    for i, t in reversed(list(enumerate(tensors))):
        got = store.get(i)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    store.close()
    assert os.listdir(tmp_path) == []


class _Source:
    """A [2, 30, 4] tensor produced in order (as the streamed causal pass, which holds its
    cache), noting what it is asked in ``asked``."""

    def __init__(self, whole: torch.Tensor, asked: list):
        self.whole, self.shape, self.asked = whole, tuple(whole.shape), asked

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        self.asked.append((t0, t1))
        return self.whole[:, t0:t1].clone()


def test_a_recorded_source_is_taken_once_and_read_back_by_any_range(tmp_path):
    """...and, once taken whole, is dropped with what it holds."""
    whole = torch.randn(2, 30, 4, generator=torch.Generator().manual_seed(7)).bfloat16()
    asked: list = []
    source = _Source(whole, asked)
    alive = weakref.ref(source)
    with Store(str(tmp_path), memory_bytes=0) as store:
        recorded = Recorded(source, store)
        del source
        taken = [(0, 7), (7, 8), (8, 30)]
        for a, b in taken:
            assert not recorded.complete and alive() is not None
            assert torch.equal(recorded.rows(a, b), whole[:, a:b])
        assert recorded.complete and (store.fd is not None) and store.held_bytes == 0
        assert alive() is None
        for a, b in [(0, 30), (3, 9), (7, 8), (29, 30), (5, 6)]:
            assert torch.equal(
                recorded.rows(a, b).view(torch.int16), whole[:, a:b].view(torch.int16)
            )
        assert asked == taken  # never asked again
    assert os.listdir(tmp_path) == []
