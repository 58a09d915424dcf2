"""qstream's fp32 Qwen3-style DSpark forward against speculators 0.9.0, which trains these drafts
(docs/qwen3-dspark.md, "Parity").

speculators builds, initialises and saves a tiny draft (GQA, three layers, a Markov head and a
confidence head with it); qstream reads that directory as it is, through the registry and the
architecture's loader, with the target's embedding and lm_head beside it.  Both run the same aux
hidden states and ids at the same >= 100 blocks over three streams, anchors past YaRN's original
64 positions included, and must agree: every slot's final-normed hidden state and logits, the
Markov head's teacher-forced logits and confidence (speculators' own ``forward`` with its
previous-token convention), and greedy rollouts token for token (speculators' Markov head driven
step by step as vLLM drafts).  Cases: plain RoPE, YaRN, ``sample_from_anchor`` false (slot 0 is
the bonus anchor), and a reduced draft vocabulary with d2t.

These run in the speculators lane (``pytest -m speculators`` in a virtual environment with
``speculators==0.9.0``, as ``.ci/run`` builds it); the main run deselects them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from qstream.arch.interface import LM_HEAD, Blocks, Rollout
from qstream.arch.registry import architecture_of, load_config
from qstream.serving import REFERENCE_VARIANT

pytestmark = pytest.mark.speculators

STREAMS, LENGTH = 3, 150  # aux states over 150 positions; anchors up to 140, past YaRN's 64
ANCHOR_STEP = 4  # 36 anchors a stream, 108 blocks, anchor 0 (no context) included
TOL = 1e-5  # relative L2 error in fp32


def cases():
    import speculators_draft as sd

    return {
        "rope": sd.Case(sd.PLAIN),
        "yarn": sd.Case(sd.YARN),
        "fill-in": sd.Case(sd.YARN, sample_from_anchor=False),
        "reduced-vocab": sd.Case(sd.PLAIN, draft_vocab=200),
    }


CASES = ("rope", "yarn", "fill-in", "reduced-vocab")


@dataclass(frozen=True)
class Pair:
    spec: object  # speculators_draft.Run
    spec_model: object  # speculators' DSparkDraftModel
    model: object  # qstream's Qwen3DSpark
    config: object
    weights: dict
    ids: torch.Tensor  # [S, T]
    stream: torch.Tensor  # [N]
    anchor: torch.Tensor  # [N]
    hidden: torch.Tensor  # qstream's block_hidden, [N, slots, H]
    blocks: Blocks

    @property
    def first_token(self) -> torch.Tensor:
        return self.ids[self.stream, self.anchor]

    @property
    def drafted(self) -> slice:
        """speculators' slots that qstream's Blocks hold (slot 0 is the bonus without
        sample_from_anchor)."""
        return slice(self.config.first_slot, None)

    def true_tokens(self) -> torch.Tensor:
        """The tokens the drafted slots predict: ids[p+1 .. p+B] either way (slot k predicts
        ids[p+k+1] with sample_from_anchor, ids[p+k] without, whose slots start at 1)."""
        offsets = torch.arange(1, self.config.block_size + 1)
        return self.ids[self.stream[:, None], self.anchor[:, None] + offsets]


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory) -> Pair:
    import speculators_draft as sd

    case = cases()[request.param]
    spec_model = sd.build(case, seed=0)
    draft_dir, head_dir = sd.save(spec_model, tmp_path_factory.mktemp(request.param))
    config = load_config(draft_dir)
    arch = architecture_of(config)
    weights = arch.load_weights(draft_dir, head_dir, config)
    model = arch.build(config, weights, REFERENCE_VARIANT, "cpu")

    g = torch.Generator().manual_seed(1)
    aux = torch.randn(STREAMS, LENGTH, config.aux_size, generator=g)
    ids = torch.randint(0, config.vocab_size, (STREAMS, LENGTH), generator=g)
    per_stream = torch.arange(0, LENGTH - sd.BLOCK_SLOTS + 1, ANCHOR_STEP)
    stream = torch.arange(STREAMS).repeat_interleave(per_stream.numel())
    anchor = per_stream.repeat(STREAMS)
    order = torch.randperm(stream.numel(), generator=g)  # blocks of the streams interleaved
    stream, anchor = stream[order], anchor[order]

    spec = sd.forward(spec_model, aux, ids, stream, anchor)
    with torch.no_grad():
        ctx = model.context(aux)
        first = ids[stream, anchor]
        blocks = model.draft(ctx, stream, anchor, first)
        hidden = model.block_hidden(ctx, stream, anchor, first)
    return Pair(spec, spec_model, model, config, weights, ids, stream, anchor, hidden, blocks)


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


def test_speculators_saved_config_is_read_as_vllm_reads_it(pair):
    import speculators_draft as sd

    c, spec = pair.config, pair.spec_model.config
    assert c.target_layer_ids == tuple(i - 1 for i in sd.AUX_IDS)
    assert c.block_slots == spec.block_size == sd.BLOCK_SLOTS
    assert c.sample_from_anchor is spec.sample_from_anchor
    assert (c.vocab_size, c.draft_vocab_size) == (sd.VOCAB, spec.draft_vocab_size)
    assert c.rope_parameters.rope_type == spec.transformer_layer_config.rope_parameters["rope_type"]
    assert c.mask_token_id == spec.mask_token_id
    assert c.block_size == (sd.BLOCK_SLOTS if c.sample_from_anchor else sd.BLOCK_SLOTS - 1)
    assert pair.stream.numel() >= 100
    assert int(pair.anchor.max()) + sd.BLOCK_SLOTS - 1 > 64  # past YaRN's original context


def test_every_slots_hidden_state_and_logits_match(pair):
    assert rel(pair.hidden, pair.spec.hidden) <= TOL
    lm_head = pair.weights[LM_HEAD].float()
    assert rel(F.linear(pair.hidden, lm_head), pair.spec.logits_base) <= TOL
    # the drafted rows qstream hands on: config.first_slot onwards
    assert rel(pair.blocks.logits_base, pair.spec.logits_base[:, pair.drafted]) <= TOL
    assert rel(pair.blocks.hidden, pair.spec.hidden[:, pair.drafted]) <= TOL
    assert torch.equal(pair.blocks.first_token, pair.first_token)


def test_teacher_forced_markov_logits_and_confidence_match(pair):
    from qstream.arch.markov import teacher_forced

    forced: Rollout = teacher_forced(pair.model, pair.blocks, pair.true_tokens())
    assert rel(forced.logits, pair.spec.logits[:, pair.drafted]) <= TOL
    assert forced.confidence is not None
    assert rel(forced.confidence, torch.sigmoid(pair.spec.confidence[:, pair.drafted])) <= TOL


def test_greedy_rollouts_are_token_identical(pair):
    import speculators_draft as sd

    from qstream.arch.markov import rollout

    # a reduced vocabulary: vLLM maps each drafted id to the target's (d + d2t[d]) before it
    # is emitted and fed to markov_w1 (map_draft_to_target in qwen3_dspark.py), as qstream does
    ours = rollout(pair.model, pair.blocks)
    tokens, logits, confidence = sd.greedy(
        pair.spec_model, pair.spec, pair.first_token, pair.config.first_slot
    )
    mismatches = int((ours.tokens != tokens).sum())
    assert mismatches == 0, f"{mismatches} of {tokens.numel()} drafted tokens differ"
    assert rel(ours.logits, logits) <= TOL
    assert ours.confidence is not None
    assert rel(ours.confidence, torch.sigmoid(confidence)) <= TOL


@pytest.mark.parametrize("pair", ["gsm8k-pair", "smollm2-pair"])
def test_speculators_loads_the_shipped_trained_draft(pair):
    """examples/gsm8k-pair/draft and examples/smollm2-pair/draft are speculators' own layout:
    its from_pretrained reads every tensor the file holds (embed_tokens and the full-vocabulary
    lm_head are the target's)."""
    from pathlib import Path

    from safetensors import safe_open
    from speculators.models.dspark import DSparkDraftModel

    draft = Path(__file__).resolve().parents[1] / "examples" / pair / "draft"
    model = DSparkDraftModel.from_pretrained(draft, dtype=torch.float32)
    with safe_open(draft / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor.float()), name
    assert model.config.block_size == 7 and model.config.markov_rank == 64
