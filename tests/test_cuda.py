"""The CUDA path against the CPU (docs/eval-drift.md, "Devices"): the FP32 reference's logits
agree within ``LOGITS_RTOL`` and its greedy tokens are identical on the tiny and small presets,
and TF32 is off inside the reference.  Runs only where a GPU is present."""

import pytest
import torch

from qstream.arch.dspark_mla import load_config, load_weights
from qstream.arch.dspark_mla.model import DSpark
from qstream.device import exact_math
from qstream.eval.batches import AuxStates, draft_batch, make_batches
from qstream.eval.corpus import sample_anchors, tokenize
from qstream.regimes import HEAVY
from qstream.synth.corpus import builtin_corpus
from qstream.synth.draft import synth_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

# Issue 13's bound: the GPU's fp32 reference may sum in another order than the CPU's, never in
# lower precision; 1e-5 relative to the largest logit of the block leaves room for the order.
LOGITS_RTOL = 1e-5
BLOCKS = 64


@pytest.fixture(scope="module", params=["tiny", "small"])
def draft(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / request.param
    return synth_checkpoint(request.param, out, seed=0).output_dir


def _reference_outputs(model_dir, device):
    config = load_config(model_dir)
    corpus = tokenize(builtin_corpus(seed=1), f"{model_dir}/tokenizer.json", config.vocab_size)
    plan = sample_anchors(corpus, BLOCKS, config.block_size, seed=0)
    model = DSpark(config, load_weights(model_dir), torch.float32, device)
    aux = AuxStates(HEAVY, corpus, config, seed=0)
    out = []
    with exact_math():
        for number, batch in enumerate(make_batches(plan, corpus, config)):
            drafts = draft_batch(model, aux.get(batch), batch, number, seed=0)
            out.append((drafts.greedy.logits, drafts.greedy.tokens))
    return out


def test_reference_on_gpu_matches_cpu(draft):
    cpu, gpu = _reference_outputs(draft, "cpu"), _reference_outputs(draft, "cuda")
    for (logits_cpu, tokens_cpu), (logits_gpu, tokens_gpu) in zip(cpu, gpu):
        scale = logits_cpu.abs().amax(-1, keepdim=True)
        rel = float(((logits_gpu - logits_cpu).abs() / scale).max())
        assert rel <= LOGITS_RTOL, f"relative logit difference {rel:.2e} > {LOGITS_RTOL:.0e}"
        assert torch.equal(tokens_cpu, tokens_gpu)


def test_tf32_off_inside_the_reference():
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    a = torch.randn(512, 512, device="cuda")
    with exact_math():
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        exact = a @ a
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    expected = (a.double() @ a.double()).float()
    assert float((exact - expected).abs().max()) < 1e-3  # TF32 would be ~1e-1 here
    torch.backends.cuda.matmul.fp32_precision = "none"
