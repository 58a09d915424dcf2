"""Per-module sensitivity and the long-context sweep (issue 7, parts 2 and 3) on a synthesized
tiny draft, and the chunked attention that keeps long contexts in bounded memory."""

import json
from dataclasses import replace

import pytest
import torch
from card_helpers import tables
from cli_helpers import cli_error, cli_ok
from click.testing import CliRunner
from model_helpers import long_context_model, random_model_weights

import qstream.arch.dspark_mla.model as mla
import qstream.eval.batches as batches
from qstream.arch.dspark_mla import PRESETS, load_config, load_weights
from qstream.arch.dspark_mla.model import DSpark
from qstream.card.build import write_card
from qstream.cli import cli
from qstream.eval.batches import SyntheticAuxChunks
from qstream.eval.drift import DriftSettings, default_edges, evaluate_drift, long_streams
from qstream.eval.sensitivity import _serving_options, _suggest, module_kinds
from qstream.regimes import HEAVY, REGIMES
from qstream.serving import Variant

# The sensitivity tests check structure (which tensors each step quantizes, the cumulative order
# against the single steps' figures, the floor against bf16, the suggestion against its own
# re-measurement), which holds at any block count; the one measured fact they need is that the
# least harmful kind stays within 1 token of bf16: mlp.down_proj, 0.62 tokens below it at 32
# blocks (0.73 at 64; the next kind, context_proj, 1.09 and 0.92).
BLOCKS = 32
# Chunked (online-softmax) against one-pass attention, fp32: the two sum the same exp terms in a
# different order and grouping.  Higham's bound for reordering a sum of n fp32 terms is
# (n - 1)·u relative, u = 2^-24: 9e-5 for the 1500 keys here, before the five layers; measured
# max |dU| / max |U| = 1.2e-6 (torch 2.13, CPU).  The bound is Higham's, not the measurement.
ONLINE_SOFTMAX_RTOL = 1500 * 2.0**-24


@pytest.fixture(scope="module")
def sensitivity(tiny, corpus):
    settings = DriftSettings(
        regime=("heavy",), formats=("bf16",), blocks=BLOCKS, sensitivity=True, tolerance=1.0
    )
    return evaluate_drift(replace(settings, model=tiny), corpus)


def _ceiling(variant_result):
    return variant_result["metrics"]["rollouts"]["greedy"]["ceiling"]


def test_each_single_step_quantizes_exactly_its_kind(tiny, sensitivity):
    sens = sensitivity["regimes"]["heavy"]["sensitivity"]
    kinds = module_kinds(load_weights(tiny), "nvfp4", load_config(tiny))
    assert sens["format"] == "nvfp4"
    assert [e["kind"] for e in sens["single"]] == [k.name for k in kinds]
    for entry, kind in zip(sens["single"], kinds):
        assert entry["quantized_tensors"] == [f"{m}.weight" for m in kind.modules], kind.name
    names = {k.name for k in kinds}
    assert "mlp.gate_proj + mlp.up_proj" in names  # fused partners never split
    assert "self_attn.q_a_proj + self_attn.kv_a_proj_with_mqa" in names
    every = [m for k in kinds for m in k.modules]
    assert len(every) == len(set(every)) and "markov_head.markov_w1" not in every  # embedding


def test_cumulative_order_is_by_measured_harm(sensitivity):
    sens = sensitivity["regimes"]["heavy"]["sensitivity"]
    single = sens["single"]
    harm = sorted(single, key=lambda e: (-e["ceiling_gap"], e["kl_mean"]))
    assert [e["add"] for e in sens["cumulative"]] == [e["kind"] for e in harm]
    sizes = [len(e["quantized_tensors"]) for e in sens["cumulative"]]
    assert sizes == sorted(sizes) and sizes[-1] == sum(len(e["modules"]) for e in single)


