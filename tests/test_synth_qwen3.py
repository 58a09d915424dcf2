"""``qstream synth`` for the Qwen3-style DSpark draft (docs/qwen3-dspark.md, "Synthetic
checkpoints"): the qwen3 presets, the stand-in target that lends both lm_head and embed_tokens,
``synth --target`` on a transformers Qwen3 target, and the pinned bytes of both tiny presets on any CPU."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from hf_targets import HIDDEN, LAYERS, QWEN3_ROPE_THETA, VOCAB, make_qwen3_target
from safetensors.torch import load_file
from tokenizers import Tokenizer

from qstream.arch.dspark_qwen3 import ARCH, PRESETS, Qwen3DSparkConfig, check_tensors, tensor_shapes
from qstream.arch.interface import EMBED, LM_HEAD, TARGET_HEAD_DIR
from qstream.arch.registry import load_config
from qstream.checkpoint.inspect import weight_stats
from qstream.checkpoint.read import read_target_tensors
from qstream.checkpoint.target import TargetShape
from qstream.serving import REFERENCE_VARIANT
from qstream.synth import markov
from qstream.synth.corpus import builtin_corpus
from qstream.synth.draft import _markov_head, draft_shapes, synth_checkpoint
from qstream.synth.markov import TARGET_TOP1
from qstream.synth.target import qwen3_draft_config, spread_layer_ids


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    return Path(synth_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("q3") / "d").output_dir)


def test_config_round_trips_and_parses(q3):
    config = load_config(q3)
    assert isinstance(config, Qwen3DSparkConfig)
    data = json.loads((q3 / "config.json").read_text())
    assert data == config.to_json() and Qwen3DSparkConfig.from_json(data) == config
    tok = Tokenizer.from_file(str(q3 / "tokenizer.json"))
    assert config.vocab_size == config.draft_vocab_size == tok.get_vocab_size()
    assert config.mask_token_id == tok.token_to_id("<|mask|>")
    base = PRESETS["qwen3-tiny"]
    assert replace(config, vocab_size=base.vocab_size, draft_vocab_size=base.vocab_size,
                   eos_token_id=base.eos_token_id) == base  # fmt: skip


def test_tensors_are_the_table_without_embed_tokens(q3):
    config = load_config(q3)
    tensors = load_file(q3 / "model.safetensors")
    check_tensors(config, {k: tuple(v.shape) for k, v in tensors.items()}, str(q3))
    assert set(tensors) == set(tensor_shapes(config)) - {EMBED}
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}


def test_target_head_lends_lm_head_and_embed_tokens(q3):
    config = load_config(q3)
    head = read_target_tensors(q3 / TARGET_HEAD_DIR, [LM_HEAD, EMBED])
    for name in (LM_HEAD, EMBED):
        assert tuple(head[name].shape) == (config.vocab_size, config.hidden_size), name
    assert not torch.equal(head[LM_HEAD], head[EMBED])
    head_config = json.loads((q3 / TARGET_HEAD_DIR / "config.json").read_text())
    assert head_config["vocab_size"] == config.vocab_size
    assert head_config["hidden_size"] == config.hidden_size


def test_same_seed_same_bytes(q3, tmp_path):
    synth_checkpoint("qwen3-tiny", tmp_path / "again", seed=0)
    assert _digest(tmp_path / "again") == _digest(q3)
    synth_checkpoint("qwen3-tiny", tmp_path / "other", seed=1)
    assert _digest(tmp_path / "other")["model.safetensors"] != _digest(q3)["model.safetensors"]


def test_markov_head_is_the_corpus_bigrams_calibrated(q3):
    """The head is the K3 path's: the written tokenizer's corpus bigrams, scaled so that the
    mean top-1 probability on the corpus is TARGET_TOP1."""
    config = load_config(q3)
    tok = Tokenizer.from_file(str(q3 / "tokenizer.json"))
    w1, w2, _, top1 = _markov_head(tok, builtin_corpus(seed=0), config, 0)
    tensors = load_file(q3 / "model.safetensors")
    assert torch.equal(tensors["markov_head.markov_w1.weight"], w1.bfloat16())
    assert torch.equal(tensors["markov_head.markov_w2.weight"], w2.bfloat16())
    record = json.loads((q3 / "qstream_synth.json").read_text())["summary"]
    assert record["preset"] == "qwen3-tiny" and abs(record["predicted_top1"] - TARGET_TOP1) < 0.01
    assert abs(top1 - TARGET_TOP1) < 0.01


def _widest_column(w: torch.Tensor) -> float:
    """The largest per-input-column RMS over the median one."""
    rms = w.float().pow(2).mean(0).sqrt()
    return float(rms.max() / rms.median())


def test_weight_statistics_are_realistic(q3):
    tensors = load_file(q3 / "model.safetensors")
    up = weight_stats(tensors["layers.0.mlp.up_proj.weight"].float())
    down = weight_stats(tensors["layers.0.mlp.down_proj.weight"].float())
    assert up["kurtosis"] > 4  # heavy tails everywhere
    assert down["col_spread"] > 2 * up["col_spread"]  # input-channel outliers in down_proj
    # and in the context projection fc (2 of its 320 columns: beyond p99, so the widest)
    assert _widest_column(tensors["fc.weight"]) > 2 * _widest_column(
        tensors["layers.0.self_attn.q_proj.weight"]
    )


def test_qwen3_8b_preset_shapes():
    """Shapes only: the 8B preset is never generated in tests."""
    shapes = draft_shapes(PRESETS["qwen3-8b"])
    assert EMBED not in shapes and LM_HEAD not in shapes
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert shapes["markov_head.markov_w2.weight"] == (151936, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 4096 + 256)


# ---------------------------------------------------------------------------------------------
# synth --target on a Qwen3 target


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    return make_qwen3_target(tmp_path_factory.mktemp("qwen3") / "target")


@pytest.fixture(scope="module")
def q3_for_target(qwen3_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("q3t") / "draft"
    cli_ok(["synth", "--target", str(qwen3_target), "--output_dir", str(out)])
    return out


def test_synth_target_shapes_a_qwen3_draft(qwen3_target, q3_for_target):
    draft = q3_for_target
    config = load_config(draft)
    target = json.loads((qwen3_target / "config.json").read_text())
    assert isinstance(config, Qwen3DSparkConfig)
    for key in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size"):  # fmt: skip
        assert getattr(config, key) == target[key], key
    assert config.rope_parameters.rope_theta == QWEN3_ROPE_THETA
    assert (config.target_hidden_size, config.draft_vocab_size) == (HIDDEN, VOCAB)
    assert config.num_hidden_layers == 5 and config.target_num_hidden_layers == LAYERS
    assert config.target_layer_ids == spread_layer_ids(LAYERS, 5)
    tok = Tokenizer.from_file(str(draft / "tokenizer.json"))
    assert config.mask_token_id == tok.token_to_id("<|mask|>")
    assert (draft / "tokenizer.json").read_bytes() == (qwen3_target / "tokenizer.json").read_bytes()
    assert not (draft / TARGET_HEAD_DIR).exists()
    tensors = load_file(draft / "model.safetensors")
    assert EMBED not in tensors and LM_HEAD not in tensors
    check_tensors(config, {k: tuple(v.shape) for k, v in tensors.items()}, str(draft))


def _qwen3_8b_json() -> dict:
    """Qwen3-8B's config.json as transformers 4 wrote it (rope_theta beside rope_scaling)."""
    return {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645}  # fmt: skip


