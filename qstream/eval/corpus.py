"""Token streams for drift evaluation: a corpus file (GSM8K JSONL or plain text) tokenized, and
the anchors (block start positions) sampled across them; and eval-drift's built-in default, a
synthetic tiny draft built once into a cache and the shipped GSM8K test split (1,319 problems,
MIT licence in ``qstream/data/GSM8K_LICENSE``).

"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

import qstream
from qstream.arch.interface import DraftConfig
from qstream.arch.registry import DEFAULT_ARCH
from qstream.errors import QStreamError
from qstream.synth.corpus import read_corpus  # GSM8K JSONL or blank-line separated text
from qstream.synth.draft import RECIPE, synth_checkpoint


@dataclass(frozen=True)
class Corpus:
    """Tokenized streams plus what identifies them in a results file."""

    name: str  # the path given, or "built-in"
    sha256: str  # of the corpus text as read
    streams: tuple[torch.Tensor, ...]  # int64 token ids, one tensor per document
    tokenizer: str = ""  # the tokenizer.json the streams were encoded with

    def identity(self) -> dict:
        return {
            "corpus": self.name,
            "sha256": self.sha256,
            "tokenizer": self.tokenizer,
            "streams": len(self.streams),
            "tokens": sum(int(s.numel()) for s in self.streams),
        }


def tokenize(
    docs: list[str],
    tokenizer_path: str | Path,
    vocab_size: int | None = None,
    name: str = "built-in",
) -> Corpus:
    """Encode every document with the ``tokenizers`` file of the draft (no special tokens).
    ``vocab_size``: the model's; an id outside it is an error naming the tokenizer."""
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # tokenizers raises its own exception types
        raise QStreamError(f"cannot load tokenizer {tokenizer_path}: {exc}") from None
    if vocab_size is not None and tokenizer.get_vocab_size() > vocab_size:
        raise QStreamError(
            f"tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} tokens "
            f"but the model's vocab_size is {vocab_size}"
        )
    encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
    streams = tuple(torch.tensor(e.ids, dtype=torch.int64) for e in encodings)
    digest = hashlib.sha256("\n\n".join(docs).encode()).hexdigest()
    return Corpus(name, digest, streams, str(tokenizer_path))


BUILTIN_PRESET, BUILTIN_SEED = "tiny", 0
# GSM8K test split (github.com/openai/grade-school-math, MIT): question + newline + answer per
# document, as read_corpus reads a GSM8K JSONL file.  The draft never saw it (synth trains on
# generated problems).
BUILTIN_CORPUS = Path(__file__).resolve().parents[1] / "data" / "gsm8k_test.jsonl.gz"
BUILTIN_CORPUS_NAME = "built-in: GSM8K test split"


def builtin_model_dir(say: Callable[[str], None] | None = None) -> Path:
    """The built-in draft's directory, synthesized (deterministically) on first use; ``say``
    tells the user when it is being built."""
    # the preset's own hash and synth's recipe in the name: a changed preset or synth is
    # rebuilt rather than read from a cache built before the change
    preset = json.dumps(DEFAULT_ARCH.presets[BUILTIN_PRESET].to_json(), sort_keys=True).encode()
    tag = hashlib.sha256(preset).hexdigest()[:8]
    # the cache: $QSTREAM_CACHE, else $XDG_CACHE_HOME/qstream, else ~/.cache/qstream
    root = os.environ.get("QSTREAM_CACHE") or ""
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qstream")
    name = f"dspark-{BUILTIN_PRESET}-seed{BUILTIN_SEED}-v{qstream.__version__}-r{RECIPE}-{tag}"
    directory = Path(root) / name
    if not (directory / "config.json").is_file():
        if say is not None:
            say(f"Building the built-in synthetic draft into {directory} (first use) ...")
        synth_checkpoint(BUILTIN_PRESET, directory, seed=BUILTIN_SEED, overwrite=True)
    return directory


