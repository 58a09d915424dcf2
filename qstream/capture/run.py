"""``qstream capture`` as a library call (docs/capture.md): the target run over the streams a
batch at a time (grouped by length, right-padded), each stream's file written as its batch
completes.  The streams are the corpus, or with ``--generate`` each document's first tokens
continued by the target's own samples (eval-drift's ``qstream.arch.markov`` sampling).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from qstream.arch.interface import DraftConfig
from qstream.arch.markov import sample, sampling_probs
from qstream.arch.registry import load_config
from qstream.capture.layout import (
    capture_record,
    check_output,
    present_files,
    record_streams,
    start_output,
    write_batch,
)
from qstream.capture.target import (
    DTYPES,
    LayerTap,
    LoadedTarget,
    cache_keyword,
    check_draft,
    decoder_parts,
    default_dtype,
    layer_output_ids,
    load_target,
)
from qstream.capture.target_format import check_target_format, simulate_target
from qstream.checkpoint.target import read_target_shape
from qstream.errors import QStreamError
from qstream.eval.corpus import BUILTIN_CORPUS_NAME, builtin_corpus_docs
from qstream.eval.states.captured import LAYER_OUTPUT
from qstream.eval.states.layouts import EXPORTS, LAYOUTS, QSTREAM
from qstream.progress import Progress
from qstream.publish import check_outside, remove_stale_partials_in, stderr_notice
from qstream.serving import DEFAULTS
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


def chat_prompts(tokenizer: Any, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn through the tokenizer's chat template with the generation
    prompt, as token ids (no special tokens added: the template writes its own), as
    evals/train_smollm2_pair.py's draft was trained (docs/speculate.md, "Chat template")."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise QStreamError(
            f"--apply-chat-template: the target's tokenizer ({tokenizer.name_or_path}) has no "
            "chat template"
        )
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]  # fmt: skip
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def stream_seed(seed: int, index: int) -> int:
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
    """``prompt`` continued by the target's own samples (with its KV cache), an Exp(1) race from
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


@dataclass(frozen=True)
class CaptureSettings:
    target: str  # Hugging Face target directory
    model: str  # draft directory: target_layer_ids, widths, block size
    output: str  # directory of per-stream files plus capture.json
    corpus: str | None = None  # GSM8K JSONL or text; None: the built-in GSM8K test split
    layers: tuple[int, ...] | None = None  # overrides the draft's target_layer_ids
    layer_convention: str = LAYER_OUTPUT.name  # the convention --layers is written in
    dtype: str | None = None  # the target's weights, compute and the states; None: default_dtype
    device: str = "cpu"
    device_map: str | None = None  # "auto": accelerate spreads the target over devices
    max_tokens: int = 512  # corpus tokens per stream (the prompt, with --generate)
    streams: int | None = None  # how many streams (default: every long enough document)
    batch_size: int = 8  # streams per forward
    sampling: Sampling | None = None  # --generate: continue each prompt with target samples
    export: str = QSTREAM.name  # or "vllm": vLLM's / speculators' layout
    trust_remote_code: bool = False
    target_format: str = DEFAULTS["target"]  # or a weight format its decoder linears are served in
    apply_chat_template: bool = False  # --generate's prompts as user turns (chat_prompts)


@dataclass
class CaptureSummary:
    output: str
    streams: int  # files in the directory now
    written: int  # by this run
    skipped: int  # already there (resumed)
    tokens: int  # in the streams this run wrote
    record: dict[str, Any] = field(default_factory=dict)


def _prompts(s: CaptureSettings, target: LoadedTarget, docs: CorpusDocs, config: DraftConfig):
    if s.apply_chat_template:
        first_lines = [t.partition("\n")[0] for t in docs.texts]  # GSM8K questions
        encoded = chat_prompts(target.tokenizer, first_lines)
        for i, ids in enumerate(encoded):
            if len(ids) > s.max_tokens:  # cut, it would lose the generation prompt
                raise QStreamError(f"corpus {docs.name}: document {i}'s templated prompt has "
                                   f"{len(ids)} tokens, more than --max-tokens {s.max_tokens}")  # fmt: skip
    else:
        encoded = encode(target.tokenizer, docs.texts, s.max_tokens)
    min_tokens = 1 if s.sampling is not None else config.block_size + 2
    # numbered in corpus order: a resumed run picks the same
    chosen = [(i, ids) for i, ids in enumerate(encoded) if len(ids) >= min_tokens]
    chosen = chosen if s.streams is None else chosen[: s.streams]
    for _, ids in chosen:
        if ids and max(ids) >= config.vocab_size:
            raise QStreamError(
                f"the target's tokenizer gives id {max(ids)}, outside the draft's "
                f"vocab_size {config.vocab_size}"
            )
    if not chosen:
        raise QStreamError(f"corpus {docs.name}: no document has {min_tokens} tokens or more")
    return chosen


