"""evals/train_smollm2_pair.py end to end on a tiny Llama target (tests/hf_targets.py) standing in
for the converted SmolLM2 (docs/calibration.md, "SmolLM2 pair"): generate, capture, train one
epoch, and qstream reads the draft it writes.  No GGUF file is parsed: the script only hashes the
file its target's convert record names.  Speculators lane (``pytest -m speculators``, .ci/run)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from cli_helpers import load_script

from qstream.arch.registry import load_config
from qstream.publish import CONVERT_RECORD

pytestmark = [pytest.mark.speculators, pytest.mark.usefixtures("one_intra_op_thread")]

SCRIPT = Path(__file__).resolve().parents[1] / "evals" / "train_smollm2_pair.py"
TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _script():
    return load_script(SCRIPT)


def _target(tmp_path: Path) -> tuple[Path, Path]:
    from hf_targets import make_target

    target = make_target(tmp_path / "target", "llama")
    (target / "chat_template.jinja").write_text(TEMPLATE)
    gguf = tmp_path / "pkg" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    record = {"qstream_version": "0", "source": gguf.name, "bytes": gguf.stat().st_size}
    (target / CONVERT_RECORD).write_text(json.dumps(record))
    return target, gguf


def _args(target: Path, gguf: Path, gsm8k: Path, out: Path) -> list[str]:
    return ["--target", str(target), "--gguf", str(gguf), "--gsm8k", str(gsm8k),
            "--output", str(out), "--questions", "3", "--max-new-tokens", "6",
            "--batch-size", "2", "--draft-layers", "1", "--anchors", "4", "--pack", "128"]  # fmt: skip


@pytest.fixture
def gsm8k(tmp_path: Path) -> Path:
    rows = [{"question": f"Tom has {n} apples. How many?", "answer": f"#### {n}"} for n in range(4)]
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "gsm8k"


def test_the_script_writes_a_draft_qstream_reads(tmp_path, gsm8k):
    target, gguf = _target(tmp_path)
    out = tmp_path / "pair"
    assert _script().main(_args(target, gguf, gsm8k, out)) == 0
    record = json.loads((out / "train.json").read_text())
    assert record["target"]["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert set(record["seconds"]) == {"generate", "capture", "train", "total"}
    assert record["tokens"]["answer"] > 0
    digest = hashlib.sha256((out / "draft" / "model.safetensors").read_bytes()).hexdigest()
    assert record["sha256"] == {"draft/model.safetensors": digest}
    config = load_config(out / "draft")
    assert type(config).__name__ == "Qwen3DSparkConfig"
    # the aux layers spread over the target's 6 as qstream synth --target spreads them
    assert list(config.target_layer_ids) == [i - 1 for i in record["aux_hidden_state_layer_ids"]]
    assert list(config.target_layer_ids) == [1, 2, 3, 4]


def test_a_target_converted_from_another_file_is_refused(tmp_path, gsm8k, capsys):
    target, gguf = _target(tmp_path)
    other = gguf.with_name("other.gguf")
    other.write_bytes(b"GGUF stand-in")
    out = tmp_path / "pair"
    capsys.readouterr()
    assert _script().main(_args(target, other, gsm8k, out)) == 2
    assert capsys.readouterr().err.startswith(f"Error: {target}: converted from tiny.gguf")
    assert not out.exists()


def test_answers_generated_in_parts_train_one_draft(tmp_path, gsm8k, capsys):
    """--generate-only over two disjoint ranges, then --answers with both: the draft trains on
    every answer; a range answered twice, or at another --max-new-tokens, is one Error line."""
    target, gguf = _target(tmp_path)
    base = _args(target, gguf, gsm8k, tmp_path / "unused")[:-14]  # target, gguf, gsm8k only
    tail = ["--max-new-tokens", "6", "--batch-size", "2", "--draft-layers", "1", "--anchors", "4",
            "--pack", "128"]  # fmt: skip
    parts = []
    for first, n in ((0, 2), (2, 2)):
        out = tmp_path / f"part{first}"
        argv = [*base, "--output", str(out), "--first", str(first), "--questions", str(n)]
        assert _script().main([*argv, *tail, "--generate-only"]) == 0
        assert not (out / "draft").exists()
        saved = json.loads((out / "answers.json").read_text())
        assert (saved["first"], saved["questions"], len(saved["docs"])) == (first, n, n)
        parts.append(out / "answers.json")
    out = tmp_path / "pair"
    argv = [*base, "--output", str(out), *tail, "--answers", *map(str, parts)]
    assert _script().main(argv) == 0
    record = json.loads((out / "train.json").read_text())
    assert record["answers_reused"] == {str(parts[0]): [0, 2], str(parts[1]): [2, 4]}
    answered = sum(len(r) - s for p in parts for r, s in json.loads(p.read_text())["docs"])
    assert record["tokens"]["answer"] == answered
    capsys.readouterr()
    again = [*base, "--output", str(tmp_path / "twice"), *tail, "--answers", str(parts[0]),
             str(parts[0])]  # fmt: skip
    assert _script().main(again) == 2
    assert capsys.readouterr().err.startswith(f"Error: {parts[0]}: questions [0, 2] overlap")
    longer = [*base, "--output", str(tmp_path / "longer"), *tail, "--answers", str(parts[0])]
    longer[longer.index("--max-new-tokens") + 1] = "7"
    assert _script().main(longer) == 2
    assert capsys.readouterr().err.startswith(f"Error: {parts[0]}: max_new_tokens is 6")
    assert not (tmp_path / "twice").exists() and not (tmp_path / "longer").exists()
