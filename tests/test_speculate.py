"""The two oracles of speculative decoding with the target in the loop (docs/speculate.md):
under greedy verification the output is the target's own greedy decoding, token for token;
under sampling verification, block verification included, the emitted tokens follow the
target's distribution (a chi-square test against the exact law, on an 8-token vocabulary, with a
broken verifier as the control that the test can fail).  A tiny transformers Qwen3 target and a
Qwen3-style draft with random weights: the oracles hold whatever the draft proposes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hf_targets import peaked_qwen3_target

from qstream.arch.dspark_qwen3 import (
    EMBED,
    LM_HEAD,
    Qwen3DSparkConfig,
    RopeParameters,
    tensor_shapes,
)
from qstream.arch.dspark_qwen3.model import Qwen3DSpark
from qstream.errors import QStreamError
from qstream.speculate import decode
from qstream.speculate.decode import speculative_decode, target_greedy
from qstream.verification import (
    CARD_MODE,
    GREEDY,
    GREEDY_BLOCK,
    MODES,
    PROBABILISTIC_STANDARD,
    SPECULATE_MODES,
    VLLM_DEFAULT_MODE,
    VerificationMode,
)

V, H = 8, 32
PROMPT = [1, 2, 3, 4]
# chi-square critical value at p = 0.001 with V - 1 = 7 degrees of freedom
CHI2_CRITICAL = 24.32
SAMPLES = 1200


@pytest.fixture(scope="module")
def pair():
    target = peaked_qwen3_target(V, H)
    draft_config = Qwen3DSparkConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=V, rms_norm_eps=1e-6,
        rope_parameters=RopeParameters(10000.0), max_position_embeddings=256,
        target_hidden_size=H, target_layer_ids=(0, 2), mask_token_id=V - 1, block_slots=3,
        markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    weights = {
        name: torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        for name, shape in tensor_shapes(draft_config).items()
        if name != EMBED
    }
    weights[EMBED] = target.model.embed_tokens.weight.detach().clone()
    weights[LM_HEAD] = target.lm_head.weight.detach().clone()
    return target, Qwen3DSpark(draft_config, weights)


@pytest.mark.parametrize("prompt", [PROMPT, [5, 0, 6], [2]])
def test_greedy_verification_is_the_targets_greedy_decoding(pair, prompt):
    target, draft = pair
    out = speculative_decode(target, draft, prompt, 24, GREEDY)
    assert out.tokens == target_greedy(target, prompt, 24)
    assert out.forwards == 1 + len(out.accepted)
    assert sum(a + 1 for a in out.accepted) + 1 >= 24  # each step emits its accepted + 1


@pytest.mark.parametrize("name", SPECULATE_MODES)
def test_the_kv_cache_changes_nothing(pair, name):
    """With the target's KV cache (each verification reads the anchor and the block only) the
    decoder emits the same tokens, accepts the same drafts at the same anchors, as when the
    target reruns the whole sequence at every step (fp32, fixed seeds)."""
    target, draft = pair
    for seed, prompt in enumerate([PROMPT, [5, 0, 6], [2]]):
        cached = speculative_decode(target, draft, prompt, 24, MODES[name], seed=seed)
        full = speculative_decode(target, draft, prompt, 24, MODES[name], seed=seed, cache=False)
        assert cached == full  # tokens, accepted, forwards, anchors


def _target_law(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact laws of the 2nd and 3rd tokens after PROMPT under sampling at T = 1."""
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor([PROMPT])).logits[0, -1], -1)
        ones = torch.tensor([PROMPT + [t] for t in range(V)])
        second = torch.softmax(target(input_ids=ones).logits[:, -1], -1)  # [t1, t2]
        twos = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        third = torch.softmax(target(input_ids=twos).logits[:, -1], -1).view(V, V, V)
    joint12 = first[:, None] * second
    return joint12.sum(0), (joint12[:, :, None] * third).sum((0, 1))


def _chi2(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _counts(target, draft, mode: VerificationMode) -> tuple[torch.Tensor, torch.Tensor]:
    second, third = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    for seed in range(SAMPLES):
        tokens = speculative_decode(target, draft, PROMPT, 3, mode, seed=seed).tokens
        second[tokens[1]] += 1
        third[tokens[2]] += 1
    return second, third


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SPECULATE_MODES if not MODES[n].greedy_verifier])
def test_sampling_verification_emits_the_targets_distribution(pair, name):
    target, draft = pair
    law2, law3 = _target_law(target)
    second, third = _counts(target, draft, MODES[name])
    assert _chi2(second, law2) < CHI2_CRITICAL
    assert _chi2(third, law3) < CHI2_CRITICAL


