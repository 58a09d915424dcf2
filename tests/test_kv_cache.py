"""The KV cache as vLLM 0.32.0 serves it (docs/eval-drift.md, "Serving configurations"): an fp8
cache's write and read, the K3 draft's absorbed MLA decode arithmetic written out here in
vLLM's op order (vllm/models/kimi_k3/nvidia/mla.py, ``_attention``), and ``kv=`` variants
evaluated on both architectures."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import cli_ok
from model_helpers import random_model_weights
from qwen3_drafts import TINY as QWEN3_TINY
from qwen3_drafts import qwen3_tensors

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.dspark_mla.model import DSpark
from qstream.arch.dspark_qwen3.model import Qwen3DSpark
from qstream.arch.interface import LM_HEAD
from qstream.arch.registry import architecture_of
from qstream.arch.weights import fp8_round_trip
from qstream.errors import QStreamError
from qstream.serving import KV_CACHES, Variant

CFG = PRESETS["tiny"]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def vllm_cache(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """torch's cast of x / scale, where vLLM's saturating store puts the format's largest
    finite value instead of torch's NaN (e4m3fn) or inf (e5m2); read back times scale."""
    y = x.float() / scale
    top = torch.finfo(fp8).max
    stored = torch.where(y.abs() > top, torch.sign(y) * top, y.to(fp8).float())
    return (stored * scale).to(x.dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_an_fp8_cache_stores_x_over_its_scale_saturated(fp8, scale):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.logspace(-9, 6, 4096)
    x = torch.cat((x, torch.tensor([1e9, -1e9, 0.0, 2.0**-20]))).to(torch.bfloat16)
    got = fp8_round_trip(x, fp8, scale)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert torch.equal(got, vllm_cache(x, fp8, scale))
    top = torch.finfo(fp8).max * scale
    assert got[-4].item() == top and got[-3].item() == -top  # saturated, not NaN or inf


def _models(kv: str):
    w = random_model_weights(CFG, seed=1)
    served = DSpark(CFG, w, torch.bfloat16, kv=KV_CACHES[kv])
    return DSpark(CFG, w, torch.bfloat16), served, w


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_k3_attention_is_vllms_absorbed_decode_to_the_bit(kv):
    plain, model, w = _models(kv)
    c, layer = CFG, model.layers[1]
    n, P, r, V, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                     c.v_head_dim, c.kv_lora_rank)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    p, B = 11, c.block_size
    h = torch.randn(B, c.hidden_size, generator=gen).to(torch.bfloat16)
    ctx_h = torch.randn(p, c.hidden_size, generator=gen).to(torch.bfloat16)
    pos = p + torch.arange(B)
    got = model.block_attention(layer, h, pos, *layer.latent(ctx_h, torch.arange(p)))

    # vLLM's inputs: q_b_proj's q with RoPE on q_pe; the cache rows [kv_c_normed | k_pe] of the
    # context (precomputed) and of the block (inserted before forward_mqa reads the cache)
    ref = plain.layers[1]
    q = ref._query(h, pos)  # [B, n, P + r]
    kv_c, k_pe = (torch.cat(t) for t in zip(ref.latent(ctx_h, torch.arange(p)), ref.latent(h, pos)))
    cache = torch.cat((kv_c, k_pe), dim=-1)  # [p + B, L + r]
    # split_kv_b_proj: W_UK [L, n, P], W_UV [L, n, V]; W_UK_T (n, P, L), W_UV (n, L, V)
    weight = w["layers.1.self_attn.kv_b_proj.weight"].to(torch.bfloat16).T
    W_UK, W_UV = weight.reshape(L, n, P + V).split([P, V], dim=-1)
    W_UK_T, W_UV = W_UK.permute(1, 2, 0), W_UV.transpose(0, 1)
    q_nope, q_pe = q.split([P, r], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), W_UK_T).transpose(0, 1)  # BMM1 -> [B, n, L]
    mqa_q = torch.cat((ql_nope, q_pe), dim=-1)
    if kv != "auto":  # fp8 query at q_scale 1.0, upcast back for TRITON_MLA; fp8 cache
        mqa_q = vllm_cache(mqa_q, torch.float8_e4m3fn, 1.0)
        cache = vllm_cache(cache, getattr(torch, str(KV_CACHES[kv].dtype)), 1.0)
    scale = (P + r) ** -0.5  # MultiHeadLatentAttention.__init__, deepseek_yarn
    yarn = c.rope_parameters
    mscale = 1.0 if yarn.factor <= 1 else 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0
    scale *= mscale * mscale
    scores = torch.einsum("bnd,td->bnt", mqa_q.float(), cache.float()) * scale
    probs = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    latent_out = torch.einsum("bnt,tl->bnl", probs, cache[:, :L])  # forward_mqa -> [B, n, L]
    out = torch.bmm(latent_out.transpose(0, 1), W_UV).transpose(0, 1)  # _v_up_proj -> [B, n, V]
    want = F.linear(out.flatten(1), w["layers.1.self_attn.o_proj.weight"].to(torch.bfloat16))
    assert torch.equal(got, want)