def builtin_corpus_docs() -> list[str]:
    """The GSM8K test split shipped with the package, one document per problem."""
    try:
        with gzip.open(BUILTIN_CORPUS, "rt", encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise QStreamError(
            f"cannot read the built-in corpus {BUILTIN_CORPUS}: {exc} "
            "(reinstall qstream, or pass --corpus)"
        ) from exc
    return [f"{row['question']}\n{row['answer']}" for row in rows]


def load_run_corpus(
    model_dir: str | Path,
    corpus: str | None,
    tokenizer: str | None,
    config: DraftConfig,
    target: str | None = None,
) -> Corpus:
    """The corpus file (or the built-in one) tokenized with ``tokenizer`` (default: the draft's
    own tokenizer.json, else ``target``'s)."""
    tok = Path(tokenizer) if tokenizer else Path(model_dir) / "tokenizer.json"
    if not tokenizer and target is not None and not tok.is_file():
        tok = Path(target) / "tokenizer.json"
    if corpus is None:
        return tokenize(builtin_corpus_docs(), tok, config.vocab_size, name=BUILTIN_CORPUS_NAME)
    return tokenize(read_corpus(corpus), tok, config.vocab_size, name=str(corpus))


@dataclass(frozen=True)
class AnchorPlan:
    """Blocks to evaluate: block i drafts on ``streams[stream[i]]`` at anchor ``anchor[i]``
    (context: positions < anchor; first token: ids[anchor])."""

    stream: torch.Tensor  # [N] index into Corpus.streams
    anchor: torch.Tensor  # [N] anchor position p = context length of the block

    def to_json(self) -> dict:
        return {
            "blocks": int(self.anchor.numel()),
            "context_length_mean": float(self.anchor.double().mean()),
            "context_length_min": int(self.anchor.min()),
            "context_length_max": int(self.anchor.max()),
        }


def sample_anchors(
    corpus: Corpus,
    n_blocks: int,
    block_size: int,
    seed: int,
    min_context: int = 1,
    max_context: int | None = None,
) -> AnchorPlan:
    """``n_blocks`` distinct (stream, anchor) pairs drawn uniformly over the valid positions:
    ``min_context <= p`` and ``p + block_size < len`` (the block's tokens exist)."""
    lengths = torch.tensor([int(s.numel()) for s in corpus.streams], dtype=torch.int64)
    hi = lengths - block_size - 1  # largest valid anchor per stream
    if max_context is not None:
        hi = hi.clamp(max=max_context)
    counts = (hi - min_context + 1).clamp(min=0)
    total = int(counts.sum())
    if total < n_blocks:
        raise QStreamError(
            f"corpus {corpus.name} has {total} valid block positions (blocks of {block_size} "
            f"after at least {min_context} context tokens), fewer than the {n_blocks} blocks "
            f"asked for: ask for at most {total} or give a longer corpus"
        )
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(total, generator=gen)[:n_blocks].sort().values  # global position ids
    offsets = torch.cumsum(counts, 0) - counts
    stream = torch.searchsorted(torch.cumsum(counts, 0), pick, right=True)
    anchor = pick - offsets[stream] + min_context
    return AnchorPlan(stream, anchor)


def read_anchor_plan(path: str | Path, corpus: Corpus, block_size: int) -> AnchorPlan:
    """The blocks ``{"blocks": [[stream, anchor], ...]}`` names, sorted, each checked as
    ``sample_anchors`` draws them; a pair named twice is refused."""
    path = Path(path)
    try:
        blocks = json.loads(path.read_text(encoding="utf-8"))["blocks"]
        for i, (s, a) in enumerate(blocks):
            for what, v in (("stream", s), ("anchor", a)):
                if type(v) is not int:  # 5.5 or true names no position
                    raise QStreamError(
                        f"{path}: block {i} {json.dumps([s, a])}: {what} {json.dumps(v)} is "
                        "not an integer"
                    )
        pairs = sorted({(s, a) for s, a in blocks})
        if len(pairs) != len(blocks):
            raise QStreamError(f"{path}: a block is named twice")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QStreamError(f"cannot read anchors {path}: {exc}") from None
    except (KeyError, TypeError, ValueError):
        raise QStreamError(f'{path}: expected {{"blocks": [[stream, anchor], ...]}}') from None
    if not pairs:
        raise QStreamError(f"{path}: names no block")
    for stream, anchor in pairs:
        if not 0 <= stream < len(corpus.streams):
            raise QStreamError(
                f"{path}: block ({stream}, {anchor}): {corpus.name} has "
                f"{len(corpus.streams)} streams"
            )
        length = int(corpus.streams[stream].numel())
        if not 1 <= anchor < length - block_size:
            raise QStreamError(
                f"{path}: block ({stream}, {anchor}): stream {stream} has {length} tokens; an "
                f"anchor needs 1 <= anchor < {length - block_size} (a block of {block_size} "
                "after it)"
            )
    stream_ids, anchors = zip(*pairs)
    return AnchorPlan(torch.tensor(stream_ids), torch.tensor(anchors))