def _shape(data: dict) -> TargetShape:
    return TargetShape("Qwen3-8B", "qwen3", data["hidden_size"], data["num_hidden_layers"],
                       data["vocab_size"], "0" * 64)  # fmt: skip


def test_a_qwen3_8b_target_gets_the_qwen3_8b_preset_shapes():
    data = _qwen3_8b_json()
    ids = spread_layer_ids(36, 5)
    config = qwen3_draft_config(data, _shape(data), PRESETS["qwen3-8b"], ids, 151669, ARCH)
    assert tensor_shapes(config) == tensor_shapes(PRESETS["qwen3-8b"])
    assert config.rope_parameters == PRESETS["qwen3-8b"].rope_parameters
    assert (config.eos_token_id, config.bos_token_id) == (151645, 151643)


def test_yarn_and_a_shallow_target():
    data = _qwen3_8b_json()
    data.update(num_hidden_layers=3, max_position_embeddings=131072)
    data["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 32768}  # fmt: skip
    ids = spread_layer_ids(3, 5)
    config = qwen3_draft_config(data, _shape(data), PRESETS["qwen3-tiny"], ids, 7, ARCH)
    assert config.num_hidden_layers == 3 and config.target_layer_ids == (1,)
    assert (config.rope_parameters.rope_type, config.rope_parameters.factor) == ("yarn", 4.0)
    assert config.original_max_position_embeddings == 32768


def _fake_target(directory: Path, model_type: str) -> Path:
    """A config.json alone: the preset is checked before anything else is read."""
    directory.mkdir()
    data = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 6, "vocab_size": 512}
    (directory / "config.json").write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize(
    ("model_type", "preset", "message"),
    [
        ("qwen3", "tiny", "is a qwen3 target, whose draft is Qwen3-style: --preset qwen3-tiny"),
        ("llama", "qwen3-tiny", "is a llama target, whose draft is a DSpark-MLA one"),
    ],
)
def test_a_preset_of_the_other_architecture_is_refused(tmp_path, model_type, preset, message):
    target = _fake_target(tmp_path / "target", model_type)
    out = tmp_path / "out"
    error = cli_error(
        ["synth", "--target", str(target), "--preset", preset, "--output_dir", str(out)]
    )
    assert message in error and f"--preset {preset}" in error
    assert not out.exists()


