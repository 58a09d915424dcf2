"""EAGLE-3's chain drafter (docs/eagle3.md, "Drafting"): step k reads the draft's own token
k - 1 (checked against a hand-run loop over the model's single step), greedy and sampled; the
reference verifier's replay and a teacher-forced chain of its own tokens are bit-exact; a
reduced vocabulary maps through d2t; greedy speculation emits the target's greedy
continuation; eval-drift (three regimes, --acceptance) and speculate run on EAGLE-3 drafts."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_ok
from hf_targets import HIDDEN, LAYERS, VOCAB, make_qwen3_target, peaked_qwen3_target
from safetensors.torch import load_file, save_file

from qstream.arch.eagle3 import ARCH, PRESETS, Eagle3Config, tensor_shapes
from qstream.arch.eagle3.model import Eagle3Draft
from qstream.arch.family import D2T
from qstream.arch.interface import EMBED, LM_HEAD
from qstream.arch.markov import sample, sampling_probs
from qstream.arch.registry import load_config
from qstream.serving import REFERENCE_VARIANT
from qstream.speculate.decode import speculative_decode, target_greedy
from qstream.verification import GREEDY, PROBABILISTIC_STANDARD

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# fp32 logits of the same keys summed in another order (a batch of one against a batch of
# blocks, masked keys): they agree to about 1e-6 at these magnitudes (tests/test_eagle3.py)
ORDER_TOL = 1e-5


def _reduced(config: Eagle3Config, weights: dict, keep: torch.Tensor) -> tuple:
    """The same draft over the target ids ``keep`` only: lm_head's rows and d2t's offsets, as a
    reduced-vocabulary EAGLE-3 draft stores them (target id = draft id + d2t[draft id])."""
    reduced = replace(config, draft_vocab_size=len(keep))
    out = {**weights, LM_HEAD: weights[LM_HEAD][keep].clone()}
    out[D2T] = keep - torch.arange(len(keep))
    return reduced, out


@pytest.fixture(scope="module")
def reference(e3):
    config = load_config(e3)
    weights = ARCH.load_weights(e3, None, config)
    return config, weights, ARCH.build(config, weights, REFERENCE_VARIANT, "cpu")


def _inputs(config, S=2, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (S, T + 1), generator=g)
    aux = torch.randn(S, T, config.aux_size, generator=g).bfloat16()
    return ids, aux


def _hand_chain(model: Eagle3Draft, ids, aux, s: int, p: int, noise=None):
    """One chain at anchor p of stream s, by hand over ``model.step`` one block at a time: the
    prefill over aux rows 0..p-1 beside ids[1..p], then each step reading the token just
    drawn (argmax, or the race over ``noise`` [k, Vd]) and the state handed on."""
    k = model.config.block_size
    pre = model.prefill(ids[s : s + 1, 1 : p + 1], aux[s : s + 1, :p])
    keys, values = pre.k, pre.v
    logits, hidden = pre.logits[0, -1], pre.hidden[:, -1:]
    tokens, all_logits = [], []
    for j in range(k):
        draw = logits.argmax() if noise is None else sample(sampling_probs(logits), noise[j])
        tokens.append(int(model.to_target(draw)))
        all_logits.append(logits)
        if j + 1 == k:
            break
        visible = torch.ones(1, 1, keys.shape[1], dtype=torch.bool)
        step = model.step(torch.tensor([[tokens[-1]]]), hidden, torch.tensor([[p + j]]),
                          (keys, values), visible)  # fmt: skip
        keys, values = torch.cat((keys, step.k), 1), torch.cat((values, step.v), 1)
        logits, hidden = step.logits[0, 0], step.hidden
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("sampled", [False, True])
def test_step_k_reads_the_drafts_own_token_k_minus_1(reference, sampled):
    config, _, model = reference
    ids, aux = _inputs(config)
    stream, anchor = torch.tensor([0, 1, 1]), torch.tensor([5, 20, 1])
    drafter = ARCH.drafter
    state = drafter.propose(model, aux, stream, anchor, ids[stream, anchor], ids=ids)
    k, Vd = config.block_size, config.draft_vocab_size
    noise = torch.empty(3, k, Vd).exponential_(generator=torch.Generator().manual_seed(1))
    rolled = drafter.rollout(state, noise if sampled else None)
    assert rolled.tokens.shape == (3, k) and rolled.confidence is None
    assert torch.equal(rolled.prev[:, 0], ids[stream, anchor])
    assert torch.equal(rolled.prev[:, 1:], rolled.tokens[:, :-1])  # step k read token k - 1
    with torch.no_grad():
        for n, (s, p) in enumerate(zip(stream.tolist(), anchor.tolist())):
            tokens, logits = _hand_chain(model, ids, aux, s, p, noise[n] if sampled else None)
            assert rolled.tokens[n].tolist() == tokens
            torch.testing.assert_close(rolled.logits[n], logits, rtol=0, atol=ORDER_TOL)


def test_own_tokens_teacher_forced_and_the_reference_replay_are_bit_exact(reference):
    config, weights, model = reference
    ids, aux = _inputs(config, seed=2)
    stream, anchor = torch.tensor([0, 0, 1]), torch.tensor([3, 11, 17])
    drafter = ARCH.drafter
    state = drafter.propose(model, aux, stream, anchor, ids[stream, anchor], ids=ids)
    greedy = drafter.rollout(state)
    assert torch.equal(drafter.teacher_forced(state, greedy.tokens).logits, greedy.logits)
    head = drafter.reference_head(weights, config)
    assert torch.equal(drafter.replay(head, drafter.keep(state), greedy), greedy.logits)
    # on other tokens the chain follows them: step j + 1 reads the given token j
    other = (greedy.tokens + 1) % config.vocab_size
    forced = drafter.teacher_forced(state, other)
    assert torch.equal(forced.prev[:, 1:], other[:, :-1])
    assert torch.equal(forced.logits[:, 0], greedy.logits[:, 0])
    assert not torch.equal(forced.logits[:, 1:], greedy.logits[:, 1:])
    assert torch.equal(drafter.replay(head, drafter.keep(state), forced), forced.logits)


def test_a_chain_needs_the_streams_tokens_at_its_anchor(reference):
    config, _, model = reference
    ids, aux = _inputs(config)
    with pytest.raises(ValueError, match="streams' tokens"):
        ARCH.drafter.propose(model, aux, [0], [4], ids[0, 4:5])
    with pytest.raises(ValueError, match="token at its anchor"):
        ARCH.drafter.propose(model, aux, [0], [4], ids[0, 4:5] + 1, ids=ids)


def test_a_reduced_vocabulary_maps_through_d2t(reference):
    """The reduced draft's logits are the full draft's at its ids; what it emits and feeds back
    is the target id of its argmax (greedy) or of its race's winner (sampled)."""
    config, weights, model = reference
    keep = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(3))[:200]
    keep = keep.sort().values
    small_config, small_weights = _reduced(config, weights, keep)
    small = Eagle3Draft(small_config, small_weights)
    ids, aux = _inputs(config, seed=4)
    stream, anchor = torch.tensor([0, 1]), torch.tensor([7, 15])
    state = ARCH.drafter.propose(small, aux, stream, anchor, ids[stream, anchor], ids=ids)
    full = ARCH.drafter.propose(model, aux, stream, anchor, ids[stream, anchor], ids=ids)
    greedy = ARCH.drafter.rollout(state)
    assert torch.equal(greedy.tokens, keep[greedy.logits.argmax(-1)])
    forced = ARCH.drafter.teacher_forced(full, greedy.tokens)  # the same chain, full vocabulary
    torch.testing.assert_close(greedy.logits, forced.logits[..., keep], rtol=0, atol=ORDER_TOL)
    noise = torch.empty(2, config.block_size, len(keep)).exponential_()
    sampled = ARCH.drafter.rollout(state, noise, 0.7)
    assert torch.equal(
        sampled.tokens, keep[(sampling_probs(sampled.logits, 0.7) / noise).argmax(-1)]
    )


