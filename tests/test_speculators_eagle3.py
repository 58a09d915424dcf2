"""qstream's fp32 EAGLE-3 forward against speculators 0.9.0, which trains these drafts
(docs/eagle3.md, "Parity").

speculators builds a tiny EAGLE-3 draft (Llama or Qwen3 form, GQA), its weights drawn from a
seed, and saves it; qstream reads that directory through the registry and the architecture's
loader.  Cases: the Llama form, with a reduced vocabulary and d2t, with ``norm_output``, with
Llama 3.1's RoPE scaling; the Qwen3 form with ``norm_before_residual``.  Both run the same aux states and ids: the prefill step's hidden states and logits at
every position must agree, and at each anchor a greedy chain of K steps token for token.
speculators' ``forward`` drafts K steps at every position at once (its test-time training: step
j at row p reads the teacher-forced id at p + j and its own step j-1 state, attending to the
prefill up to p and its own earlier steps); fed qstream's greedy tokens as the teacher's, its
argmax at each step must be the next of them, and its logits qstream's.

These run in the speculators lane (``pytest -m speculators``, as ``.ci/run`` builds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from qstream.arch.registry import architecture_of, load_config
from qstream.serving import REFERENCE_VARIANT

pytestmark = pytest.mark.speculators

VOCAB, HIDDEN, LENGTH, K = 300, 64, 40, 5
AUX_IDS = [2, 4, 6]
ANCHORS = (0, 7, 19, 33)  # greedy chains start here; 33 + K < LENGTH
TOL = 1e-5  # relative L2 error in fp32


PLAIN = {"rope_type": "default", "rope_theta": 1e4}
# Llama 3.1's scaling over a 16-position original context: at head_dim 16 the shortest
# wavelength (6.3) is kept, the next (19.6) lies between the two cut-offs (4 and 16) and is
# smoothed, the rest are divided by the factor
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip


@dataclass(frozen=True)
class Case:
    model_type: str  # llama or qwen3
    rope: dict = field(default_factory=lambda: PLAIN)
    draft_vocab: int = VOCAB
    norm_before_residual: bool = False
    norm_output: bool = False


CASES = {
    "llama": Case("llama"),
    "llama-reduced-vocab": Case("llama", draft_vocab=200),
    "qwen3-norm-before-residual": Case("qwen3", draft_vocab=200, norm_before_residual=True),
    "llama-norm-output": Case("llama", norm_output=True),
    "llama3-rope": Case("llama", rope=LLAMA3),
}


def build(case: Case, seed: int):
    """speculators' Eagle3DraftModel, norms 1 +- 0.3 and projections ~ 1/sqrt(fan_in)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    layer_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[case.model_type]
    layer = layer_class(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters=dict(case.rope),
    )  # fmt: skip
    layer._attn_implementation = "eager"  # flex attention would compile on CPU
    spec = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=case.draft_vocab,
        eagle_aux_hidden_state_layer_ids=AUX_IDS, norm_before_residual=case.norm_before_residual,
        norm_output=case.norm_output, speculators_config=spec,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            scale = 1.0 if name.startswith("embed_tokens") else 1 / math.sqrt(p.shape[-1])
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else noise * scale)
    if case.draft_vocab < VOCAB:
        kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed + 1))
        kept = kept[: case.draft_vocab].sort().values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        model.load_vocab_mappings(t2d, kept - torch.arange(case.draft_vocab))
    return model


def spec_steps(model, aux: torch.Tensor, ids: torch.Tensor):
    """speculators' forward over one stream: per step, the logits [T, Vd], the state handed on
    [T, H] and the argmax draft ids [T]."""
    logits, states = [], []
    hooks = [
        model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0])),
        model.layers[-1].register_forward_hook(lambda m, i, o: states.append(o[0])),
    ]
    T = ids.shape[-1]
    try:
        with torch.no_grad():
            drafted = model(
                hidden_states=aux[None], input_ids=ids[None], ttt_steps=K,
                document_ids=torch.zeros(1, T, dtype=torch.long),
                position_ids=torch.arange(T)[None],
            )  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    if model.config.norm_output:  # the state handed on is the normed one
        states = [model.norm(s) for s in states]
    return logits, states, [d[0] for d in drafted]