def run_capture(s: CaptureSettings, progress: Progress | None = None) -> CaptureSummary:
    s = replace(s, dtype=s.dtype or default_dtype(s.device, s.device_map))
    if s.dtype not in DTYPES:
        raise QStreamError(f"--dtype {s.dtype!r}: choose one of {', '.join(DTYPES)}")
    if s.export not in EXPORTS:
        raise QStreamError(f"--export {s.export!r}: choose {' or '.join(EXPORTS)}")
    layout = LAYOUTS[s.export]
    if s.apply_chat_template and s.sampling is None:
        raise QStreamError("--apply-chat-template needs --generate: a template makes a prompt, "
                           "which only --generate continues")  # fmt: skip
    check_target_format(s.target_format, "--target-format")
    config = load_config(s.model, captured=True)
    shape = read_target_shape(s.target)
    ids = config.target_layer_ids
    if s.layers is not None:
        ids = layer_output_ids(list(s.layers), s.layer_convention, shape.num_hidden_layers)
    check_draft(config, shape, ids)
    docs = corpus_docs(s.corpus)
    sampling = None if s.sampling is None else asdict(s.sampling)
    if sampling is not None and s.apply_chat_template:  # absent otherwise: records as before
        sampling["chat_template"] = True
    source = "corpus" if sampling is None else "generate"
    record = capture_record(layout, ids, shape, docs, s.model, s.device_map or s.device,
                            s.target_format, source=source, sampling=sampling, dtype=s.dtype,
                            max_tokens=s.max_tokens)  # fmt: skip
    output = Path(s.output)
    check_outside(output, "--output", {"--target": s.target, "--model": s.model})
    old = check_output(output, record)
    remove_stale_partials_in(output, stderr_notice)  # what killed runs left
    target = load_target(s.target, DTYPES[s.dtype], s.device, s.device_map, s.trust_remote_code)
    if s.target_format != DEFAULTS["target"]:
        simulate_target(target.model, s.target, s.target_format)
    chosen = _prompts(s, target, docs, config)
    if old is None:
        start_output(output, record)
    expected = {layout.stream_file(i): _metadata(chosen[i]) for i in range(len(chosen))}
    record["files"] = present_files(output, old, layout, expected)
    record_streams(output, record, [])
    todo = [i for i in range(len(chosen)) if layout.stream_file(i) not in record["files"]]
    if progress is not None:
        progress.start(len(todo))
    tokens = _capture(s, target, ids, chosen, todo, output, record, progress)
    present = record["streams"]
    return CaptureSummary(str(output), present, len(todo), len(chosen) - len(todo), tokens, record)


def _capture(
    s: CaptureSettings,
    target: LoadedTarget,
    ids: tuple[int, ...],
    chosen: list[tuple[int, list[int]]],
    todo: list[int],
    output: Path,
    record: dict,
    progress: Progress | None,
) -> int:
    """Generate (if asked) and capture the streams ``todo``, a batch at a time in order of
    length (a batch pads little)."""
    eos = target.tokenizer.eos_token_id
    layers, norm = decoder_parts(target.model)
    tokens = 0
    order = sorted(range(len(todo)), key=lambda k: (len(chosen[todo[k]][1]), k))
    for b in range(0, len(order), s.batch_size):
        streams = [todo[k] for k in order[b : b + s.batch_size]]
        prompts = [chosen[i][1] for i in streams]
        if s.sampling is not None:
            rows = [
                generate(target.model, target.device, p, s.sampling, i, eos)
                for p, i in zip(prompts, streams)
            ]
        else:
            rows = prompts
        # one teacher-forced forward of the base model over right-padded rows (no lm_head)
        input_ids = pad_sequence([torch.tensor(r, dtype=torch.int64) for r in rows], True)
        mask = pad_sequence([torch.ones(len(r), dtype=torch.int64) for r in rows], True)
        with torch.no_grad(), LayerTap(layers, norm, ids) as tap:
            target.model.model(
                input_ids=input_ids.to(target.device),
                attention_mask=mask.to(target.device),
                use_cache=False,
            )
        meta = [_metadata(chosen[i]) for i in streams]
        layout = LAYOUTS[s.export]
        write_batch(output, layout, streams, rows, tap, meta)
        record_streams(output, record, [layout.stream_file(i) for i in streams])
        tokens += sum(len(r) for r in rows)
        if progress is not None:
            progress.advance("", len(streams))
    return tokens


def _metadata(stream: tuple[int, list[int]]) -> dict[str, str]:
    return {"document": str(stream[0]), "prompt_tokens": str(len(stream[1]))}
