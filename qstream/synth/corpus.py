"""The text side of a synthetic checkpoint (``qstream synth``): reading a corpus, the built-in
fallback corpus, and the byte-level BPE tokenizer trained on it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qstream.errors import QStreamError
from qstream.publish import write_json_atomic, write_text_atomic

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|mask|>")  # ids 0, 1, 2

NAMES = (
    "Ava Ben Chloe Dev Emma Finn Grace Hugo Isla Jack Kira Liam Maya Noah Olivia Priya Quinn Ravi "
    "Sara Tom"
).split()
THINGS = (
    "apples,books,pencils,cookies,marbles,stickers,cupcakes,shells,cards,flowers,eggs,coins,"
    "toy cars,bottles"
).split(",")

# question, then worked answer: add, multiply, subtract, share (s = a + b, p = c * b, t = a * c)
PROBLEMS = (
    "{who} has {a} {what}. {other} gives {who} {b} more {what}. How many {what} does {who} have "
    "now?\n{who} has {a} + {b} = <<{a}+{b}={s}>>{s} {what}.\n#### {s}",
    "{who} buys {c} boxes of {what}. Each box holds {b} {what}. How many {what} does {who} buy in "
    "total?\n{who} buys {c} x {b} = <<{c}*{b}={p}>>{p} {what}.\n#### {p}",
    "{who} had {s} {what} and gave {b} of them to {other}. How many {what} are left?\n"
    "{who} has {s} - {b} = <<{s}-{b}={a}>>{a} {what} left.\n#### {a}",
    "{who} shares {t} {what} equally among {c} friends. How many {what} does each friend get?\n"
    "Each friend gets {t} / {c} = <<{t}/{c}={a}>>{a} {what}.\n#### {a}",
)


def builtin_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Generated GSM8K-style word problems (question, worked answer, ``#### N``)."""
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]


def _problem(rng: random.Random) -> str:
    who, other = rng.sample(NAMES, 2)
    what = rng.choice(THINGS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    values = dict(who=who, other=other, what=what, a=a, b=b, c=c, s=a + b, p=c * b, t=a * c)
    return PROBLEMS[rng.randrange(4)].format(**values)


def read_corpus(path: str | Path) -> list[str]:
    """GSM8K-style JSONL (``question`` + newline + ``answer``) or plain text (documents
    separated by blank lines)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QStreamError(f"cannot read corpus {path}: {exc}") from None
    if path.suffix != ".jsonl":
        docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    else:
        docs = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                docs.append(f"{row['question']}\n{row['answer']}")
            except (json.JSONDecodeError, KeyError, TypeError):
                raise QStreamError(
                    f"{path}:{number}: expected a JSON object with 'question' and 'answer'"
                ) from None
    if not docs:
        raise QStreamError(f"corpus {path} holds no documents")
    return docs


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style) trained deterministically on ``texts``; ids
    0..2 are ``SPECIAL_TOKENS``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(tok: Tokenizer, directory: Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in ``directory``."""
    write_text_atomic(directory / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    eos, pad, mask = SPECIAL_TOKENS
    special = {"eos_token": eos, "pad_token": pad, "mask_token": mask}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    write_json_atomic(directory / "tokenizer_config.json", config)
    write_json_atomic(directory / "special_tokens_map.json", special)