def test_a_bad_qwen3_target_config_names_file_and_key(tmp_path):
    target = make_qwen3_target(tmp_path / "target", layers=4)
    data = json.loads((target / "config.json").read_text())
    data["num_key_value_heads"] = 3
    (target / "config.json").write_text(json.dumps(data))
    error = cli_error(["synth", "--target", str(target), "--output_dir", str(tmp_path / "out")])
    assert f"{target / 'config.json'}: num_key_value_heads = 3 must divide" in error
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# The same bytes on every CPU

# sha256 of `qstream synth --preset P --seed 0` (built-in corpus).  synth draws and reduces in
# float64 and fixes the Markov factors' basis (qstream/synth/draft.py, _canonical), so these
# hold on any x86-64 CPU, instruction set (ATEN_CPU_CAPABILITY default / avx2 / avx512) and
# thread count: .ci/run runs this test again under OMP_NUM_THREADS=1 and
# ATEN_CPU_CAPABILITY=default.  tokenizers' BPE trainer feeds them too: a change there changes
# these.  Files holding the qstream version (qstream_synth.json) are left out.
SYNTH_SHA256 = {
    "tiny": {
        "config.json": "47a5502e0f8383d90ea7513dca5c3eb9e58f37770a3161bbefbe1fd219569307",
        "model.safetensors": "7a254bdb356a225f72556ed35a57effd539f688b196874d411c5c4e2f30fb38c",
        "target_head/config.json": "e8c8aa45aa1f90a422dece24e807b6e15d4c5a7e19ac995a39f295a48cd89927",
        "target_head/model-00001-of-00001.safetensors":
            "ef4862895ec42781d925b4dddeb62a75f03b213a5568936f4277da194000e401",
        "tokenizer.json": "c71a5909698556b2756a97d662069aa65a92f941b8a8c6938458718622d80e73",
    },
    "qwen3-tiny": {
        "config.json": "e7b1418dd75f62e26b1cfb256b11489279ea55d65a1df59023116dea5d56a133",
        "model.safetensors": "4436a49c5d9fcbba981037b1ef2b82996bdfcb99d96745d8a64acc33fdbe59b1",
        "target_head/model-00001-of-00001.safetensors":
            "9a2fef23da97144fce10541dba18a55ee517272cca62c7c5b499a714e810f592",
        "tokenizer.json": "c71a5909698556b2756a97d662069aa65a92f941b8a8c6938458718622d80e73",
    },
}  # fmt: skip