@pytest.mark.slow
def test_the_distribution_test_catches_a_verifier_that_accepts_every_draft(pair, monkeypatch):
    target, draft = pair

    def accept_all(logits, drafted, q, mode, temperature, gen):
        return drafted + [decode._pick(logits[len(drafted)], mode, temperature, gen)]

    monkeypatch.setattr(decode, "_verify", accept_all)
    law2, _ = _target_law(target)
    second, _ = _counts(target, draft, PROBABILISTIC_STANDARD)
    assert _chi2(second, law2) > CHI2_CRITICAL


def test_block_verification_accepts_as_eval_drifts_block_rule():
    """The decoder's block rule is eval-drift's: over blocks drafted from q, the share of
    verifications accepting at least k drafted tokens is E_x[P_k(x)] (P_k from
    qstream/eval/acceptance.py), here well apart from token-wise's; of a greedy draft, the
    token-wise law.  A verifier whose p does not depend on the prefix, 4 tokens, B = 3; the
    exact values by enumerating the 64 drafts."""
    from qstream.eval.acceptance import (
        accept_probabilities,
        greedy_draft_probabilities,
        token_probs,
    )

    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25] * 4])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    drafts = torch.cartesian_prod(*[torch.arange(4)] * 3)  # [64, 3]
    p_tok, q_tok = (
        token_probs(p[:3].expand(64, 3, 4), drafts),
        token_probs(q.expand(64, 3, 4), drafts),
    )
    weight = q_tok.double().prod(1)[:, None]
    exact = {b: (weight * accept_probabilities(p_tok, q_tok, b)).sum(0) for b in (True, False)}
    greedy = [2, 3, 0]  # a greedy draft: one-hot, its law the product of p_k(x_k)
    exact["greedy"] = greedy_draft_probabilities(p[torch.arange(3), greedy][None], True)[0]
    gen, n = torch.Generator().manual_seed(0), 2000
    accepted, accepted_greedy = [], []
    for _ in range(n):
        drafted = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        accepted.append(len(decode._verify(p.log(), drafted, q, CARD_MODE, 1.0, gen)) - 1)
        emitted = decode._verify(p.log(), greedy, None, GREEDY_BLOCK, 1.0, gen)
        accepted_greedy.append(len(emitted) - 1)
    for law, counts in ((exact[True], accepted), (exact["greedy"], accepted_greedy)):
        shares = (torch.tensor(counts)[:, None] >= torch.arange(1, 4)).double().mean(0)
        se = (law * (1 - law) / n).sqrt()
        assert ((shares - law).abs() <= 5 * se).all(), (shares, law)
    assert ((exact[False] - exact[True]).abs() > 8 * se).any()  # tells them apart


def test_adaptive_verification_is_refused_in_one_line(pair):
    target, draft = pair
    with pytest.raises(QStreamError, match="adaptive verification"):
        speculative_decode(target, draft, PROMPT, 4, replace(VLLM_DEFAULT_MODE, adaptive=True))


def test_the_study_reports_acceptance_per_variant(pair):
    """Per variant: the mean acceptance length equals 1 + the sum over k of the share of
    verifications accepting at least k drafts (E[a] = sum_k P(a >= k), pooled), and the shares
    fall with k; an NVFP4 variant of the draft is measured on the same prompts and seeds."""
    from qstream.arch.registry import architecture_of
    from qstream.quant.simulate import simulate_format
    from qstream.serving import Variant
    from qstream.speculate.decode import acceptance_study

    target, draft = pair
    arch = architecture_of(draft.config)
    weights = {k: v for k, v in draft.w.stored.items()}
    nvfp4 = arch.build(
        draft.config,
        simulate_format(weights, "nvfp4", arch.quantize_include, config=draft.config),
        Variant.of_format("nvfp4"),
        "cpu",
    )
    prompts = [[1, 2, 3], [4, 5], [6, 0, 1, 2], [3], [7, 7, 2]]
    study = acceptance_study(target, {"bf16": draft, "nvfp4": nvfp4}, prompts, 16)
    for result in study.values():
        assert result["prompts"] == 5
        shares = [s["value"] for s in result["accepted_at_least"]]
        assert len(shares) == draft.config.block_size
        assert all(a >= b for a, b in zip(shares, shares[1:]))
        mean = result["mean_acceptance_length"]
        assert mean["value"] == pytest.approx(1 + sum(shares), rel=1e-12)
        assert mean["lo"] <= mean["value"] <= mean["hi"]
        assert 1 <= result["tokens_per_target_forward"]["value"] <= draft.config.block_size + 1