def test_quantizing_nothing_equals_the_bf16_floor(sensitivity):
    regime = sensitivity["regimes"]["heavy"]
    floor, bf16 = regime["sensitivity"]["floor"], regime["variants"]["bf16"]["metrics"]
    assert floor["ceiling"] == bf16["rollouts"]["greedy"]["ceiling"]
    assert floor["kl_p99"] == bf16["kl"]["p99"] and floor["quantized_tensors"] == []


def test_suggested_include_list_satisfies_the_tolerance(tiny, corpus, sensitivity):
    sens = sensitivity["regimes"]["heavy"]["sensitivity"]
    best = sens["suggested"]
    within = [i for i, e in enumerate(sens["cumulative"]) if e["ceiling_gap"] >= -1.0]
    # (on the tiny draft only mlp.down_proj stays within 1 token once the heads vLLM never
    # quantizes are out of the candidates, docs/vllm.md)
    assert best["steps"] == within[-1] + 1 and len(best["include"]) >= 1
    assert best["command"] == "--include_layers " + " ".join(best["include"])
    # measured again as an ordinary variant with that include list: same ceiling, within tolerance
    include = tuple(best["include"])
    settings = DriftSettings(
        model=tiny, regime="heavy", formats=("nvfp4",), blocks=BLOCKS, include_layers=include
    )
    again = _ceiling(evaluate_drift(settings, corpus)["regimes"]["heavy"]["variants"]["nvfp4"])
    assert again == best["ceiling"]
    assert again["value"] >= sens["floor"]["ceiling"]["value"] - sens["tolerance"]