@pytest.mark.parametrize("preset", sorted(SYNTH_SHA256))
def test_synth_bytes_are_pinned(preset, tiny, q3):
    digest = _digest(Path(tiny if preset == "tiny" else q3))
    pinned = SYNTH_SHA256[preset]
    assert {name: digest[name] for name in pinned} == pinned


def test_synth_bytes_survive_another_cpus_lapack(tmp_path, monkeypatch):
    """LAPACK's factors differ between CPUs (MKL on AMD EPYC against Intel) by about 1e-14 of a
    column's largest entry: noise ten times that in every singular vector and value leaves the
    pinned bytes (qstream/synth/markov.py, _flush). Before the grid, 1e-14 changed them."""
    svd = markov._svd_lowrank
    gen = torch.Generator().manual_seed(3)

    def noisy(*args, **kwargs):
        u, s, v = svd(*args, **kwargs)

        def jitter(x):  # fmt: skip
            return x + x.abs().amax(0, keepdim=True) * 1e-13 * torch.randn(
                x.shape, generator=gen, dtype=x.dtype
            )

        return (
            jitter(u),
            s * (1 + 1e-13 * torch.randn(s.shape, generator=gen, dtype=s.dtype)),
            jitter(v),
        )

    monkeypatch.setattr(markov, "_svd_lowrank", noisy)
    out = Path(synth_checkpoint("qwen3-tiny", tmp_path / "q3").output_dir)
    pinned = SYNTH_SHA256["qwen3-tiny"]
    assert {name: _digest(out)[name] for name in pinned} == pinned


# ---------------------------------------------------------------------------------------------
# Loading what synth writes (qstream/arch/dspark_qwen3/__init__.py)


def test_load_weights_borrows_embed_and_lm_head_from_target_head(q3):
    config = load_config(q3)
    weights = ARCH.load_weights(q3, None, config)
    needed = {**tensor_shapes(config), LM_HEAD: (config.vocab_size, config.hidden_size)}
    assert {k: tuple(v.shape) for k, v in weights.items()} == needed
    head = read_target_tensors(q3 / TARGET_HEAD_DIR, [LM_HEAD, EMBED])
    for name in (LM_HEAD, EMBED):
        assert torch.equal(weights[name], head[name]), name
    model = ARCH.build(config, weights, REFERENCE_VARIANT, "cpu")  # and the forward takes them
    aux = torch.randn(1, 16, config.aux_size, generator=torch.Generator().manual_seed(0))
    rollout = ARCH.drafter.rollout(ARCH.drafter.propose(model, aux, *torch.tensor([[0], [8], [5]])))
    assert rollout.logits.shape == (1, config.block_size, config.vocab_size)
    assert rollout.confidence is not None and bool(torch.isfinite(rollout.logits).all())


def test_load_weights_borrows_from_the_qwen3_target(qwen3_target, q3_for_target):
    from transformers import AutoModelForCausalLM

    config = load_config(q3_for_target)
    weights = ARCH.load_weights(q3_for_target, qwen3_target, config)
    assert set(weights) == set(tensor_shapes(config)) | {LM_HEAD}
    reference = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32)
    assert torch.equal(weights[EMBED].float(), reference.model.embed_tokens.weight.detach())
    assert torch.equal(weights[LM_HEAD].float(), reference.lm_head.weight.detach())


def test_the_builtin_draft_is_built_by_todays_synth(tmp_path, monkeypatch):
    """The built-in draft's cache directory names synth's recipe, so a cache built by an older
    synth is never read as today's; what it holds is the pinned tiny draft."""
    from qstream.eval.corpus import builtin_model_dir
    from qstream.synth.draft import RECIPE

    monkeypatch.setenv("QSTREAM_CACHE", str(tmp_path))
    directory = builtin_model_dir()
    assert f"-r{RECIPE}-" in directory.name
    digest = _digest(directory)
    assert digest["model.safetensors"] == SYNTH_SHA256["tiny"]["model.safetensors"]
