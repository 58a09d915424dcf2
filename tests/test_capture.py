"""``qstream capture`` against transformers itself: the tapped states equal the model's own
``output_hidden_states`` at the right indices (both layer-id conventions), padding changes
nothing, resume skips and refuses, ``--generate`` is seeded and samples the target, the vLLM
export is vLLM's / speculators' layout, and bad inputs are one line, exit 1 (docs/capture.md)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from chat_targets import with_chat_template
from cli_helpers import cli_error
from hf_targets import HIDDEN, LAYERS, make_draft_config, make_target
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qstream.arch.markov import sampling_probs
from qstream.capture.run import CaptureSettings, Sampling, generate, run_capture
from qstream.capture.target import cache_keyword
from qstream.progress import Silent
from qstream.speculate.decode import new_cache
from qstream.synth.corpus import builtin_corpus

IDS = (0, 2, 3)  # the draft's target_layer_ids (layer-output convention)
# fp32 on CPU: the same model run batched with padding vs alone differs only by summation order
# in matmuls of different shapes; observed <= 1e-6, bound with margin.
PAD_ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def target(request, tmp_path_factory):
    return make_target(tmp_path_factory.mktemp(request.param) / "target", request.param)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_draft_config(tmp_path_factory.mktemp("draft") / "draft", IDS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short word problems of different lengths, as plain text."""
    path = tmp_path_factory.mktemp("corpus") / "problems.txt"
    path.write_text("\n\n".join(builtin_corpus(n=16, seed=3)) + "\n")
    return str(path)


def _capture(target, draft, corpus, out, **kw):
    settings = dict(dtype="float32", streams=3, max_tokens=24, batch_size=3, corpus=corpus)
    return run_capture(CaptureSettings(str(target), str(draft), str(out), **{**settings, **kw}))


def _reference(target: Path, ids: torch.Tensor):
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return model, [h[0] for h in out.hidden_states]  # N+1 tensors [T, H]


def test_states_equal_transformers_hidden_states(target, draft, corpus, tmp_path):
    _capture(target, draft, corpus, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "capture.json").read_text())
    assert record["layer_convention"] == "layer-output" and record["layer_ids"] == list(IDS)
    for i in range(3):
        f = load_file(tmp_path / "out" / f"stream-{i:06d}.safetensors")
        assert set(f) == {"input_ids", "aux_hidden_states", "target_hidden_states"}
        assert f["input_ids"].dtype == torch.int64 and f["aux_hidden_states"].dtype == torch.float32
        _, hs = _reference(target, f["input_ids"])
        # layer-output id j is output_hidden_states[j + 1]; [N] is after the final norm
        want = torch.cat([hs[j + 1] for j in IDS], dim=-1)
        torch.testing.assert_close(f["aux_hidden_states"], want, rtol=0, atol=PAD_ATOL)
        torch.testing.assert_close(f["target_hidden_states"], hs[LAYERS], rtol=0, atol=PAD_ATOL)


def test_hidden_states_index_convention_names_the_same_layers(target, draft, corpus, tmp_path):
    _capture(target, draft, corpus, tmp_path / "a", streams=1)
    hsi = [j + 1 for j in IDS]
    _capture(target, draft, corpus, tmp_path / "b", streams=1, layers=tuple(hsi),
             layer_convention="hidden-states-index")  # fmt: skip
    a = load_file(tmp_path / "a" / "stream-000000.safetensors")
    b = load_file(tmp_path / "b" / "stream-000000.safetensors")
    assert torch.equal(a["aux_hidden_states"], b["aux_hidden_states"])
    # and not an off-by-one of it: the same ids read as layer outputs are other layers
    _capture(target, draft, corpus, tmp_path / "c", streams=1, layers=tuple(hsi))
    c = load_file(tmp_path / "c" / "stream-000000.safetensors")
    assert not torch.allclose(a["aux_hidden_states"], c["aux_hidden_states"])