def test_the_packed_engine_attends_as_the_plain_forward_when_absorbed():
    _, model, _ = _models("fp8_e4m3")
    gen = torch.Generator().manual_seed(4)
    ctx = model.context(torch.randn(2, 40, CFG.aux_size, generator=gen))
    stream, anchor, first = torch.tensor([0, 1, 0, 1]), torch.tensor([5, 39, 17, 0]), [1, 2, 3, 4]
    batched = model.draft(ctx, stream, anchor, torch.tensor(first))
    for n in range(4):
        one = model.draft_one(ctx, int(stream[n]), int(anchor[n]), first[n])
        # the same roundings; the fp32 sums of a longer, masked key row may differ in order
        torch.testing.assert_close(one.hidden[0], batched.hidden[n], atol=0.05, rtol=0)


def test_qwen3_keys_and_values_are_read_as_the_fp8_cache_holds_them():
    w = qwen3_tensors(QWEN3_TINY, seed=0)
    w.setdefault(LM_HEAD, torch.zeros(QWEN3_TINY.vocab_size, QWEN3_TINY.hidden_size))
    auto = Qwen3DSpark(QWEN3_TINY, w, torch.bfloat16)
    fp8 = Qwen3DSpark(QWEN3_TINY, w, torch.bfloat16, kv=KV_CACHES["fp8"])
    h = torch.randn(2, 5, QWEN3_TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    h, pos = h.to(torch.bfloat16), torch.arange(5)
    for want, got in zip(auto.key_value(0, h, pos), fp8.key_value(0, h, pos)):
        assert torch.equal(got, vllm_cache(want, torch.float8_e4m3fn, 1.0))
        assert not torch.equal(got, want)


def test_a_kv_scale_not_simulated_is_refused_naming_it():
    arch = architecture_of(CFG)
    variant = Variant.parse("bf16+kv=fp8+kvscale=calibrated")
    with pytest.raises(QStreamError, match="kv_scale 'calibrated' is not simulated yet"):
        arch.build(CFG, random_model_weights(CFG, seed=0), variant, "cpu")


@pytest.fixture(scope="module")
def qwen3_draft(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "draft"
    cli_ok(["synth", "--preset", "qwen3-tiny", "--output_dir", str(out)])
    return out


@pytest.mark.parametrize("arch", ["k3", "qwen3"])
def test_eval_drift_reports_what_an_fp8_cache_costs(arch, tiny, qwen3_draft, tmp_path):
    results = tmp_path / "results.json"
    model = tiny if arch == "k3" else qwen3_draft
    cli_ok(["eval-drift", "--model", str(model), "--regime", "heavy", "--blocks", "16",
            "--formats", "bf16,bf16+kv=fp8", "--json", str(results)])  # fmt: skip
    data = json.loads(results.read_text())
    assert "configuration" not in data["variants"]["bf16"]  # the default, as before
    assert data["variants"]["bf16+kv=fp8"]["configuration"]["kv_cache"] == "fp8"
    kl = {
        n: v["metrics"]["kl"]["mean"]["value"]
        for n, v in data["regimes"]["heavy"]["variants"].items()
    }
    assert all(math.isfinite(v) for v in kl.values())
    assert kl["bf16+kv=fp8"] != kl["bf16"]
