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
from cli_helpers import cli_error, cli_ok
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from model_helpers import random_model_weights
from qwen3_drafts import TINY as QWEN3_TINY
from qwen3_drafts import qwen3_tensors
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.dspark_mla.model import DSpark
from qstream.arch.dspark_qwen3.model import Qwen3DSpark
from qstream.arch.interface import LM_HEAD
from qstream.arch.registry import architecture_of
from qstream.arch.weights import ServedLinears, fp8_round_trip
from qstream.calibration import KV_CACHE, Calibration, Observer
from qstream.checkpoint.files import open_checkpoint
from qstream.errors import QStreamError
from qstream.eval.settings import DriftSettings
from qstream.eval.variants import kv_cache_scales, settings_variants
from qstream.quant import quantize_checkpoint
from qstream.serving import KV_CACHES, REFERENCE_VARIANT, Variant

CFG = PRESETS["tiny"]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def vllm_cache(
    x: torch.Tensor, fp8: torch.dtype, scale: float, reciprocal: bool = False
) -> torch.Tensor:
    """torch's cast of x / scale (``reciprocal``: x times the fp32 1 / scale, as K3's fused
    decode insert writes), where vLLM's saturating store puts the format's largest finite value
    instead of torch's NaN (e4m3fn) or inf (e5m2); read back times scale."""
    s = torch.tensor(scale, dtype=torch.float32)
    y = x.float() * (1 / s) if reciprocal else x.float() / s
    top = torch.finfo(fp8).max
    stored = torch.where(y.abs() > top, torch.sign(y) * top, y.to(fp8).float())
    return (stored * s).to(x.dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.25, 0.0123])
@pytest.mark.parametrize("reciprocal", [False, True])
def test_an_fp8_cache_stores_x_over_its_scale_saturated(fp8, scale, reciprocal):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.logspace(-9, 6, 4096)
    x = torch.cat((x, torch.tensor([1e9, -1e9, 0.0, 2.0**-20]))).to(torch.bfloat16)
    got = fp8_round_trip(x, fp8, scale, reciprocal)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert torch.equal(got, vllm_cache(x, fp8, scale, reciprocal))
    top = (torch.finfo(fp8).max * torch.tensor(scale)).to(torch.bfloat16).item()
    assert got[-4].item() == top and got[-3].item() == -top  # saturated, not NaN or inf


def _models(kv: str, scale: float = 1.0):
    w = random_model_weights(CFG, seed=1)
    scaled = ServedLinears(kv_scales={"layers.1.self_attn": (scale, 2.0)}) if scale != 1 else None
    served = DSpark(CFG, w, torch.bfloat16, kv=KV_CACHES[kv], served=scaled)
    return DSpark(CFG, w, torch.bfloat16), served, w