def test_padded_batches_equal_streams_alone(target, draft, corpus, tmp_path):
    _capture(target, draft, corpus, tmp_path / "batched", streams=4, batch_size=4, max_tokens=200)
    _capture(target, draft, corpus, tmp_path / "alone", streams=4, batch_size=1, max_tokens=200)
    lengths = set()
    for i in range(4):
        a = load_file(tmp_path / "batched" / f"stream-{i:06d}.safetensors")
        b = load_file(tmp_path / "alone" / f"stream-{i:06d}.safetensors")
        lengths.add(a["input_ids"].numel())
        assert torch.equal(a["input_ids"], b["input_ids"])
        for name in ("aux_hidden_states", "target_hidden_states"):
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=PAD_ATOL)
    assert len(lengths) > 1, "the streams must differ in length for padding to be tested"


def test_resume_skips_written_streams_and_refuses_changed_settings(target, draft, corpus, tmp_path):
    out = tmp_path / "out"
    first = _capture(target, draft, corpus, out, streams=2)
    before = (out / "stream-000000.safetensors").read_bytes()
    (out / "stream-000001.safetensors").unlink()  # as if the run had been killed before it
    again = _capture(target, draft, corpus, out, streams=3)
    assert (first.written, again.written, again.skipped, again.streams) == (2, 2, 1, 3)
    assert (out / "stream-000000.safetensors").read_bytes() == before
    assert json.loads((out / "capture.json").read_text())["streams"] == 3
    args = ["capture", "--target", str(target), "--model", str(draft), "--output", str(out),
            "--corpus", corpus, "--dtype", "float32", "--max-tokens", "25"]  # fmt: skip
    assert "max_tokens = 24, this run has 25" in cli_error(args)


def test_an_interrupted_run_leaves_only_complete_files(target, draft, corpus, tmp_path):
    out = tmp_path / "out"

    class StopAfterFirstBatch(Silent):
        def advance(self, what, done, work=0.0, kind=""):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_capture(CaptureSettings(str(target), str(draft), str(out), corpus=corpus,
                                    dtype="float32", streams=4, batch_size=2, max_tokens=24),
                    StopAfterFirstBatch())  # fmt: skip
    names = sorted(p.name for p in out.iterdir())
    assert names == ["capture.json", "stream-000000.safetensors", "stream-000001.safetensors"]
    resumed = _capture(target, draft, corpus, out, streams=4, batch_size=2)
    assert (resumed.written, resumed.skipped) == (2, 2)


def _generated(target, draft, corpus, out, seed, top_p=0.5):
    sampling = Sampling(new_tokens=12, temperature=1.0, top_p=top_p, top_k=None, seed=seed)
    _capture(target, draft, corpus, out, streams=2, max_tokens=6, sampling=sampling)
    return [load_file(out / f"stream-{i:06d}.safetensors") for i in range(2)]


def test_generate_is_seeded_and_samples_the_targets_nucleus(target, draft, corpus, tmp_path):
    a = _generated(target, draft, corpus, tmp_path / "a", seed=0)
    b = _generated(target, draft, corpus, tmp_path / "b", seed=0)
    c = _generated(target, draft, corpus, tmp_path / "c", seed=1)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert any(not torch.equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))
    model, _ = _reference(target, a[0]["input_ids"])
    head = model.lm_head.weight.detach()
    for f in a:
        ids, final = f["input_ids"], f["target_hidden_states"]
        assert ids.numel() > 6
        # each sampled token lies in the target's top-p nucleus given the stream before it,
        # read from the captured final states: stream and states belong together
        probs = sampling_probs(final[5:-1] @ head.T, 1.0, 0.5)  # positions predicting 6..T-1
        assert bool((probs.gather(1, ids[6:, None]) > 0).all())
    record = json.loads((tmp_path / "a" / "capture.json").read_text())
    assert record["source"] == "generate" and record["sampling"]["top_p"] == 0.5


