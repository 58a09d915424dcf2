"""vLLM 0.32.0's own rejection sampler against qstream's closed forms (docs/vllm.md, "vLLM's own
forward and sampler"; docs/acceptance.md).

``rejection_sample`` (vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py, the function
``RejectionSampler._verify`` calls) runs its Triton kernels in triton's interpreter on CPU
tensors (tests/vllm_cpu_shims.py, shims 1 and 2), in a process of its own.  Every mode vLLM
serves: greedy (T = 0), and ``draft_sample_method`` greedy (no draft logits: a one-hot q) or
probabilistic (the draft's logits) × ``rejection_sample_method`` standard or block.  The
requests are paired with the closed form: each request's accepted length τ (``num_sampled`` − 1)
minus ``E[τ | its draft]`` (qstream/eval/acceptance.py) has mean 0 if vLLM's law is qstream's.
Statistical bound: the Monte-Carlo standard error of that mean must be at most 0.1/3 token (so a
difference of 0.1 token would stand 3 standard errors out) and the mean within 4 standard
errors of 0 (a two-sided 4-sigma band: about 6e-5 false alarms for a correct sampler; with fixed
seeds the outcome is deterministic).  T = 0 is exact: accepted iff the draft is the argmax.

The target logits are passed as ``Sampler.apply_sampling_params`` hands them over at
temperature T with no top-k/top-p/penalties (divided by T); the draft's are passed raw, as the
drafter caches them (the kernels divide by T themselves).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qstream.arch.markov import in_target_vocab
from qstream.eval.acceptance import (
    accept_probabilities,
    greedy_accepts,
    greedy_draft_probabilities,
    token_probs,
)

pytestmark = pytest.mark.vllm

REDUCED = "reduced vocabulary, probabilistic draft, "
B, V = 2, 8  # drafted tokens per request, vocabulary (small: the interpreter is slow)
T = 0.8  # the sampling modes' temperature
MAX_SE = 0.1 / 3  # token: the Monte-Carlo standard error each sampling mode must reach
SIGMAS = 4.0
# requests per sampling mode: the conditional variance of τ for these p, q is 0.39-0.52 token²
# (computed from the closed form), so 500 requests give a standard error of at most 0.032
REQUESTS = 500
GREEDY_REQUESTS = 32
# mode: (temperature, draft_sample_method, rejection_sample_method)
MODES = {
    "greedy": (0.0, "greedy", "standard"),
    "greedy block": (0.0, "greedy", "block"),
    "greedy draft, standard": (T, "greedy", "standard"),
    "greedy draft, block": (T, "greedy", "block"),
    "probabilistic draft, standard": (T, "probabilistic", "standard"),
    "probabilistic draft, block": (T, "probabilistic", "block"),
    REDUCED + "standard": (T, "probabilistic", "standard"),
    REDUCED + "block": (T, "probabilistic", "block"),
}
RULE = {"standard": "token_wise", "block": "block"}
# A reduced draft vocabulary (docs/acceptance.md, "Reduced vocabulary"): draft id d is target id
# TO_TARGET[d]; vLLM's DSpark speculator caches the draft logits scattered into the target
# vocabulary, -inf elsewhere (dspark/speculator.py, ``_sample_logits``), which the kernels read.
TO_TARGET = torch.tensor([0, 2, 3, 5, 7])


def _case(mode: str, seed: int) -> tuple[dict, torch.Tensor]:
    """vLLM's arguments for one batch of requests, and the closed-form E[τ | draft] [R]."""
    temperature, draft_method, rejection = MODES[mode]
    R = GREEDY_REQUESTS if temperature == 0 else REQUESTS
    gen = torch.Generator().manual_seed(seed)
    to_target = TO_TARGET if mode.startswith(REDUCED) else torch.arange(V)
    draft_logits = torch.randn(R, B, len(to_target), generator=gen) * 1.5  # [R, B, Vd]
    target = torch.randn(R, B + 1, V, generator=gen) * 1.5  # [R, B+1, V]: bonus last
    target[:, :B, to_target] = draft_logits
    target = target + 0.7 * torch.randn(R, B + 1, V, generator=gen)
    q = torch.softmax(draft_logits.double() / max(temperature, 1e-9), -1)  # over draft ids
    if draft_method == "probabilistic":
        draft_ids = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(R, B)
    else:
        draft_ids = draft_logits.argmax(-1)  # the greedy drafter's argmax whatever T
    draft = to_target[draft_ids]  # [R, B] target ids
    if temperature == 0:
        closed = greedy_accepts(draft, target[:, :B].argmax(-1)).sum(1)
    else:
        p_tok = token_probs(torch.softmax(target[:, :B].double() / temperature, -1), draft)
        if draft_method == "probabilistic":
            accept = accept_probabilities(p_tok, token_probs(q, draft_ids), RULE[rejection])
        else:
            accept = greedy_draft_probabilities(p_tok, RULE[rejection])
        closed = accept.sum(1)
    # vLLM's layout: per request B+1 logits rows; row i's input token is the one before draft i
    sampled_in = torch.cat((torch.zeros(R, 1, dtype=torch.int64), draft), dim=1)  # [R, B+1]
    requests = torch.arange(R, dtype=torch.int32)
    case = dict(
        target_logits=(target / temperature if temperature else target).flatten(0, 1).contiguous(),
        draft_logits=in_target_vocab(draft_logits, to_target, V)
        if draft_method == "probabilistic"
        else None,
        draft_sampled=sampled_in.flatten(),
        cu_num_logits=torch.arange(R + 1, dtype=torch.int32) * (B + 1),
        pos=(100 + torch.arange(B + 1)).repeat(R),  # each request its own seed: draws differ
        idx_mapping=requests,
        expanded_idx_mapping=requests.repeat_interleave(B + 1),
        expanded_local_pos=torch.arange(B + 1, dtype=torch.int32).repeat(R),
        temperature=torch.full((R,), temperature),
        seed=seed * 100_000 + torch.arange(R, dtype=torch.int64),
        num_speculative_steps=B,
        use_block_verification=rejection == "block",
    )
    return case, closed


