"""``qstream synth --target``: a draft shaped for a real Hugging Face target, and the path it
exists for, synth → capture → eval-drift --states, on a tiny DeepSeek-V3 target
(docs/model.md, docs/capture.md)."""

import json
import math

import pytest
import torch
from cli_helpers import cli_ok
from hf_targets import HIDDEN, LAYERS, VOCAB, make_target
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.dspark_mla.model import load_model
from qstream.arch.interface import TARGET_HEAD_DIR
from qstream.synth.corpus import builtin_corpus, train_tokenizer, write_tokenizer
from qstream.synth.markov import CALIBRATION_LOGITS
from qstream.synth.target import spread_layer_ids, synth_for_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("ds") / "target", "deepseek_v3")


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(out)])
    return out


def test_spread_layer_ids_rule():
    assert spread_layer_ids(24, 5) == PRESETS["small"].target_layer_ids
    assert spread_layer_ids(8, 5) == (1, 2, 4, 5, 6)
    assert spread_layer_ids(93, 5) == (1, 24, 46, 69, 91)
    assert spread_layer_ids(4, 5) == (1, 2)  # a shallow target gives fewer ids
    for depth in range(3, 200):
        ids = spread_layer_ids(depth, 5)
        assert len(set(ids)) == len(ids) and 1 <= ids[0] and ids[-1] <= depth - 2


def test_draft_is_shaped_for_the_target(target, draft):
    config = json.loads((draft / "config.json").read_text())
    assert (config["hidden_size"], config["target_hidden_size"]) == (HIDDEN, HIDDEN)
    assert config["vocab_size"] == VOCAB and config["target_num_hidden_layers"] == LAYERS
    assert config["target_layer_ids"] == list(spread_layer_ids(LAYERS, 5))
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    assert not (draft / TARGET_HEAD_DIR).exists()
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    embed = load_file(draft / "model.safetensors")["embed_tokens.weight"]
    want = reference.model.embed_tokens.weight.detach().to(torch.bfloat16)
    assert torch.equal(embed, want)
    model = load_model(draft, target=target)
    assert torch.equal(model.w["lm_head.weight"].float(), reference.lm_head.weight.detach())


def _eval(draft, target, states, out) -> dict:
    cli_ok(["eval-drift", "--model", str(draft), "--target", str(target), "--states", str(states),
         "--formats", "bf16,nvfp4", "--blocks", "32", "--acceptance", "--json", str(out)])  # fmt: skip
    return json.loads(out.read_text())


def test_capture_then_eval_drift_on_the_captured_states(target, draft, tmp_path):
    """The capture directory, its --export vllm twin and the same streams merged into qstream's
    one-file layout give identical results: capture's writers and eval-drift's readers were
    written separately (each from the layout's source), so this checks one against the other."""
    common = ["--target", str(target), "--model", str(draft), "--dtype", "float32",
              "--streams", "4", "--max-tokens", "64"]  # fmt: skip
    cli_ok(["capture", *common, "--output", str(tmp_path / "states")])
    cli_ok(["capture", *common, "--output", str(tmp_path / "hs"), "--export", "vllm"])
    merged = {}
    for i, path in enumerate(sorted((tmp_path / "states").glob("stream-*.safetensors"))):
        merged.update({f"stream.{i}.{k}": v for k, v in load_file(path).items()})
    save_file(merged, tmp_path / "merged.safetensors")
    runs = {
        name: _eval(draft, target, tmp_path / name, tmp_path / f"{name}.json")
        for name in ("states", "hs", "merged.safetensors")
    }
    assert runs["states"]["states"]["streams"] == 4
    assert runs["hs"]["states"]["format"] == "vllm"
    assert runs["states"]["regimes"] == runs["merged.safetensors"]["regimes"]
    assert runs["hs"]["regimes"] == runs["states"]["regimes"]


LARGE_VOCAB = 8192  # past 4,096: calibration draws 2**24 // V transitions; V x V is 67 M


class _Shapes(TorchDispatchMode):
    """Every strided tensor any torch operation makes (a sparse one is not a table)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.shapes.add(tuple(t.shape))
        return out


def _large_vocab_target(directory):
    """A tiny Llama with a real-sized vocabulary: its BPE plus added tokens the corpus never
    holds, as most of a real tokenizer's are for a given corpus."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=LARGE_VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=0,
                         pad_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok = train_tokenizer(builtin_corpus(n=600, seed=0), VOCAB)
    tok.add_tokens([f"<extra_{i}>" for i in range(LARGE_VOCAB - tok.get_vocab_size())])
    write_tokenizer(tok, directory)
    return directory


def test_large_vocabulary_builds_no_vocab_by_vocab_tensor(tmp_path):
    """synth --target at a real vocabulary: the bigram table is never formed [V, V] (nor any
    tensor with two dimensions of V), so memory grows with V, not V² (docs/model.md)."""
    target = _large_vocab_target(tmp_path / "target")
    corpus = tmp_path / "corpus.txt"  # short: the calibration draws one sample per transition
    corpus.write_text("\n".join(builtin_corpus(n=8, seed=0)) + "\n")
    with _Shapes() as seen:
        synth_for_target(target, tmp_path / "draft", seed=0, corpus=corpus)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["vocab_size"] == LARGE_VOCAB
    assert (LARGE_VOCAB, HIDDEN) in seen.shapes  # the embedding copy: V was seen
    square = [s for s in seen.shapes if sum(d >= LARGE_VOCAB for d in s) >= 2]
    assert not square, square
    biggest = max(math.prod(s) for s in seen.shapes)
    assert biggest <= max(CALIBRATION_LOGITS, LARGE_VOCAB * HIDDEN), biggest
    # its embeddings are tied: the draft borrows embed_tokens for lm_head
    model = load_model(tmp_path / "draft", target=target)
    embed = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.w["lm_head.weight"].float(), embed)