def test_generate_prompts_through_the_chat_template(target, draft, corpus, tmp_path):
    """--apply-chat-template: each document's first line one user turn through the template
    (transformers' own apply_chat_template the oracle), recorded in the sampling settings."""
    from transformers import AutoTokenizer

    chat = with_chat_template(target, tmp_path / "chat")
    sampling = Sampling(new_tokens=4, temperature=1.0, top_p=1.0, top_k=None, seed=0)
    out = tmp_path / "out"
    _capture(chat, draft, corpus, out, streams=2, max_tokens=128, sampling=sampling,
             apply_chat_template=True)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(chat)
    lines = [doc.strip().split("\n")[0] for doc in Path(corpus).read_text().split("\n\n")]
    for i in range(2):
        turn = [{"role": "user", "content": lines[i]}]
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        with safe_open(out / f"stream-{i:06d}.safetensors", "pt") as f:
            assert int(f.metadata()["prompt_tokens"]) == len(prompt)
            assert f.get_tensor("input_ids")[: len(prompt)].tolist() == prompt
    record = json.loads((out / "capture.json").read_text())
    assert record["sampling"]["chat_template"] is True
    plain = tmp_path / "plain"
    _capture(chat, draft, corpus, plain, streams=1, max_tokens=128, sampling=sampling)
    assert "chat_template" not in json.loads((plain / "capture.json").read_text())["sampling"]
    refused = cli_error(_args(chat, draft, tmp_path / "r", "--generate", "--apply-chat-template",
                              "--max-tokens", "8"))  # fmt: skip
    assert "document 0's templated prompt has" in refused and "--max-tokens 8" in refused
    refused = cli_error(_args(chat, draft, tmp_path / "r", "--apply-chat-template"))
    assert "--apply-chat-template needs --generate" in refused
    refused = cli_error(_args(target, draft, tmp_path / "r", "--generate", "--apply-chat-template"))
    assert f"the target's tokenizer ({target}) has no chat template" in refused
    assert not (tmp_path / "r").exists()


