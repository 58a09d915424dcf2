"""Chat targets in tests: a copy of a target with a chat template, and the check every chat
target's draft must pass, that greedy ``speculate --apply-chat-template`` emits the target's own
greedy continuation of each question put through the template (docs/speculate.md, "Chat
template").  The oracle builds the prompt with transformers' ``apply_chat_template(...,
tokenize=True)``, not with qstream's own function."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from cli_helpers import cli_ok

# ChatML, as SmolLM2-135M-Instruct's template writes it (less its default system turn)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def with_chat_template(target: Path, directory: Path) -> Path:
    """A copy of ``target`` whose tokenizer has :data:`CHAT_TEMPLATE` (chat_template.jinja, where
    transformers saves one)."""
    shutil.copytree(target, directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def questions(corpus: Path) -> list[str]:
    """A GSM8K-style JSONL corpus's questions, read without qstream."""
    return [json.loads(line)["question"] for line in corpus.read_text().splitlines() if line]


def speculate_emits_target_greedy(
    target: Path, draft: Path, corpus: Path, out: Path, prompts: int, new_tokens: int, *extra: str
) -> dict:
    """Run greedy ``speculate --apply-chat-template`` on the first ``prompts`` questions of
    ``corpus`` for ``new_tokens`` tokens, assert that every variant emitted the target's own
    greedy continuation of the templated prompt, and return the results."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qstream.speculate.decode import target_greedy
    from qstream.verification import GREEDY

    cli_ok(["speculate", "--target", str(target), "--model", str(draft), "--corpus", str(corpus),
            "--prompts", str(prompts), "--new-tokens", str(new_tokens), "--rule", GREEDY.name,
            "--apply-chat-template", "--dtype", "float32", "--json", str(out), *extra])  # fmt: skip
    results = json.loads(out.read_text())
    assert results["settings"]["chat_template"] is True
    assert "chat template" in results["settings"]["prompt"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i, question in enumerate(questions(corpus)[:prompts]):
        turn = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        greedy = target_greedy(model, prompt, new_tokens)
        for name, runs in results["runs"].items():
            assert runs[i]["prompt_tokens"] == len(prompt), (name, i)
            assert runs[i]["tokens"] == greedy, (name, i)
    return results