@pytest.mark.parametrize(
    "kv, scale", [("auto", 1.0), ("fp8_e4m3", 1.0), ("fp8_e5m2", 1.0), ("fp8_e4m3", 0.0123)]
)
def test_k3_attention_is_vllms_absorbed_decode_to_the_bit(kv, scale):
    """A scale s: the layer's k_scale (its v_scale, 2.0 here, is read by no MLA op) divides
    the context rows, its fp32 reciprocal multiplies the block's own rows and, as ``_q_scale``
    (the k_scale when the checkpoint has no q_scale), the query."""
    plain, model, w = _models(kv, scale)
    c, layer = CFG, model.layers[1]
    n, P, r, V, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                     c.v_head_dim, c.kv_lora_rank)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    p, B = 11, c.block_size
    h = torch.randn(B, c.hidden_size, generator=gen).to(torch.bfloat16)
    ctx_h = torch.randn(p, c.hidden_size, generator=gen).to(torch.bfloat16)
    pos = p + torch.arange(B)
    got = model.block_attention(layer, h, pos, *layer.latent(ctx_h, torch.arange(p), True))

    # vLLM's inputs: q_b_proj's q with RoPE on q_pe; the cache rows [kv_c_normed | k_pe] of the
    # context (precomputed) and of the block (inserted before forward_mqa reads the cache)
    ref = plain.layers[1]
    q = ref._query(h, pos)  # [B, n, P + r]
    ctx_rows = torch.cat(ref.latent(ctx_h, torch.arange(p)), dim=-1)  # [p, L + r]
    blk_rows = torch.cat(ref.latent(h, pos), dim=-1)  # [B, L + r]
    # split_kv_b_proj: W_UK [L, n, P], W_UV [L, n, V]; W_UK_T (n, P, L), W_UV (n, L, V)
    weight = w["layers.1.self_attn.kv_b_proj.weight"].to(torch.bfloat16).T
    W_UK, W_UV = weight.reshape(L, n, P + V).split([P, V], dim=-1)
    W_UK_T, W_UV = W_UK.permute(1, 2, 0), W_UV.transpose(0, 1)
    q_nope, q_pe = q.split([P, r], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), W_UK_T).transpose(0, 1)  # BMM1 -> [B, n, L]
    mqa_q = torch.cat((ql_nope, q_pe), dim=-1)
    if kv != "auto":  # fp8 query at q_scale, upcast back for TRITON_MLA; fp8 cache
        fp8 = getattr(torch, str(KV_CACHES[kv].dtype))
        mqa_q = vllm_cache(mqa_q, torch.float8_e4m3fn, scale, reciprocal=True)
        ctx_rows = vllm_cache(ctx_rows, fp8, scale)  # concat_and_cache_mla: / _k_scale
        blk_rows = vllm_cache(blk_rows, fp8, scale, reciprocal=True)  # * _k_scale_inv
    cache = torch.cat((ctx_rows, blk_rows))  # [p + B, L + r]
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


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.0123, 0.0456)])
def test_qwen3_keys_and_values_are_read_as_the_fp8_cache_holds_them(scales):
    w = qwen3_tensors(QWEN3_TINY, seed=0)
    w.setdefault(LM_HEAD, torch.zeros(QWEN3_TINY.vocab_size, QWEN3_TINY.hidden_size))
    auto = Qwen3DSpark(QWEN3_TINY, w, torch.bfloat16)
    served = ServedLinears(kv_scales={"layers.0.self_attn": scales})
    fp8 = Qwen3DSpark(QWEN3_TINY, w, torch.bfloat16, kv=KV_CACHES["fp8"], served=served)
    h = torch.randn(2, 5, QWEN3_TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    h, pos = h.to(torch.bfloat16), torch.arange(5)
    for want, got, scale in zip(auto.key_value(0, h, pos), fp8.key_value(0, h, pos), scales):
        # reshape_and_cache_flash: key / k_scale, value / v_scale; the read times each
        assert torch.equal(got, vllm_cache(want, torch.float8_e4m3fn, scale))
        assert not torch.equal(got, want)


def _observed(arch_name: str):
    """A reference of ``arch_name`` observed while drafting, and the KV-cache amax it saw."""
    if arch_name == "k3":
        config, weights = CFG, random_model_weights(CFG, seed=1)
    else:
        config, weights = QWEN3_TINY, qwen3_tensors(QWEN3_TINY, seed=0)
        weights[LM_HEAD] = torch.zeros(config.vocab_size, config.hidden_size)
    seen: dict[str, float] = {}

    def record(attention, k, v):
        for key, x in ((f"{attention}.k", k), (f"{attention}.v", v)):
            if x is not None:
                seen[key] = max(seen.get(key, 0.0), float(x.abs().max()))

    observer = Observer()
    for served in (observer.served(), ServedLinears(observe_cache=record)):
        model = architecture_of(config).build(config, weights, REFERENCE_VARIANT, "cpu", served)
        aux = torch.randn(2, 24, config.aux_size, generator=torch.Generator().manual_seed(2))
        ctx = model.context(aux)
        model.draft(ctx, torch.tensor([0, 1]), torch.tensor([5, 20]), torch.tensor([3, 4]))
    return config, weights, Calibration(observer.amax, {}), seen


@pytest.mark.parametrize("arch_name", ["k3", "qwen3"])
def test_a_calibrated_kv_scale_is_compressed_tensors_scale_of_what_the_cache_stores(arch_name):
    """Observed: K and V (Qwen3), the one latent entry under .k (K3), what the cache stores
    (the hook's own amax, over context and block rows); the scale: compressed-tensors'
    ``calculate_qparams`` of that amax in the weight dtype (K3's here fp32, Qwen3's bf16),
    held in float32."""
    config, weights, calibration, seen = _observed(arch_name)
    observed = calibration.amax[KV_CACHE]
    assert {k: float(v) for k, v in observed.items()} == seen
    layers = [f"layers.{i}.self_attn" for i in range(config.num_hidden_layers)]
    leaves = ("k",) if arch_name == "k3" else ("k", "v")
    assert sorted(observed) == sorted(f"{a}.{leaf}" for a in layers for leaf in leaves)
    scales = kv_cache_scales(Variant.parse("bf16+kv=fp8+kvscale=calibrated"), weights, calibration)
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    for attention in layers:
        dtype = weights[f"{attention}.o_proj.weight"].dtype
        amax = [observed[f"{attention}.{leaf}"].to(dtype) for leaf in leaves]
        want = [calculate_qparams(-a.reshape(1), a.reshape(1), args)[0] for a in amax]
        want = [float(w.float()) for w in want * (3 - len(want))]  # K3: v_scale = k_scale
        assert list(scales[attention]) == want != [1.0, 1.0], attention


def test_a_non_finite_kv_cache_names_its_layer():
    config, weights = QWEN3_TINY, qwen3_tensors(QWEN3_TINY, seed=0)
    weights[LM_HEAD] = torch.zeros(config.vocab_size, config.hidden_size)
    norm = "layers.1.self_attn.k_norm.weight"
    weights[norm] = torch.full_like(weights[norm], float("inf"))
    model = architecture_of(config).build(
        config, weights, REFERENCE_VARIANT, "cpu", Observer().served()
    )
    with pytest.raises(QStreamError, match=r"kv cache of layers\.1\.self_attn\.k hold NaN or Inf"):
        model.context(torch.randn(1, 8, config.aux_size))


@pytest.fixture(scope="module")
def qwen3_draft(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "draft"
    cli_ok(["synth", "--preset", "qwen3-tiny", "--output_dir", str(out)])
    return out


@pytest.mark.parametrize("arch", ["k3", "qwen3"])
def test_eval_drift_reports_what_an_fp8_cache_costs(arch, tiny, qwen3_draft, tmp_path):
    results = tmp_path / "results.json"
    model = tiny if arch == "k3" else qwen3_draft
    scaled = "bf16+kv=fp8+kvscale=calibrated"
    cli_ok(["eval-drift", "--model", str(model), "--regime", "heavy", "--blocks", "16",
            "--formats", f"bf16,bf16+kv=fp8,{scaled}", "--json", str(results)])  # fmt: skip
    data = json.loads(results.read_text())
    assert "configuration" not in data["variants"]["bf16"]  # the default, as before
    assert data["variants"]["bf16+kv=fp8"]["configuration"]["kv_cache"] == "fp8"
    assert data["variants"][scaled]["configuration"]["kv_scale"] == "calibrated"
    regime = data["regimes"]["heavy"]
    assert regime["calibration"]["regime"] == "heavy" and regime["calibration"]["blocks"] > 0
    kl = {n: v["metrics"]["kl"]["mean"]["value"] for n, v in regime["variants"].items()}
    assert all(math.isfinite(v) for v in kl.values())
    assert kl["bf16+kv=fp8"] != kl["bf16"]
    assert kl[scaled] != kl["bf16+kv=fp8"]


def _quantized(draft, out, kv_cache_scheme=None):
    """``draft`` in FP8 weights; with ``kv_cache_scheme``, distinct k_scale / v_scale per layer."""
    names = list(open_checkpoint(draft).tensor_shard)
    layers = sorted({n.split(".self_attn.")[0] + ".self_attn" for n in names if ".self_attn." in n})
    kv = {}
    for i, a in enumerate(layers):
        kv[f"{a}.k"], kv[f"{a}.v"] = torch.tensor(2.0 + i), torch.tensor(3.0 + i)
    given = Calibration({KV_CACHE: kv}, {"drawn": "given in the test", "blocks": 1, "tokens": 64})
    quantize_checkpoint(draft, out, "fp8", kv_cache_scheme=kv_cache_scheme, calibration=given)
    return out


def test_a_checkpoint_declaring_a_kv_cache_scheme_is_served_with_its_scales(qwen3_draft, tmp_path):
    """vLLM 0.32.0 turns the draft's auto cache into fp8 and serves the stored scales
    (docs/vllm.md, "KV-cache scales"); fp8_e5m2 with such a checkpoint it refuses."""
    ckpt = _quantized(qwen3_draft, tmp_path / "kv", kv_cache_scheme="fp8")
    stored = load_file(ckpt / "model.safetensors")
    settings = DriftSettings(model=str(qwen3_draft), formats=("bf16",), variant=(f"kv={ckpt}",))
    (variant,) = (v for v in settings_variants(settings) if v.checkpoint)
    assert (variant.kv_cache, variant.kv_scale) == ("fp8", "checkpoint")
    scales = kv_cache_scales(variant, {}, None)
    assert len(scales) == QWEN3_TINY.num_hidden_layers
    for attention, pair in scales.items():
        want = tuple(
            stored[f"{attention}.{leaf}"].float().item() for leaf in ("k_scale", "v_scale")
        )
        assert pair == want and pair != (1.0, 1.0)
    results = tmp_path / "results.json"
    args = ["eval-drift", "--model", str(qwen3_draft), "--regime", "heavy", "--blocks", "8",
            "--formats", "bf16", "--variant", f"kv={ckpt}"]  # fmt: skip
    cli_ok([*args, "--json", str(results)])
    data = json.loads(results.read_text())
    served = data["variants"]["kv"]["configuration"]
    assert (served["kv_cache"], served["kv_scale"]) == ("fp8", "checkpoint")
    assert math.isfinite(
        data["regimes"]["heavy"]["variants"]["kv"]["metrics"]["kl"]["mean"]["value"]
    )
    message = cli_error([*args, "--kv-cache-dtype", "fp8_e5m2"])
    assert "vLLM 0.32.0 refuses fp8_e5m2 with a checkpoint" in message
    for change, words in ((dict(v=None), "v_scale missing"), (dict(k=torch.tensor([-1.0])),
                          "k_scale must be one finite scale > 0, not -1.0")):  # fmt: skip
        bad = {**stored}
        for leaf, value in change.items():
            bad.pop(f"layers.1.self_attn.{leaf}_scale")
            if value is not None:
                bad[f"layers.1.self_attn.{leaf}_scale"] = value.to(torch.bfloat16)
        save_file(bad, ckpt / "model.safetensors", metadata={"format": "pt"})
        message = cli_error([*args, "--no-integrity-check"])
        assert f"layers.1.self_attn.{words}" in message


def test_a_k3_checkpoint_declaring_a_kv_cache_scheme_is_refused_saying_vllm_serves_one(
    tiny, tmp_path
):
    ckpt = _quantized(tiny, tmp_path / "k3")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = dict(
        num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False
    )
    (ckpt / "config.json").write_text(json.dumps(config))
    message = cli_error(["eval-drift", "--model", str(tiny), "--regime", "heavy", "--blocks",
                         "8", "--formats", "bf16", "--variant", f"kv={ckpt}",
                         "--no-integrity-check"])  # fmt: skip
    assert "--variant kv: it declares a kv_cache_scheme" in message
    assert "an fp8 cache is served with scale 1.0" in message
