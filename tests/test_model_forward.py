"""Structural tests of the DSpark forward (docs/model.md): each would catch one classic
mistake, plus batching and precision agreement."""

import dataclasses
import math

import pytest
import torch
from model_helpers import random_model_weights

from qstream.arch.dspark_mla import PRESETS, DSparkConfig
from qstream.arch.dspark_mla import model as mla
from qstream.arch.dspark_mla.model import DSpark, apply_rope
from qstream.arch.markov import (
    markov_logits,
    rollout,
    sample,
    sampling_probs,
    teacher_forced,
)
from qstream.errors import QStreamError

CFG = PRESETS["tiny"]
S, T = 3, 40
# Two fp32 forwards over differently batched matmuls (draft_one vs 24 blocks packed in rows,
# attended in one pass or in key chunks) differ by summation order only: measured <= 9.4e-6 on
# |U| <= 4.7 (tiny preset, three random models); 5e-5 leaves ~5x margin.
BATCH_ATOL = 5e-5
# bf16 activations vs fp32 on the same (bf16-rounded) weights: relative Frobenius error of U.
# bf16's unit roundoff is 2^-8; measured 5.4-6.6 x 2^-8 on three random-weight tiny models
# (2.4 x 2^-8 on a synth checkpoint), 256 blocks each.  Bound: 8 x 2^-8.
BF16_REL_ERR = 8 * 2.0**-8


@pytest.fixture(scope="module")
def weights():
    return random_model_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def model(weights):
    return DSpark(CFG, weights)


def _aux(seed=1):
    return torch.randn(S, T, CFG.aux_size, generator=torch.Generator().manual_seed(seed))


def _blocks(model, aux, stream, anchor, first=None):
    stream, anchor = torch.tensor(stream), torch.tensor(anchor)
    first = torch.full_like(stream, 7) if first is None else torch.tensor(first)
    return model.draft(model.context(aux), stream, anchor, first)


def test_rope_rotates_interleaved_pairs_not_halves():
    # one pair (x0, x1) = (1, 0) rotated by pi/2 must become (0, 1): interleaved layout
    x = torch.zeros(1, 8)
    x[0, 0] = 1.0
    inv_freq = torch.tensor([torch.pi / 2, 0.0, 0.0, 0.0])
    out = apply_rope(x, torch.tensor([1]), inv_freq)
    torch.testing.assert_close(out[0, :2], torch.tensor([0.0, 1.0]), atol=1e-6, rtol=0)
    assert out[0, 4].abs() < 1e-6  # half-split would have moved it to index d/2 = 4


def test_softmax_scale_carries_mscale_squared(model):
    c = CFG
    plain = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    m = 0.1 * c.rope_parameters.mscale_all_dim * torch.log(torch.tensor(32.0)).item() + 1
    assert abs(model.scale - plain * m * m) < 1e-9
    assert abs(PRESETS["k3"].softmax_scale - 0.130861) < 5e-7