class _PastKeyValues(torch.nn.Module):
    """A causal LM as transformers 4 calls one: the KV cache is ``past_key_values``, in and out
    (the cache here is the number of forwards so far)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        self.seen.append(past_key_values)
        return SimpleNamespace(logits=torch.zeros(1, 1, 5), past_key_values=len(self.seen))


class _Cache(_PastKeyValues):
    """The same as transformers 5 calls it: ``cache``, in and out."""

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):
        self.seen.append(cache)
        return SimpleNamespace(logits=torch.zeros(1, 1, 5), cache=len(self.seen))


@pytest.mark.parametrize("toy, keyword", [(_Cache, "cache"), (_PastKeyValues, "past_key_values")])
def test_the_kv_cache_goes_by_the_keyword_the_forward_names(toy, keyword):
    """capture --generate and speculate's decoder: one shim, read from the forward's signature."""
    model = toy()
    assert cache_keyword(model) == keyword and list(new_cache(model)) == [keyword]
    generate(model, torch.device("cpu"), [1, 2], Sampling(3, 1.0, 1.0, None, 0), 0, eos=None)
    assert model.seen == [None, 1, 2, 3]  # each step is handed the previous output's cache


def test_vllm_export_is_speculators_layout(target, draft, corpus, tmp_path):
    _capture(target, draft, corpus, tmp_path / "q", streams=2)
    _capture(target, draft, corpus, tmp_path / "v", streams=2, export="vllm")
    record = json.loads((tmp_path / "v" / "capture.json").read_text())
    assert record["layer_convention"] == "hidden-states-index"
    assert record["layer_ids"] == [j + 1 for j in IDS] + [LAYERS]
    assert sorted(p.name for p in (tmp_path / "v").glob("hs_*")) == [
        "hs_0.safetensors",
        "hs_1.safetensors",
    ]
    for i in range(2):
        with safe_open(tmp_path / "v" / f"hs_{i}.safetensors", "pt") as f:
            assert sorted(f.keys()) == ["hidden_states", "token_ids"]
        v = load_file(tmp_path / "v" / f"hs_{i}.safetensors")
        q = load_file(tmp_path / "q" / f"stream-{i:06d}.safetensors")
        T = q["input_ids"].numel()
        assert v["token_ids"].dtype == torch.int64 and torch.equal(v["token_ids"], q["input_ids"])
        assert v["hidden_states"].shape == (T, len(IDS) + 1, HIDDEN)
        # speculators' loader (ArrowDataset._get_raw_data): [:, :-1].flatten(1) is the aux
        assert torch.equal(v["hidden_states"][:, :-1].flatten(1), q["aux_hidden_states"])
        model, hs = _reference(target, q["input_ids"])
        last = v["hidden_states"][:, -1]  # the last layer's output, before the final norm
        assert not torch.allclose(last, hs[LAYERS])
        with torch.no_grad():
            normed = model.model.norm(last)
        torch.testing.assert_close(normed, hs[LAYERS], rtol=0, atol=PAD_ATOL)


def _args(target, draft, out, *extra) -> list[str]:
    return ["capture", "--target", str(target), "--model", str(draft), "--output", str(out),
            "--dtype", "float32", "--streams", "1", *extra]  # fmt: skip


def test_bad_inputs_are_one_line(target, draft, tmp_path):
    out = tmp_path / "out"
    assert "not a directory" in cli_error(_args(tmp_path / "nothing", draft, out))
    assert "--layers 6: outside [0, 5]" in cli_error(
        _args(target, draft, out, "--layers", "0", "2", "6")
    )
    assert "outside [1, 6]" in cli_error(
        _args(
            target,
            draft,
            out,
            "--layers",
            "0",
            "2",
            "3",
            "--layer-convention",
            "hidden-states-index",
        )
    )
    wide = make_draft_config(tmp_path / "wide", IDS)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "target_hidden_size": 96}))
    assert "target_hidden_size = 96" in cli_error(_args(target, wide, out))
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    assert "draft vocab_size = 1000 does not match the target's vocab_size" in cli_error(
        _args(target, wide, out)
    )
    deep = make_draft_config(tmp_path / "deep", IDS, layers=12)
    assert "target_num_hidden_layers = 12" in cli_error(_args(target, deep, out))
    assert "num_target_layers = 2" in cli_error(_args(target, draft, out, "--layers", "0", "2"))
    custom = tmp_path / "custom"
    custom.mkdir()
    config = json.loads((target / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    (custom / "config.json").write_text(
        json.dumps({**config, "model_type": "mine", "auto_map": auto_map})
    )
    assert "--trust-remote-code" in cli_error(_args(custom, draft, out))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert "holds no capture.json" in cli_error(_args(target, draft, busy))
    assert not out.exists(), "nothing is written before the inputs are checked"


def test_device_map_auto_gives_the_same_states(target, draft, corpus, tmp_path):
    """--device-map auto goes through accelerate's dispatch (here every layer lands on the CPU):
    the hooks and the input placement still give the plain run's states exactly."""
    _capture(target, draft, corpus, tmp_path / "plain")
    _capture(target, draft, corpus, tmp_path / "auto", device_map="auto")
    for i in range(3):
        name = f"stream-{i:06d}.safetensors"
        plain, auto = load_file(tmp_path / "plain" / name), load_file(tmp_path / "auto" / name)
        assert plain.keys() == auto.keys()
        for key in plain:
            assert torch.equal(plain[key], auto[key]), key


@pytest.mark.parametrize("inside", ["--target", "--model"])
def test_an_output_inside_an_input_is_refused(inside, target, draft, tmp_path):
    """As quantize and speculate --capture refuse it: the inputs are never written into."""
    target, draft = shutil.copytree(target, tmp_path / "t"), shutil.copytree(draft, tmp_path / "d")
    parent = target if inside == "--target" else draft
    before = sorted(p.name for p in parent.iterdir())
    error = cli_error(_args(target, draft, parent / "states"))
    assert f"--output {parent / 'states'} is inside {inside}" in error, error
    assert sorted(p.name for p in parent.iterdir()) == before
