"""Synthetic checkpoints (``qstream synth``): a complete draft of the preset's architecture with
a real BPE tokenizer, realistic weight statistics and a Markov head calibrated on the corpus,
byte-identical for a given preset, seed and corpus (docs/model.md, "Synthetic checkpoint
layout"; docs/qwen3-dspark.md, "Synthetic checkpoints").
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

import qstream
from qstream.arch.interface import EMBED, LM_HEAD, TARGET_HEAD_DIR, Architecture, DraftConfig
from qstream.arch.registry import ARCHITECTURES, architecture_of
from qstream.checkpoint.files import INDEX_NAME
from qstream.checkpoint.safetensors_io import PlannedTensor, ShardWriter
from qstream.errors import QStreamError
from qstream.progress import Progress
from qstream.publish import SYNTH_RECORD, check_target, publishing, write_json_atomic
from qstream.synth.corpus import builtin_corpus, read_corpus, train_tokenizer, write_tokenizer
from qstream.synth.markov import U_STD, Bigrams, calibrate_markov_scale, markov_tables

# BPE sizes; the presets in TOKENIZER_SIZED take the tokenizer's vocabulary, the others keep
# their own and pad the tokenizer's.
TOKENIZER_VOCAB = {"tiny": 1024, "small": 4096, "k3": 4096, "qwen3-tiny": 1024, "qwen3-8b": 4096,
                   "qwen3-dflash-tiny": 1024, "eagle3-tiny": 1024}  # fmt: skip
TOKENIZER_SIZED = ("tiny", "qwen3-tiny", "qwen3-dflash-tiny", "eagle3-tiny")
RECIPE = 3  # raised whenever synth's bytes change (2: float64; 3: gridded factors, AMD = Intel)
SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size ("5GB")
CHUNK_ELEMENTS = 1 << 24  # rows generated and written at a time: 16 M elements, 64 MB fp32

TAIL_S = 0.35  # lognormal scale-mixture width: weight kurtosis 3*exp(4 s^2) = 4.9
ROW_SPREAD, COL_SPREAD = 0.25, 0.2  # log-std of per-output-row / per-input-column scales
OUTLIER_FRACTION, OUTLIER_GAIN = 0.004, (8.0, 16.0)  # input-channel outliers (>= 2 per tensor)
OUTLIER_MLP = "mlp.down_proj"  # with the architecture's context projection
RESIDUAL_GAIN = 0.5  # o_proj / down_proj: residual updates smaller than the stream


@dataclass(frozen=True)
class SynthSummary:
    output_dir: str
    preset: str
    seed: int
    corpus: str  # the path, or "built-in"
    tensors: int
    parameters: int  # of the draft's tensors (the embedding when the draft carries it)
    bytes: int  # safetensors files of the draft
    markov_scale: float | None  # None: a draft without a Markov head (DFlash)
    predicted_top1: float | None  # calibration estimate on the corpus (teacher-forced)


def _generator(seed: int, name: str) -> torch.Generator:
    # torch's generators take 0 .. 2**64 - 1: a large --seed folds into that range
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)


# Every draw and statistic is float64, rounded to bf16 only when written: float32 ones follow
# the CPU's instruction set and thread count, float64's ~1e-16 differences reach a bf16 rounding
# boundary about once in 1e13 values (docs/model.md, "Synthetic checkpoint layout").
F64 = torch.float64


@dataclass
class _Plan:
    config: DraftConfig
    small: dict[str, torch.Tensor]  # tensors built whole (norms, Markov, confidence)
    head_std: float
    seed: int


def _small_tensors(
    config: DraftConfig, seed: int, w1: torch.Tensor | None, w2: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in architecture_of(config).tensor_shapes(config).items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            # RMSNorm gains: lognormal around 1 with ~1% of channels x2..x4
            n, gen = shape[0], _generator(seed, name)
            gain = (torch.randn(n, generator=gen, dtype=F64) * 0.15).exp()
            big = torch.rand(n, generator=gen, dtype=F64) < 0.01
            gain_big = gain * (2 + 2 * torch.rand(n, generator=gen, dtype=F64))
            out[name] = torch.where(big, gain_big, gain)
    if w1 is None or w2 is None:  # no Markov head (nor a confidence head reading it)
        return out
    out["markov_head.markov_w1.weight"] = w1
    out["markov_head.markov_w2.weight"] = w2
    if config.enable_confidence_head:
        gen = _generator(seed, "confidence_head")
        H, r = config.hidden_size, config.markov_rank
        parts = [torch.randn(H, generator=gen, dtype=F64) / math.sqrt(H)]
        if config.confidence_head_with_markov:  # the Markov embedding's columns
            std = float(w1.std())
            parts.append(torch.randn(r, generator=gen, dtype=F64) / (math.sqrt(r) * std))
        out["confidence_head.proj.weight"] = (2.0 * torch.cat(parts))[None]  # [1, H (+ r)]
        out["confidence_head.proj.bias"] = torch.zeros(1, dtype=F64)
    return out


def _rows_of(name: str, shape: tuple[int, ...], plan: _Plan) -> Iterator[torch.Tensor]:
    """The tensor's rows in chunks of about CHUNK_ELEMENTS, float64 (views of two reused buffers:
    no page-fault churn)."""
    if name in plan.small:
        yield plan.small[name]
        return
    n_out, n_in = shape
    if name == EMBED:
        std = 1.0  # unit-RMS rows, like the stream
    elif name == LM_HEAD:
        std = plan.head_std
    else:
        gain = RESIDUAL_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        std = gain / math.sqrt(n_in)
    gen = _generator(plan.seed, name)
    col = (torch.randn(n_in, generator=gen, dtype=F64) * COL_SPREAD).exp()
    outliers = (architecture_of(plan.config).context_proj, OUTLIER_MLP)
    if any(name.startswith(m) or f".{m}." in name for m in outliers):
        k = max(2, round(OUTLIER_FRACTION * n_in))
        idx = torch.randperm(n_in, generator=gen)[:k]
        lo, hi = OUTLIER_GAIN
        col[idx] *= lo + (hi - lo) * torch.rand(k, generator=gen, dtype=F64)
    col = col / col.pow(2).mean().sqrt()  # keep the overall variance at std^2
    step = max(1, CHUNK_ELEMENTS // n_in)
    z_buffer = torch.empty(min(step, n_out), n_in, dtype=F64)
    g_buffer = torch.empty(min(step, n_out), n_in, dtype=F64)
    for r0 in range(0, n_out, step):
        count = min(step, n_out - r0)
        row = (torch.randn(count, 1, generator=gen, dtype=F64) * ROW_SPREAD).exp()
        # a unit-variance Gaussian scale mixture z * exp(s g - s^2): heavy-tailed
        z, g = z_buffer[:count], g_buffer[:count]
        torch.randn(z.shape, generator=gen, out=z)
        torch.randn(g.shape, generator=gen, out=g)
        z.mul_(g.mul_(TAIL_S).sub_(TAIL_S * TAIL_S).exp_())
        yield z.mul_(row * std).mul_(col)


def _write_tensors(
    directory: Path,
    shapes: dict[str, tuple[int, ...]],
    plan: _Plan,
    progress: Progress | None,
    force_index: bool,
) -> int:
    """Every tensor streamed into bf16 safetensors shards; returns the bytes written."""
    sizes = [2 * math.prod(s) for s in shapes.values()]
    shard, used, shard_of = 0, 0, []  # in order, a new shard when the cap would be passed
    for size in sizes:
        if used and used + size > SHARD_BYTES:
            shard, used = shard + 1, 0
        shard_of.append(shard)
        used += size
    n = shard_of[-1] + 1
    files = (
        ["model.safetensors"]
        if n == 1 and not force_index
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    names = list(shapes)
    total = sum(sizes)
    if progress is not None:
        progress.start(total)
    for i, file in enumerate(files):
        mine = [k for k, s in zip(names, shard_of) if s == i]
        writer = ShardWriter(
            directory / file, [PlannedTensor(k, "BF16", shapes[k]) for k in mine], {"format": "pt"}
        )
        try:
            for name in mine:
                row = 0
                for chunk in _rows_of(name, shapes[name], plan):
                    writer.write(name, chunk.to(torch.bfloat16), row)
                    row += chunk.shape[0] if chunk.dim() > 1 else 0
                    if progress is not None:
                        progress.advance("", 2 * chunk.numel())
        except BaseException:
            writer.abort()
            raise
        writer.close()
    if len(files) > 1 or force_index:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: files[s] for k, s in zip(names, shard_of)},
        }
        write_json_atomic(directory / INDEX_NAME, index)
    return total


def _write_target_head(head: Path, plan: _Plan) -> None:
    """The stand-in target beside the draft: embed_tokens and lm_head (the draft's own bytes)."""
    config = plan.config
    row = (config.vocab_size, config.hidden_size)
    shapes: dict[str, tuple[int, ...]] = {EMBED: row, LM_HEAD: row}  # embedding first, as a target
    head.mkdir()
    head_config = {
        "architectures": ["SyntheticTargetHead"],
        "model_type": "qstream_target",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "note": "stand-in target for a qstream synth draft: lm_head and embed_tokens",
    }
    write_json_atomic(head / "config.json", head_config)
    _write_tensors(head, shapes, plan, None, force_index=True)


def preset_architecture(preset: str) -> Architecture:
    for arch in ARCHITECTURES:
        if preset in arch.presets:
            return arch
    names = ", ".join(p for arch in ARCHITECTURES for p in arch.presets)
    raise QStreamError(f"unknown preset {preset!r}; choose one of {names}")


def _tokenizer_config(preset: str, tok: Tokenizer) -> DraftConfig:
    base = preset_architecture(preset).presets[preset]
    vocab = tok.get_vocab_size() if preset in TOKENIZER_SIZED else base.vocab_size
    mask = tok.token_to_id("<|mask|>")
    if mask is None:
        raise QStreamError("the synthetic tokenizer has no <|mask|> token")
    eos = tok.token_to_id("<|endoftext|>")
    facts = dict(vocab_size=vocab, mask_token_id=mask, bos_token_id=None, eos_token_id=eos,
                 draft_vocab_size=vocab)  # fmt: skip
    names = {f.name for f in fields(base)}  # an EAGLE-3 draft has no mask or bos token
    return replace(base, **{k: v for k, v in facts.items() if k in names})


def draft_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The architecture's tensors, less embed_tokens where its drafts leave it to the target."""
    arch = architecture_of(config)
    shapes = arch.tensor_shapes(config)
    if not arch.ships_embed_tokens:
        shapes.pop(EMBED)
    return shapes


def _markov_head(tok: Tokenizer, texts: list[str], config: DraftConfig, seed: int):
    """``(markov_w1, markov_w2, alpha, top1)``: the corpus's bigram factors scaled by ``alpha``
    to the calibrated top-1; all None for a draft without a Markov head."""
    if getattr(config, "markov_rank", 0) == 0:  # EAGLE-3 has no Markov head
        return None, None, None, None
    streams = [e.ids for e in tok.encode_batch(texts)]
    bigrams = Bigrams.count(streams, tok.get_vocab_size())
    w1, w2 = markov_tables(bigrams, config.vocab_size, config.markov_rank, seed)
    alpha, top1 = calibrate_markov_scale(w1, w2, streams, seed, tok.get_vocab_size())
    return w1 * math.sqrt(alpha), w2 * math.sqrt(alpha), alpha, top1


def synth_checkpoint(
    preset: str,
    output_dir: str | Path,
    seed: int = 0,
    corpus: str | Path | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> SynthSummary:
    """Write a draft of ``preset`` to ``output_dir``, complete or not at all; ``corpus`` (default:
    the built-in one) trains the tokenizer and the Markov statistics."""
    arch = preset_architecture(preset)
    output = Path(output_dir).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    check_target(output, overwrite, "--output_dir")
    texts = read_corpus(corpus) if corpus is not None else builtin_corpus(seed=seed)
    tok = train_tokenizer(texts, TOKENIZER_VOCAB[preset])
    config = _tokenizer_config(preset, tok)
    w1, w2, alpha, top1 = _markov_head(tok, texts, config, seed)
    small = _small_tensors(config, seed, w1, w2)
    # lm_head entry std giving U_STD per-vocab spread: var(U_v) = sum_h g_h^2 w_vh^2 for
    # hf_h = g_h * (unit-RMS state)
    final_gain = small[arch.final_norm]
    head_std = U_STD / math.sqrt(config.hidden_size * float(final_gain.pow(2).mean()))
    plan = _Plan(config, small, head_std, seed)
    return publish_draft(output, overwrite, preset, corpus, plan, alpha, top1,
                         lambda tmp: write_tokenizer(tok, tmp), progress)  # fmt: skip


def publish_draft(
    output: Path, overwrite: bool, preset: str, corpus: str | Path | None, plan: _Plan,
    alpha: float | None, top1: float | None, write_tok, progress: Progress | None, **target: object,
) -> SynthSummary:  # fmt: skip
    """config.json, the tokenizer (``write_tok(dir)``), the tensors and the record, published
    with one rename; without ``target`` (a record entry), the stand-in target head too."""
    shapes = draft_shapes(plan.config)
    with publishing(output, overwrite) as tmp:
        write_json_atomic(tmp / "config.json", plan.config.to_json())
        write_tok(tmp)
        size = _write_tensors(tmp, shapes, plan, progress, force_index=False)
        if not target:
            _write_target_head(tmp / TARGET_HEAD_DIR, plan)
        parameters = sum(math.prod(s) for s in shapes.values())
        corpus_name = str(corpus) if corpus else "built-in"
        summary = SynthSummary(str(output), preset, plan.seed, corpus_name, len(shapes),
                               parameters, size, alpha, top1)  # fmt: skip
        # the summary without its output path (relocatable)
        record = {k: v for k, v in asdict(summary).items() if k != "output_dir"}
        data = {"qstream_version": qstream.__version__, "summary": record, **target}
        write_json_atomic(tmp / SYNTH_RECORD, data)
    return summary