# speculate against a tiny transformers Qwen3 target (tests/test_speculate.py's shape)
V, H = 8, 32


@pytest.fixture(scope="module")
def target():
    return peaked_qwen3_target(V, H)


def _draft_for(target, reduced: bool) -> Eagle3Draft:
    """An EAGLE-3 draft reading the target's three layer outputs (hidden-states ids 1, 2, 3),
    embedding and head lent by the target; ``reduced``: over six of its eight tokens."""
    config = replace(PRESETS["eagle3-tiny"], hidden_size=H, intermediate_size=64, head_dim=8,
                     vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
                     aux_layer_ids=(1, 2, 3), target_num_hidden_layers=3)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    weights = {
        name: torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        for name, shape in tensor_shapes(config).items()
    }
    weights = {k: (1 + v) if k.endswith("norm.weight") else v for k, v in weights.items()}
    weights[EMBED] = target.model.embed_tokens.weight.detach().clone()
    weights[LM_HEAD] = target.lm_head.weight.detach().clone()
    if reduced:
        config, weights = _reduced(config, weights, torch.tensor([0, 1, 3, 5, 6, 7]))
    return Eagle3Draft(config, weights)


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("prompt", [[1, 2, 3, 4], [5, 0, 6], [2]])
def test_greedy_speculation_emits_the_targets_greedy_continuation(target, reduced, prompt):
    draft = _draft_for(target, reduced)
    out = speculative_decode(target, draft, prompt, 24, GREEDY)
    assert out.tokens == target_greedy(target, prompt, 24)
    assert len(out.accepted) < 24 and any(out.accepted)  # drafts were accepted, not just emitted
    assert all(0 <= a <= draft.config.block_size for a in out.accepted)


