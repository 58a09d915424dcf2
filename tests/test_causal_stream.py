"""The boot regime at long context: the draft's causal pass streamed a range of positions at a
time over its MLA cache (qstream/arch/dspark_mla/model.py's CausalStream), and the boot and captured aux states a
long-context batch never holds whole (qstream/eval/batches.py, docs/context-sweep.md)."""

from contextlib import closing
from dataclasses import replace

import pytest
import torch
from model_helpers import long_context_model, random_model_weights

import qstream.arch.dspark_mla.model as mla
import qstream.bounded as heap
import qstream.eval.batches as batches
from qstream.arch.dspark_mla import PRESETS, load_config
from qstream.arch.dspark_mla.model import CausalStream, DSpark, causal_flops
from qstream.eval.batches import AuxStates, batch_flops, make_batches
from qstream.eval.corpus import sample_anchors
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.regimes import BOOT

# As tests/test_sensitivity_context.py: Higham's bound for reordering a sum of n fp32 terms,
# (n - 1)·u relative with u = 2^-24, for the 600 keys of the longest stream here.
REORDER_RTOL = 600 * 2.0**-24


def test_one_range_is_the_whole_causal_pass_bit_for_bit():
    model, config = long_context_model()
    ids = torch.randint(0, config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(3))
    whole = model.causal_hidden(ids).flatten(2)
    assert torch.equal(CausalStream(model, ids).rows(0, 300), whole)


def test_streamed_causal_pass_matches_and_stays_bounded(monkeypatch):
    """Ranges cut anywhere (one position, one past a key chunk, the last one), keys taken 40
    at a time: the outputs equal the whole pass to fp32 rounding, and no score tensor spans
    more queries than a range or more keys than a chunk."""
    model, config = long_context_model()
    ids = torch.randint(0, config.vocab_size, (2, 600), generator=torch.Generator().manual_seed(2))
    whole = model.causal_hidden(ids).flatten(2)
    monkeypatch.setattr(mla, "SCORE_BUDGET", 1)
    monkeypatch.setattr(mla, "MIN_KEY_CHUNK", 40)
    model.widest = model.tallest = 0
    stream = CausalStream(model, ids)
    assert stream.shape == tuple(whole.shape)
    edges = [0, 1, 41, 100, 377, 599, 600]
    got = torch.cat([stream.rows(a, b) for a, b in zip(edges, edges[1:])], dim=1)
    assert model.widest == 40 and model.tallest == max(b - a for a, b in zip(edges, edges[1:]))
    err = (got - whole).abs().max() / whole.abs().max()
    assert err <= REORDER_RTOL, f"relative error {err:.3g}"
    assert err > 0  # the chunked path really ran (one pass would be bit-identical)
    with pytest.raises(RuntimeError, match="in order"):
        stream.rows(0, 10)


def test_a_deeper_causal_pass_repeats_the_stack():
    """The boot regime for a draft with fewer layers than aux layers: ``depth`` steps run the
    layers in order and again (qstream.arch.interface.causal_layers); the first L steps are
    the plain pass, step L runs layer 0 on step L - 1's output, and the streamed pass (one
    range) equals the whole one bit for bit."""
    model, config = long_context_model()
    L = config.num_hidden_layers
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    deep = model.causal_hidden(ids, depth=L + 1)
    assert deep.shape == (2, 40, L + 1, config.hidden_size)
    assert torch.equal(deep[:, :, :L], model.causal_hidden(ids))
    layer = model.layers[0]
    x = deep[:, :, L - 1]
    pos = torch.arange(40)
    x = x + model.attention_causal(0, layer.input_norm(x), pos)
    assert torch.equal(deep[:, :, L], x + layer.mlp(x))
    assert torch.equal(CausalStream(model, ids, depth=L + 1).rows(0, 40), deep.flatten(2))


def test_causal_rows_come_in_the_requested_dtype():
    model, config = long_context_model()
    ids = torch.randint(0, config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(4))
    rows = CausalStream(model, ids, torch.bfloat16).rows(0, 50)
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, model.causal_hidden(ids).flatten(2).to(torch.bfloat16))


def _counting_streams(monkeypatch) -> list:
    made: list = []

    class Counting(CausalStream):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(mla, "CausalStream", Counting)  # what the architecture builds
    return made


