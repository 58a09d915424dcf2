"""The token streams a capture runs the target over (docs/capture.md): the corpus as written
(teacher-forced), or ``--generate``: each document's first tokens as a prompt, continued by
the target's own samples at the evaluation's temperature / top-p / top-k, drawn with the same
functions eval-drift samples with (``qstream.arch.markov``), seeded per stream.

>>> docs = corpus_docs("gsm8k/test.jsonl")          # or None: the built-in GSM8K test split
>>> prompts = select_streams(encode(tokenizer, docs.texts, 512), min_tokens=9, count=64)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from qstream.arch.markov import sample, sampling_probs
from qstream.capture.target import cache_keyword
from qstream.eval.corpus import BUILTIN_CORPUS_NAME, builtin_corpus_docs
from qstream.synth.corpus import read_corpus


@dataclass(frozen=True)
class CorpusDocs:
    name: str  # the path given, or eval-drift's built-in name
    sha256: str  # of the text as read, as eval-drift records it (qstream.eval.corpus.tokenize)
    texts: list[str]


@dataclass(frozen=True)
class Sampling:
    """How ``--generate`` continues a prompt: the evaluation's sampling settings."""

    new_tokens: int  # tokens sampled after the prompt (fewer when the target samples EOS)
    temperature: float
    top_p: float
    top_k: int | None
    seed: int  # stream i draws from a generator seeded with stream_seed(seed, i)


def corpus_docs(corpus: str | None) -> CorpusDocs:
    """The corpus's documents as eval-drift reads them (default: the built-in GSM8K test split)."""
    texts = builtin_corpus_docs() if corpus is None else read_corpus(corpus)
    digest = hashlib.sha256("\n\n".join(texts).encode()).hexdigest()
    return CorpusDocs(BUILTIN_CORPUS_NAME if corpus is None else str(corpus), digest, texts)


def encode(tokenizer: Any, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of each document with no special tokens added (as eval-drift tokenizes),
    cut to ``max_tokens``."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [list(row[:max_tokens]) for row in ids]


def select_streams(
    encoded: list[list[int]], min_tokens: int, count: int | None
) -> list[tuple[int, list[int]]]:
    """``(document index, ids)`` of the first ``count`` documents with at least ``min_tokens``
    tokens, numbered in corpus order (the same on every run, so a resumed run picks the same)."""
    chosen = [(i, ids) for i, ids in enumerate(encoded) if len(ids) >= min_tokens]
    return chosen if count is None else chosen[:count]


def stream_seed(seed: int, index: int) -> int:
    """Each stream's own seed, so that a stream's sample does not depend on which others ran."""
    return (seed * 1_000_003 + index) % 2**64  # torch's generators take 0 .. 2**64 - 1


@torch.no_grad()
def generate(
    model: Any,
    device: torch.device,
    prompt: list[int],
    sampling: Sampling,
    index: int,
    eos: int | None,
) -> list[int]:
    """``prompt`` continued by the target's own samples (one stream, with the model's KV cache):
    ``sampling_probs`` of the last position's logits, then ``sample`` with an Exp(1) race from
    the stream's generator, stopping after ``new_tokens`` or at ``eos`` (kept)."""
    gen = torch.Generator().manual_seed(stream_seed(sampling.seed, index))
    ids, cache = list(prompt), cache_keyword(model)
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    for _ in range(sampling.new_tokens):
        logits = out.logits[0, -1].float().cpu()
        probs = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        race = torch.empty(probs.shape).exponential_(generator=gen)
        token = int(sample(probs, race))
        ids.append(token)
        if token == eos:
            break
        step, kv = torch.tensor([[token]], device=device), {cache: getattr(out, cache)}
        out = model(input_ids=step, use_cache=True, logits_to_keep=1, **kv)
    return ids


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Positions of ``lengths`` grouped ``batch_size`` at a time in order of length, so that a
    batch pads little."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