def test_default_buckets_straddle_the_yarn_boundary():
    config = PRESETS["tiny"]
    edges = default_edges(config)
    boundary = config.rope_parameters.original_max_position_embeddings
    assert edges == (32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert edges[0] < boundary < edges[-1] == config.max_position_embeddings
    assert boundary in edges  # no bucket mixes both sides


def test_long_streams_concatenate_documents_with_eos(corpus):
    streams = long_streams(corpus, eos_token_id=0, length=300)
    joined = torch.cat([t for s in corpus.streams for t in (s, torch.tensor([0]))])
    assert all(s.numel() == 300 for s in streams.streams)
    assert torch.equal(torch.cat(streams.streams), joined[: 300 * len(streams.streams)])
    assert len(streams.streams) == joined.numel() // 300


def test_context_sweep_reports_every_bucket(tiny, corpus):
    settings = DriftSettings(
        model=tiny,
        regime="heavy",
        formats=("bf16",),
        blocks=16,
        context_lengths=(32, 128, 600),
        context_blocks=16,
    )
    sweep = evaluate_drift(settings, corpus)["regimes"]["heavy"]["context_sweep"]
    assert [(b["lo"], b["hi"], b["side"]) for b in sweep["buckets"]] == [
        (32, 128, "below"),
        (128, 600, "above"),
    ]
    for b in sweep["buckets"]:
        assert (
            b["lo"]
            <= b["anchors"]["context_length_min"]
            <= b["anchors"]["context_length_max"]
            < b["hi"]
        )
        assert b["variants"]["bf16"]["metrics"]["n_blocks"] == 16


def test_chunked_attention_equals_one_pass_attention_on_a_long_context():
    model, config = long_context_model()
    gen = torch.Generator().manual_seed(1)
    ctx = model.context(torch.randn(2, 1500, config.aux_size, generator=gen))
    stream, anchor = torch.tensor([0, 0, 1, 1]), torch.tensor([1499, 700, 1499, 90])
    first = torch.tensor([5, 6, 7, 8])
    whole = model.draft(ctx, stream, anchor, first)
    assert model.widest == 1499  # one pass: the scores span the whole context
    model.widest = 0
    chunked = model.draft(ctx, stream, anchor, first, key_chunk=128)
    assert model.widest == 128  # bounded by the chunk, not by the context
    scale = whole.logits_base.abs().max()
    err = (chunked.logits_base - whole.logits_base).abs().max() / scale
    assert err <= ONLINE_SOFTMAX_RTOL, f"relative error {err:.3g} > {ONLINE_SOFTMAX_RTOL:.3g}"
    assert torch.equal(chunked.logits_base.argmax(-1), whole.logits_base.argmax(-1))


def test_chunked_causal_queries_match_and_stay_bounded():
    model, config = long_context_model()
    ids = torch.randint(0, config.vocab_size, (2, 600), generator=torch.Generator().manual_seed(2))
    whole = model.causal_hidden(ids)
    assert model.tallest == 600  # one pass: [S, n, 600, 600] scores
    model.tallest = 0
    chunked = model.causal_hidden(ids, query_chunk=64)
    assert model.tallest == 64  # bounded: no score tensor holds more than 64 queries
    scale = whole.abs().max()
    err = (chunked - whole).abs().max() / scale
    assert err <= 600 * 2.0**-24, f"relative error {err:.3g}"  # as ONLINE_SOFTMAX_RTOL, 600 keys
    # the first query chunk sees 64 keys; the widest the full prefix, never a [T, T] square
    assert torch.equal(chunked[:, :64], model.causal_hidden(ids[:, :64], query_chunk=64)[:, :64])


def test_cli_sensitivity_and_sweep_json_and_card(tiny, tmp_path):
    # the options reach the results and the card: nothing measured, so 8 blocks of the built-in
    # corpus (whose contexts are long) do
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        cli,
        [
            "eval-drift",
            "--model",
            tiny,
            "--regime",
            "gauss",
            "--formats",
            "bf16",
            "--blocks",
            "8",
            "--sensitivity",
            "--sensitivity-format",
            "mxfp4",
            "--tolerance",
            "7",
            "--context-lengths",
            "32,128,300",
            "--context-blocks",
            "8",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())["regimes"]["gauss"]
    assert data["sensitivity"]["format"] == "mxfp4"
    assert "--include_layers" in result.output
    assert [b["hi"] for b in data["context_sweep"]["buckets"]] == [128, 300]
    card, written = write_card([out], tmp_path / "CARD.md")
    keys = tables(card)
    assert "sensitivity_gauss" in keys and "context_sweep_gauss" in keys
    assert any(p.name == "context.png" for p in written)


def test_steps_under_a_serving_configuration_are_its_variants_on_their_modules(tiny, corpus):
    """--sensitivity-format takes a configuration token and --kv-cache-dtype serves it: the
    floor is bf16 served with that KV cache, a step is the configuration on its modules alone
    (activations quantized there only), each measured as the same variant of an ordinary run."""
    token, kv = "nvfp4+a=nvfp4", "fp8_e4m3"
    attention = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")
    # two kinds left (context_proj, mlp.down_proj): five steps
    ignore = tuple(f"self_attn.{m}" for m in attention) + ("mlp.gate_proj", "mlp.up_proj")
    base = DriftSettings(model=tiny, regime=("gauss",), formats=("bf16",), blocks=8,
                         kv_cache_dtype=kv, ignore_layers=ignore)  # fmt: skip
    probed = replace(base, sensitivity=True, sensitivity_format=token)
    sens = evaluate_drift(probed, corpus)["regimes"]["gauss"]["sensitivity"]
    assert (sens["format"], sens["configuration"]) == (
        "nvfp4",
        {
            "activations": "nvfp4",
            "kv_cache": kv,
            "kv_scale": "1.0",
            "target": "unquantized",
            "head": "stored",
        },
    )
    step = sens["single"][0]
    alone = replace(base, formats=("bf16", token), include_layers=tuple(step["include"]))
    variants = evaluate_drift(alone, corpus)["regimes"]["gauss"]["variants"]
    for entry, name in ((sens["floor"], f"bf16+kv={kv}"), (step, f"{token}+kv={kv}")):
        metrics = variants[name]["metrics"]
        assert entry["quantized_tensors"] == variants[name]["quantized_tensors"], name
        assert entry["ceiling"] == metrics["rollouts"]["greedy"]["ceiling"], name
        assert entry["kl_mean"] == metrics["kl"]["mean"]["value"], name
    error = cli_error(["eval-drift", "--model", tiny, "--blocks", "8", "--sensitivity",
                       "--sensitivity-format", "bf16+kv=fp8"])  # fmt: skip
    assert "--sensitivity-format 'bf16+kv=fp8': its weights must be one of" in error


@pytest.mark.parametrize(
    ("token", "options"),
    [
        ("nvfp4", ""),
        ("fp8+a=fp8-dynamic", " --activations fp8-dynamic"),
        ("nvfp4+a=nvfp4", " --activations nvfp4 --calibration gauss"),
        ("fp8+a=fp8-static+kv=fp8_e4m3+kvscale=calibrated",
         " --activations fp8-static --kv-cache-scheme fp8 --calibration gauss"),
    ],
)  # fmt: skip
def test_the_suggested_command_writes_the_probed_configuration(tiny, tmp_path, token, options):
    """The suggested quantize line carries what the probed configuration serves beyond its
    weights (a static scheme calibrated on the regime it ran on), and quantize takes it."""
    assert _serving_options(Variant.parse(token), "gauss", 0) == options
    step = {"within_tolerance": True, "include": ["mlp.down_proj"], "ceiling": 1.0,
            "ceiling_gap": 0.0}  # fmt: skip
    command = _suggest([step], DriftSettings(model=tiny), Variant.parse(token), "gauss")["command"]
    assert command == "--include_layers mlp.down_proj" + options
    if "kv-cache-scheme" in options:
        return  # the K3 draft's KV scales are refused (vLLM does not load them): test_quantize_calibration
    fmt = Variant.parse(token).source
    args = ["quantize", "--model_dir", tiny, "--output_dir", str(tmp_path / "out"),
            "--quant_format", fmt, "--dry-run", *command.split()]  # fmt: skip
    cli_ok(args + (["--calibration-blocks", "2"] if "--calibration" in options else []))


def test_cli_bare_context_lengths_and_bad_edges(tiny):
    runner = CliRunner()
    bad = runner.invoke(
        cli, ["eval-drift", "--model", tiny, "--blocks", "8", "--context-lengths", "64,32"]
    )
    assert bad.exit_code == 2 and "increasing" in bad.stderr  # a usage error
    over = runner.invoke(
        cli,
        [
            "eval-drift",
            "--model",
            tiny,
            "--blocks",
            "8",
            "--formats",
            "bf16",
            "--context-lengths",
            "32,9000",
            "--context-blocks",
            "8",
        ],
    )
    assert over.exit_code == 1 and "max_position_embeddings" in over.stderr


@pytest.mark.parametrize("regime", ["gauss", "heavy"])
def test_aux_drawn_in_position_ranges_equals_the_whole_draw(regime):
    """A long-context batch's gauss / heavy states are drawn range by range as the context
    projection takes them; they must be exactly the states drawn whole (streams shorter than
    the batch, ranges that cut streams anywhere)."""
    cfg = PRESETS["tiny"]
    streams, lengths, T = [3, 8, 11], [50, 17, 64], 57
    whole = SyntheticAuxChunks(REGIMES[regime], cfg, streams, lengths, T, 5, torch.bfloat16)
    whole = whole.rows(0, T)  # all at once
    chunks = SyntheticAuxChunks(REGIMES[regime], cfg, streams, lengths, T, 5, torch.bfloat16)
    assert chunks.shape == tuple(whole.shape)
    edges = [0, 1, 9, 17, 18, 40, 57]
    parts = [chunks.rows(a, b) for a, b in zip(edges, edges[1:])]
    assert torch.equal(torch.cat(parts, dim=1).view(torch.int16), whole.view(torch.int16))
    with pytest.raises(RuntimeError, match="in order"):
        chunks.rows(0, 4)


def test_context_from_position_ranges_matches_the_whole_tensor(monkeypatch):
    """DSpark.context on aux it may only take a few positions at a time: the same latents as
    from the whole tensor, to fp32 rounding (the projections' GEMMs see fewer rows)."""
    cfg = PRESETS["tiny"]
    model = DSpark(cfg, random_model_weights(cfg, seed=2), torch.float32)
    streams, lengths, T = [0, 1], [40, 33], 40
    drawn = SyntheticAuxChunks(HEAVY, cfg, streams, lengths, T, 1, torch.bfloat16).rows(0, T)
    whole = model.context(drawn)
    monkeypatch.setattr(mla, "CONTEXT_ELEMENTS", 7 * 2 * cfg.aux_size)  # 7 positions a time
    chunks = SyntheticAuxChunks(HEAVY, cfg, streams, lengths, T, 1, torch.bfloat16)
    taken = []
    monkeypatch.setattr(
        chunks, "rows", lambda t0, t1, rows=chunks.rows: taken.append(t0) or rows(t0, t1)
    )
    ranged = model.context(chunks)
    assert taken == list(range(0, T, 7))  # the patched budget steered the ranges
    for a, b in zip(whole.latent + whole.rope_key, ranged.latent + ranged.rope_key):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two whole evaluations: CI's slow lane (pyproject.toml)
def test_evaluation_with_aux_never_held_whole_is_unchanged(tiny, corpus, monkeypatch):
    """Every batch's gauss / heavy states handed over lazily (as a long-context K3 bucket's
    are): with one range per batch the arithmetic is the same, so the results are identical."""
    settings = DriftSettings(regime=("gauss", "heavy"), formats=("bf16", "nvfp4"), blocks=48)
    held = evaluate_drift(replace(settings, model=tiny), corpus)
    monkeypatch.setattr(batches, "LAZY_AUX_BYTES", 0)
    handed = []
    get = batches.AuxStates.get
    monkeypatch.setattr(
        batches.AuxStates, "get", lambda self, *a: handed.append(get(self, *a)) or handed[-1]
    )
    assert evaluate_drift(replace(settings, model=tiny), corpus) == held
    # the patched budget steered every batch's states to the lazy path
    assert handed and not any(isinstance(aux, torch.Tensor) for aux in handed)


class _Count:
    def __init__(self):
        self.done, self.work_done, self.work_of = 0, 0.0, {}

    def start(self, total, work=None):
        self.total, self.work = total, work

    def advance(self, what, blocks, work=0.0, kind="variants"):
        self.done += blocks
        self.work_done += work
        if blocks:
            self.work_of.setdefault(what, []).append(work / blocks)


def test_a_sweeps_blocks_are_in_the_progress_total(tiny, corpus):
    """With --context-lengths the progress bar has a total (and so an ETA): every bucket's
    passes, counted before the run, are exactly the blocks the run reports, and their work
    (the FLOP model, on which the ETA runs) is what the run reports, a longer bucket's blocks
    weighing more."""
    count = _Count()
    settings = DriftSettings(
        regime=("heavy",),
        formats=("bf16",),
        blocks=16,
        context_lengths=(32, 64, 128),
        context_blocks=8,
    )
    evaluate_drift(replace(settings, model=tiny), corpus, progress=count)
    assert count.total == (16 + 2 * 8) * 2 == count.done
    assert sum(count.work.values()) == pytest.approx(count.work_done, rel=1e-12)
    # per-block work of each reference batch, in order: the corpus's, then bucket [32, 64)'s
    # and bucket [64, 128)'s (one batch each): the longer contexts weigh more
    per_block = count.work_of["heavy: reference"]
    assert len(per_block) >= 3 and per_block[-1] > 1.2 * per_block[-2]