def test_boot_aux_is_computed_once_and_read_back_bit_exactly(tiny, corpus, monkeypatch):
    """A boot batch too big to hold: the reference's context projection takes the causal
    pass's rows range by range, each written to the scratch file; a variant's pass reads
    the same bits back, in whatever ranges it asks."""
    cfg = PRESETS["tiny"]
    monkeypatch.setattr(batches, "LAZY_AUX_BYTES", 0)
    monkeypatch.setattr(mla, "CONTEXT_ELEMENTS", 13 * cfg.aux_size)  # 13 positions a range
    made = _counting_streams(monkeypatch)
    reference = DSpark(cfg, random_model_weights(cfg, seed=5), torch.float32)
    batch = make_batches(sample_anchors(corpus, 12, cfg.block_size, seed=0), corpus, cfg)[0]
    T = batch.context_length
    with closing(AuxStates(BOOT, corpus, cfg, seed=0)) as aux:
        recorded = aux.get(batch, reference)
        with pytest.raises(RuntimeError, match="reference pass first"):
            aux.get(batch)  # nothing taken yet
        reference.context(recorded)
        assert len(made) == 1
        assert T > 30
        ranges = [0, 5, 13, 14, T - 1, T]
        replay = aux.get(batch)
        again = torch.cat([replay.rows(a, b) for a, b in zip(ranges, ranges[1:])], dim=1)
        assert len(made) == 1  # never computed again
    ids = torch.zeros(len(batch.streams), T, dtype=torch.int64)
    for row, s in enumerate(batch.streams):
        ids[row, : min(T, corpus.streams[s].numel())] = corpus.streams[s][:T]
    streamed = CausalStream(reference, ids, torch.bfloat16)
    step = 13 // len(batch.streams)
    expected = torch.cat([streamed.rows(t, min(T, t + step)) for t in range(0, T, step)], dim=1)
    assert again.dtype == torch.bfloat16 and torch.equal(again, expected)


@pytest.mark.slow  # two whole evaluations: CI's slow lane (pyproject.toml)
def test_evaluation_with_boot_aux_never_held_whole_is_unchanged(tiny, corpus, monkeypatch):
    """Every boot batch streamed and spilled (as a long-context K3 bucket's): with one range
    per batch the arithmetic is the causal pass's, so the results are identical."""
    settings = DriftSettings(regime=("boot",), formats=("bf16", "nvfp4"), blocks=32)
    held = evaluate_drift(replace(settings, model=tiny), corpus)
    monkeypatch.setattr(batches, "LAZY_AUX_BYTES", 0)
    made = _counting_streams(monkeypatch)
    trims: list = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1))
    assert evaluate_drift(replace(settings, model=tiny), corpus) == held
    assert made  # the streamed path ran
    # the heap is trimmed after every range and after every batch, in the reference's pass and
    # each variant's (one range per batch here), and at the end of the reference's pass
    assert len(trims) == 2 * 3 * len(made) + 1


class _Count:
    def __init__(self):
        self.work_done, self.work_of = 0.0, {}

    def start(self, total, work=None):
        if work is not None:  # the second call: the planned work per kind of pass
            self.work = sum(work.values())

    def advance(self, what, blocks, work=0.0, kind=None):
        self.work_done += work
        self.work_of[what] = self.work_of.get(what, 0.0) + work


def test_boot_reference_pass_counts_its_causal_pass_in_the_work(tiny, corpus):
    """The ETA runs on FLOPs: boot's reference pass also runs the causal pass over every
    batch's streams, so it weighs more than a variant's by exactly that, and the plan made
    before the run is what the run reports."""
    count = _Count()
    settings = DriftSettings(regime=("boot",), formats=("bf16",), blocks=24)
    evaluate_drift(replace(settings, model=tiny), corpus, progress=count)
    assert count.work == pytest.approx(count.work_done, rel=1e-12)
    cfg = load_config(tiny)
    max_context = cfg.max_position_embeddings - cfg.block_size
    plan = sample_anchors(corpus, 24, cfg.block_size, settings.seed, max_context=max_context)
    plan_batches = make_batches(plan, corpus, cfg)
    causal = sum(len(b.streams) * causal_flops(cfg, b.context_length) for b in plan_batches)
    extra = count.work_of["boot: reference"] - count.work_of["boot: bf16"]
    assert causal > 0 and extra == pytest.approx(causal, rel=1e-9)
    drafting = sum(batch_flops(cfg, b) for b in plan_batches)
    assert count.work_of["boot: bf16"] == pytest.approx(drafting, rel=1e-12)


def test_causal_flops_count_each_key_once():
    """The FLOP model of a causal pass: T positions' layer work plus T(T+1)/2 attended keys."""
    cfg = PRESETS["tiny"]
    one, two = causal_flops(cfg, 1), causal_flops(cfg, 2)
    per_key = (
        2 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    )
    # two positions: twice one position's work, plus the second one's extra key
    assert two == 2 * one + per_key