@pytest.mark.parametrize("reduced", [False, True])
def test_probabilistic_speculation_decodes(target, reduced):
    draft = _draft_for(target, reduced)
    out = speculative_decode(target, draft, [1, 2, 3], 20, PROBABILISTIC_STANDARD, seed=5)
    assert len(out.tokens) == 20 and all(0 <= t < V for t in out.tokens)
    assert all(0 <= a <= draft.config.block_size for a in out.accepted)


# The commands on files: synth's draft (eval-drift), one shaped for a Qwen3 target (speculate)


def _write_reduced(source: Path, directory: Path, keep: torch.Tensor) -> Path:
    """``source`` (a full-vocabulary draft with its own lm_head) over ``keep`` only."""
    directory.mkdir(parents=True)
    config = load_config(source)
    tensors = load_file(source / "model.safetensors")
    small_config, small = _reduced(config, tensors, keep)
    (directory / "config.json").write_text(json.dumps(small_config.to_json()))
    save_file({k: v.contiguous() for k, v in small.items()}, directory / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            (directory / name).write_bytes((source / name).read_bytes())
    return directory


def _in_range(metrics: dict) -> None:
    for key in ("greedy_agree", "one_minus_tv"):
        for entry in metrics[key]:
            assert 0 <= entry["lo"] <= entry["value"] <= entry["hi"] <= 1, (key, entry)
    for key in ("kl", "reverse_kl"):
        assert math.isfinite(metrics[key]["mean"]["value"]) and metrics[key]["mean"]["value"] >= 0


@pytest.mark.parametrize("reduced", [False, True])
def test_eval_drift_runs_every_regime_with_acceptance(e3, tmp_path, reduced):
    model = e3
    if reduced:
        keep = torch.arange(0, load_config(e3).vocab_size, 3)
        model = _write_reduced(e3, tmp_path / "reduced", keep)
    out = tmp_path / "r.json"
    cli_ok(["eval-drift", "--model", str(model), "--formats", "bf16,fp8,nvfp4", "--regime",
            "all", "--blocks", "12", "--acceptance", "--json", str(out)])  # fmt: skip
    results = json.loads(out.read_text())
    k = load_config(model).block_size
    assert results["block_size"] == k
    for regime in ("gauss", "heavy", "boot"):
        variants = results["regimes"][regime]["variants"]
        assert list(variants) == ["bf16", "fp8", "nvfp4"]
        for entry in variants.values():
            _in_range(entry["metrics"])
            accepted = entry["acceptance"]["reference"]
            modes = [m for name, m in accepted.items() if name != "loss_vs_bf16"]
            assert len(modes) == 5
            for mode in modes:
                emitted = mode["emitted"]["value"]
                assert 1 <= emitted <= k + 1 and math.isfinite(emitted)


# every format, and the serving conditions EAGLE-3 is served under (tests/test_eagle3_serving.py)
SPECULATED = ("bf16", "fp8", "nvfp4", "bf16+kv=fp8", "bf16+head=nvfp4", "fp8+a=fp8-dynamic",
              "bf16+target=fp8")  # fmt: skip


def test_speculate_runs_an_eagle3_draft_in_every_format(tmp_path):
    """The CLI on a tiny Qwen3 target (64 wide, 6 layers): the EAGLE-3 draft reads its layers
    2, 4 and 6 (hidden-states ids) and its embedding and head; greedy verification emits the
    target's greedy continuation whatever the format."""
    from qstream.capture.target import load_target

    target_dir = make_qwen3_target(tmp_path / "target")
    assert (HIDDEN, LAYERS) == (64, 6)
    draft = tmp_path / "draft"
    draft.mkdir()
    config = replace(
        PRESETS["eagle3-tiny"],
        vocab_size=VOCAB,
        draft_vocab_size=VOCAB,
        target_num_hidden_layers=LAYERS,
    )
    lent = load_file(target_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) / math.sqrt(s[-1])
               for n, s in tensor_shapes(config).items()}  # fmt: skip
    tensors[EMBED], tensors[LM_HEAD] = lent["model.embed_tokens.weight"], lent["lm_head.weight"]
    save_file(
        {k: v.bfloat16().contiguous() for k, v in tensors.items()}, draft / "model.safetensors"
    )
    (draft / "config.json").write_text(json.dumps(config.to_json()))
    corpus = tmp_path / "q.jsonl"
    corpus.write_text(json.dumps({"question": "Tom has 3 apples.", "answer": "#### 3"}) + "\n")
    out = tmp_path / "s.json"
    cli_ok(["speculate", "--target", str(target_dir), "--model", str(draft), "--corpus",
            str(corpus), "--prompts", "1", "--new-tokens", "12", "--dtype", "float32",
            "--formats", ",".join(SPECULATED), "--json", str(out)])  # fmt: skip
    results = json.loads(out.read_text())
    loaded = load_target(target_dir, torch.float32)
    prompt = loaded.tokenizer("Tom has 3 apples.\n", add_special_tokens=False)["input_ids"]
    greedy = target_greedy(loaded.model, prompt, 12)
    for name in SPECULATED:
        if "+target=" not in name:  # a quantized target emits its own greedy continuation
            assert results["runs"][name][0]["tokens"] == greedy, name
        mean = results["variants"][name]["summary"]["mean_acceptance_length"]["value"]
        assert 1 <= mean <= config.block_size + 1


def test_k_is_the_speculators_proposal_or_the_configs_num_speculative_tokens(tmp_path):
    """speculators' layout: the first proposal method's speculative_tokens, as vLLM's
    build_vllm_speculative_config reads it; vLLM's layout: num_speculative_tokens, else 3."""
    dense = PRESETS["eagle3-tiny"].to_json()
    assert dense["num_speculative_tokens"] == 3
    assert Eagle3Config.from_json({**dense, "num_speculative_tokens": 5}).block_size == 5
    layer = {k: dense[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings",
             "rope_parameters")}  # fmt: skip
    proposals = {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 6}]}
    data = {"speculators_model_type": "eagle3", "transformer_layer_config": layer,
            "speculators_config": proposals}  # fmt: skip
    assert Eagle3Config.from_json(data).block_size == 6
    data["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 0
    with pytest.raises(ValueError, match="num_speculative_tokens = 0"):
        Eagle3Config.from_json(data)