@pytest.fixture(scope="module")
def vllm_accepted(tmp_path_factory):
    """Each mode's cases, and the accepted lengths vLLM's sampler returned for them."""
    tmp = tmp_path_factory.mktemp("rejection")
    cases, closed = {}, {}
    for seed, mode in enumerate(MODES, start=1):
        cases[mode], closed[mode] = _case(mode, seed)
    torch.save(cases, tmp / "cases.pt")
    helper = Path(__file__).with_name("vllm_cpu_shims.py")
    run = subprocess.run(
        [sys.executable, str(helper), "rejection", str(tmp / "cases.pt"), str(tmp / "out.pt")],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sampled = torch.load(tmp / "out.pt")
    return {mode: (sampled[mode].long() - 1, closed[mode]) for mode in MODES}


@pytest.mark.parametrize("mode", [m for m in MODES if MODES[m][0] == 0])
def test_greedy_accepts_exactly_the_argmax_prefix(vllm_accepted, mode):
    accepted, closed = vllm_accepted[mode]
    assert torch.equal(accepted, closed.long())
    assert 0 < accepted.sum() < B * len(accepted)  # both outcomes occur


@pytest.mark.parametrize("mode", [m for m in MODES if MODES[m][0] > 0])
def test_mean_accepted_length_is_the_closed_form(vllm_accepted, mode):
    accepted, closed = vllm_accepted[mode]
    diff = accepted.double() - closed  # paired: mean 0 request by request
    mean, se = diff.mean().item(), (diff.var().item() / len(diff)) ** 0.5
    print(
        f"{mode}: vLLM {accepted.double().mean().item():.4f}, closed form "
        f"{closed.mean().item():.4f}, difference {mean:+.4f} ± {se:.4f} (n = {len(diff)})"
    )
    assert se <= MAX_SE, f"standard error {se:.4f} > {MAX_SE:.4f}: too few requests"
    assert abs(mean) <= SIGMAS * se, f"{mean:+.4f} is beyond {SIGMAS} x {se:.4f}"