@dataclass(frozen=True)
class Pair:
    spec_model: object
    model: object  # qstream's Eagle3Draft
    config: object
    aux: torch.Tensor  # [T, A]
    ids: torch.Tensor  # [T]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory) -> Pair:
    spec_model = build(CASES[request.param], seed=0)
    directory = tmp_path_factory.mktemp(request.param) / "draft"
    spec_model.save_pretrained(directory)
    config = load_config(directory, evaluated=False)
    arch = architecture_of(config)
    weights = arch.load_weights(directory, None, config)
    model = arch.build(config, weights, REFERENCE_VARIANT, "cpu")
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(LENGTH, config.aux_size, generator=g)
    ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
    return Pair(spec_model, model, config, aux, ids)


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


def test_the_saved_config_is_read_as_vllm_reads_it(pair):
    c, spec = pair.config, pair.spec_model.config
    layer = spec.transformer_layer_config
    assert c.architecture == {"llama": "Eagle3LlamaForCausalLM",
                              "qwen3": "Eagle3Qwen3ForCausalLM"}[layer.model_type]  # fmt: skip
    assert (c.vocab_size, c.draft_vocab_size) == (VOCAB, spec.draft_vocab_size)
    assert c.aux_layer_ids == tuple(AUX_IDS) and c.aux_size == 3 * HIDDEN
    assert c.norm_before_residual is spec.norm_before_residual
    assert c.norm_output is spec.norm_output


def test_prefill_hidden_states_and_logits_match(pair):
    logits, states, _ = spec_steps(pair.spec_model, pair.aux, pair.ids)
    with torch.no_grad():
        pre = pair.model.prefill(pair.ids[None], pair.aux[None])
    err_h, err_l = rel(pre.hidden[0], states[0]), rel(pre.logits[0], logits[0])
    assert err_h <= TOL, f"hidden: relative error {err_h:.3g} > {TOL}"
    assert err_l <= TOL, f"logits: relative error {err_l:.3g} > {TOL}"


def test_greedy_chains_are_token_identical(pair):
    model = pair.model
    with torch.no_grad():
        pre = model.prefill(pair.ids[None], pair.aux[None])
        anchors = torch.tensor(ANCHORS)
        chain = model.chain(pre, torch.zeros_like(anchors), anchors, K)
    assert chain.tokens.shape == (len(ANCHORS), K)
    for n, p in enumerate(ANCHORS):
        forced = pair.ids.clone()
        forced[p + 1 : p + K] = chain.tokens[n, :-1]  # step j at row p reads forced[p + j]
        logits, states, drafted = spec_steps(pair.spec_model, pair.aux, forced)
        theirs = torch.stack([model.to_target(d[p]) for d in drafted])
        assert theirs.tolist() == chain.tokens[n].tolist(), f"anchor {p}"
        err = rel(chain.logits[n], torch.stack([step[p] for step in logits]))
        assert err <= TOL, f"anchor {p}: chain logits relative error {err:.3g} > {TOL}"
        err = rel(chain.hidden[n], torch.stack([s[p] for s in states]))
        assert err <= TOL, f"anchor {p}: chain states relative error {err:.3g} > {TOL}"


def test_speculators_loads_the_shipped_trained_eagle3_draft():
    """examples/gsm8k-pair/eagle3 is speculators' own layout (evals/train_eagle3_pair.py): its
    from_pretrained reads every tensor the file holds, as the config qstream reads says.  The
    shipped config names no verifier path (the trainer's was local), and speculators'
    ``Eagle3DraftModel.load_verifier_weights`` reads the verifier's config, so the pair's
    target is named here; the checkpoint's own embed_tokens and lm_head win over its."""
    from pathlib import Path

    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    pair = Path(__file__).resolve().parents[1] / "examples" / "gsm8k-pair"
    draft = pair / "eagle3"
    spec_config = Eagle3SpeculatorConfig.from_pretrained(draft)
    spec_config.speculators_config.verifier.name_or_path = str(pair / "target")
    model = Eagle3DraftModel.from_pretrained(draft, config=spec_config, dtype=torch.float32)
    with safe_open(draft / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor.float()), name
    config = load_config(draft)
    assert model.config.transformer_layer_config.model_type == config.model_type == "qwen3"
    assert model.config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in config.target_layer_ids]
    assert (
        model.config.speculators_config.proposal_methods[0].speculative_tokens == config.block_size
    )