def _yarn_mscale(factor, mscale):
    """docs/model.md's yarn_get_mscale, written out."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@pytest.mark.parametrize(
    "factor, mscale, mscale_all_dim",
    [(32.0, 1.0, 1.0), (32.0, 2.0, 1.0), (32.0, 1.0, 0.0), (40.0, 0.707, 0.707), (1.0, 2.0, 1.0)],
)
def test_rope_mscale_is_the_yarn_ratio(factor, mscale, mscale_all_dim):
    yarn = dataclasses.replace(
        CFG.rope_parameters, factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim
    )
    cfg = dataclasses.replace(CFG, rope_parameters=yarn, max_position_embeddings=int(factor * 128))
    expected = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    assert cfg.rope_mscale == pytest.approx(expected, rel=1e-15, abs=0)
    if mscale == mscale_all_dim:
        assert cfg.rope_mscale == 1.0  # exactly: the presets' forward is untouched


def test_mscale_scales_cos_and_sin_by_the_ratio(weights):
    """mscale 2, mscale_all_dim 1: the rotated rope parts (query and key) are the mscale-1
    ones times (0.1·2·ln 32 + 1) / (0.1·ln 32 + 1); everything else is unchanged."""
    yarn = dataclasses.replace(CFG.rope_parameters, mscale=2.0, mscale_all_dim=1.0)
    scaled_cfg = dataclasses.replace(CFG, rope_parameters=yarn)
    ratio = _yarn_mscale(32.0, 2.0) / _yarn_mscale(32.0, 1.0)
    plain, scaled = DSpark(CFG, weights).layers[0], DSpark(scaled_cfg, weights).layers[0]
    h = torch.randn(2, 9, CFG.hidden_size, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(100, 109)
    latent, k_rope = plain.latent(h, pos)
    latent_s, k_rope_s = scaled.latent(h, pos)
    torch.testing.assert_close(latent_s, latent, rtol=0, atol=0)
    # fp32: (x·cos·m) vs (x·cos)·m differ by rounding only, a few ulps of values up to ~4
    torch.testing.assert_close(k_rope_s, k_rope * ratio, rtol=1e-6, atol=1e-6)
    q, q_s = plain.query(h, pos), scaled.query(h, pos)
    nope = CFG.qk_nope_head_dim
    torch.testing.assert_close(q_s[..., :nope], q[..., :nope], rtol=0, atol=0)
    torch.testing.assert_close(q_s[..., nope:], q[..., nope:] * ratio, rtol=1e-6, atol=1e-6)


def test_block_cannot_see_context_at_or_after_its_anchor(model):
    p = 17
    aux = _aux()
    before = _blocks(model, aux, [1], [p]).logits_base
    changed = aux.clone()
    gen = torch.Generator().manual_seed(5)
    changed[1, p:] = torch.randn(T - p, CFG.aux_size, generator=gen) * 10  # its own positions >= p
    changed[0] = torch.randn(T, CFG.aux_size, generator=gen)  # another stream entirely
    after = _blocks(model, changed, [1], [p]).logits_base
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    changed[1, p - 1] += 5.0  # ... while position p-1 is visible
    assert not torch.allclose(_blocks(model, changed, [1], [p]).logits_base, before)


def test_no_causal_mask_inside_the_block(model, weights):
    # A later block position must influence an earlier one: change the mask token's embedding,
    # which only positions 1..B-1 use, and look at position 0 (which embeds first_token).
    w = dict(weights)
    w["embed_tokens.weight"] = weights["embed_tokens.weight"].clone()
    w["embed_tokens.weight"][CFG.mask_token_id] += 1.0
    other = DSpark(CFG, w)
    aux = _aux()
    a = _blocks(model, aux, [0], [10]).logits_base[0, 0]
    b = _blocks(other, aux, [0], [10]).logits_base[0, 0]
    assert (a - b).abs().max() > 1e-3, "position 0 ignores the later (mask) positions"


def test_markov_bias_uses_the_previous_token(model, weights):
    U = torch.zeros(1, 1, CFG.vocab_size)
    prev = torch.tensor([[5]])
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    # markov_w1 is an embedding [V, r] indexed by prev; markov_w2 a Linear r -> V, i.e. [V, r]
    torch.testing.assert_close(markov_logits(model, U, prev)[0, 0], w2 @ w1[5])
    # rollout feeds prev_0 = ids[p], then each drafted token
    aux = _aux()
    blocks = _blocks(model, aux, [0, 2], [5, 30], [11, 12])
    greedy = rollout(model, blocks)
    assert greedy.prev[:, 0].tolist() == [11, 12]
    assert torch.equal(greedy.prev[:, 1:], greedy.tokens[:, :-1])
    expect = blocks.logits_base + (w1[greedy.prev] @ w2.T)
    torch.testing.assert_close(greedy.logits, expect, atol=1e-5, rtol=0)
    assert torch.equal(greedy.tokens, greedy.logits.argmax(-1))


def test_transposed_markov_table_is_refused(weights):
    w = dict(weights)
    w["markov_head.markov_w1.weight"] = weights["markov_head.markov_w1.weight"].T.contiguous()
    with pytest.raises(QStreamError, match=r"markov_w1.weight.*\[16, \d+\].*expected \[\d+, 16\]"):
        DSpark(CFG, w)


@pytest.mark.parametrize("row_cost", [None, 100.0], ids=["cost-model", "multi-slot-rows"])
@pytest.mark.parametrize("key_chunk", [None, 8], ids=["one-pass", "key-chunked"])
def test_batched_engine_equals_the_plain_forward(model, key_chunk, row_cost, monkeypatch):
    # draft() (rows of one slot as the tiny preset's cost model packs
    # them, or, with rows made costly, packed rows of several slots and a busy stream over
    # several rows; with key_chunk=8 the online softmax over 5 key chunks) against draft_one
    if row_cost is not None:
        monkeypatch.setattr(mla, "_row_cost", lambda config, T: row_cost)
    aux = _aux()
    gen = torch.Generator().manual_seed(9)
    stream = torch.randint(0, S, (24,), generator=gen)
    stream[:10] = 1  # a busy stream: spans several rows
    anchor = torch.randint(0, T, (24,), generator=gen)
    first = torch.randint(0, CFG.vocab_size, (24,), generator=gen)
    ctx = model.context(aux)
    batched = model.draft(ctx, stream, anchor, first, key_chunk=key_chunk)
    assert torch.equal(batched.first_token, first)
    for n in range(24):
        one = model.draft_one(ctx, int(stream[n]), int(anchor[n]), int(first[n]))
        err = (one.logits_base[0] - batched.logits_base[n]).abs().max().item()
        assert err <= BATCH_ATOL, f"block {n}: |diff| {err:.3g} > {BATCH_ATOL}"
        torch.testing.assert_close(one.hidden[0], batched.hidden[n], atol=BATCH_ATOL, rtol=0)


def test_per_stream_context_lengths(model):
    aux = _aux()
    lengths = torch.tensor([T, 12, 25])
    ctx = model.context(aux, lengths)
    with pytest.raises(ValueError, match="anchor"):
        model.draft(ctx, [1], [13], [3])
    short = model.draft(ctx, [1], [12], [3]).logits_base
    alone = model.draft(model.context(aux[1:2, :12]), [0], [12], [3]).logits_base
    torch.testing.assert_close(short, alone, atol=BATCH_ATOL, rtol=0)


def test_bf16_path_tracks_fp32(weights):
    rounded = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    gen = torch.Generator().manual_seed(2)
    stream, anchor = (
        torch.randint(0, S, (64,), generator=gen),
        torch.randint(1, T, (64,), generator=gen),
    )
    first = torch.randint(0, CFG.vocab_size, (64,), generator=gen)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = DSpark(CFG, rounded, dtype)
        out[dtype] = model.draft(model.context(_aux()), stream, anchor, first).logits_base
    ref, low = out[torch.float32], out[torch.bfloat16]
    rel = ((low - ref).norm() / ref.norm()).item()
    assert 0 < rel <= BF16_REL_ERR, f"relative error {rel:.4f} not in (0, {BF16_REL_ERR:.4f}]"


def test_sampled_rollout_uses_common_random_numbers(model):
    aux = _aux()
    blocks = _blocks(model, aux, [0, 1, 2, 0], [3, 9, 20, 33])
    noise = torch.empty(4, CFG.block_size, CFG.vocab_size).exponential_(
        generator=torch.Generator().manual_seed(4)
    )
    a = rollout(model, blocks, noise, temperature=0.7, top_p=0.9)
    # each step's token is the race on that step's noise over its own tempered nucleus, so
    # two models given the same noise are coupled step by step
    for k in range(CFG.block_size):
        race = sample(sampling_probs(a.logits[:, k], 0.7, 0.9), noise[:, k])
        assert torch.equal(a.tokens[:, k], race), f"step {k}"
    tf = teacher_forced(model, blocks, a.tokens)
    torch.testing.assert_close(tf.logits, a.logits, rtol=0, atol=0)
    torch.testing.assert_close(tf.confidence, a.confidence, rtol=0, atol=0)
    assert ((a.confidence > 0) & (a.confidence < 1)).all()


def test_race_sampling_respects_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = sampling_probs(logits, 1.0, 0.8)  # nucleus {0, 1}: 0.5 + 0.3 >= 0.8
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # the race picks the largest p / E: a tiny E makes a kept token win, never a dropped one
    race = torch.tensor([[1.0, 1e-6, 1e-9, 1e-9]])
    assert sample(probs, race).item() == 1
    assert sample(probs, torch.tensor([[1e-6, 1.0, 1e-9, 1e-9]])).item() == 0


def test_causal_mode_is_causal(model):
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    out = model.causal_hidden(ids)
    assert out.shape == (2, 20, CFG.num_hidden_layers, CFG.hidden_size)
    changed = ids.clone()
    changed[:, 12:] = (ids[:, 12:] + 1) % CFG.vocab_size
    again = model.causal_hidden(changed)
    torch.testing.assert_close(again[:, :12], out[:, :12], rtol=0, atol=0)
    assert not torch.allclose(again[:, 12], out[:, 12])


def test_config_errors_name_key_and_value():
    data = CFG.to_json()
    assert DSparkConfig.from_json(data) == CFG
    bad = {**data, "num_target_layers": 4}
    with pytest.raises(ValueError, match=r"num_target_layers = 4"):
        DSparkConfig.from_json(bad)
    missing = {k: v for k, v in data.items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DSparkConfig.from_json(missing)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dataclasses.replace(CFG, max_position_embeddings=1000)
    with pytest.raises(ValueError, match="mask_token_id"):
        dataclasses.replace(CFG, mask_token_id=CFG.vocab_size)


@pytest.mark.parametrize(
    ("counts", "row_cost", "M"),
    [
        ([2, 1, 1, 1], 0.1, 1),  # one slot per row: 5 rows beat 4 rows of 2 (3 slots padding)
        ([2, 1, 1, 1], 5.0, 2),  # rows cost more than padding: the busy stream keeps one row
        ([3, 3, 3], 0.0, 3),  # no padding at M = 3 and the fewest rows: ties go to larger M
        ([5, 1], 0.5, 1),
        ([5, 1], 3.0, 5),  # 2 rows x 5 slots (4 padding) beat 6 rows x 1
    ],
)
def test_packing_minimises_padding_plus_row_work(counts, row_cost, M):
    stream = torch.tensor([s for s, c in enumerate(counts) for _ in range(c)])
    stream = stream[torch.randperm(stream.numel(), generator=torch.Generator().manual_seed(0))]
    anchor = torch.arange(stream.numel()) + 1
    packing = mla._pack(stream, anchor, row_cost)
    assert packing.M == M
    # every block in exactly one slot of a row of its own stream, at its own anchor
    slots = packing.slot_of_block
    assert sorted(slots.tolist()) == sorted(set(slots.tolist()))
    assert torch.equal(packing.block_of_slot[slots], torch.arange(stream.numel()))
    assert torch.equal(packing.row_stream[slots // M], stream)
    assert torch.equal(packing.anchor.flatten()[slots], anchor)
    assert (packing.block_of_slot == -1).sum() == packing.R * M - stream.numel()


def test_row_cost_at_k3_makes_padding_dear():
    # a K3 padding slot (7 positions through 5 layers and a 163,840-token lm_head) costs more
    # than expanding 300 context keys in every layer for one more row (about 0.55 of a slot)
    costs = [mla._row_cost(PRESETS["k3"], T) for T in (0, 128, 300, 1000)]
    assert costs[0] == 0 and costs == sorted(costs)
    assert costs[1] < 0.25 and costs[2] < 1 < costs[3]
