"""``qstream speculate`` as one library call (docs/speculate.md, "Command"): every variant (built
as eval-drift builds them) decodes every prompt with the target in the loop.  ``--capture DIR``
(greedy only) writes the decoded streams' states and the anchors each variant drafted at
(docs/speculate.md, "At the anchors the decoder visited").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import qstream
from qstream.arch.family import load_noting_embed
from qstream.arch.interface import DraftConfig
from qstream.arch.registry import architecture_of, load_config
from qstream.calibration import Calibration, calibrate, calibration_seed
from qstream.capture.layout import capture_record, record_streams, start_output, write_batch
from qstream.capture.run import CorpusDocs, chat_prompts, corpus_docs
from qstream.capture.target import (
    DTYPES,
    LayerTap,
    LoadedTarget,
    check_draft,
    check_finite,
    decoder_parts,
    default_dtype,
    load_target,
)
from qstream.capture.target_format import simulate_target
from qstream.checkpoint.files import sha256_file
from qstream.checkpoint.target import TargetShape, read_target_shape
from qstream.device import resolve_device
from qstream.errors import QStreamError
from qstream.eval.settings import Selection
from qstream.eval.states.layouts import QSTREAM
from qstream.eval.variants import (
    check_variants_derived,
    refuse_quantized_model,
    served_linears,
    settings_variants,
    variant_weights,
)
from qstream.eval.vocabulary import FLOOR
from qstream.progress import Progress
from qstream.publish import check_outside, check_parent, publishing, write_json_atomic
from qstream.serving import DEFAULTS, Variant
from qstream.speculate.decode import (
    Decoded,
    decode_prompts,
    paired_loss,
    summarise,
    target_greedy,
)
from qstream.verification import GREEDY, MODES, SPECULATE_MODES

SCHEMA = "qstream.speculate/2"  # the "schema" field of every results file
PROMPT = "each document up to and including its first newline (a GSM8K question), tokenized "
PROMPT += "by the target's tokenizer without special tokens"
CHAT_PROMPT = "each document's first line (a GSM8K question) as one user turn through the "
CHAT_PROMPT += "target's chat template with the generation prompt, without special tokens added"


@dataclass(frozen=True, kw_only=True)
class SpeculateSettings(Selection):
    """speculate's options; the variants as eval-drift names them."""

    target: str  # Hugging Face target directory: verifies, and lends the draft what it lacks
    model: str  # draft directory, unquantized: the source of the simulated formats
    corpus: str | None = None  # GSM8K JSONL or text; None: the built-in GSM8K test split
    prompts: int = 32  # the corpus's first documents
    new_tokens: int = 128  # emitted per prompt
    rule: str = GREEDY.name  # the verification mode (qstream.verification.SPECULATE_MODES)
    temperature: float = 1.0
    seed: int = 0  # prompt i decodes with seed + i, the same for every variant
    dtype: str | None = None  # the target's weights and compute; None: default_dtype(device)
    device: str = "cpu"  # where the target runs (the draft drafts on the CPU)
    capture: str | None = None  # greedy only: the streams' states and each variant's anchors
    apply_chat_template: bool = False  # prompts as user turns (capture.run.chat_prompts)


def _check(s: SpeculateSettings) -> None:
    if s.rule not in SPECULATE_MODES:
        raise QStreamError(f"--rule {s.rule!r}: choose one of {', '.join(SPECULATE_MODES)}")
    resolve_device(s.device)
    if s.dtype not in DTYPES:
        raise QStreamError(f"--dtype {s.dtype!r}: choose one of {', '.join(DTYPES)}")
    if s.prompts < 1 or s.new_tokens < 2:  # one token is the prefill's: no verification
        raise QStreamError(
            f"--prompts must be >= 1 and --new-tokens >= 2, got {s.prompts} and {s.new_tokens}"
        )


def run_speculate(s: SpeculateSettings, progress: Progress | None = None) -> dict:
    """Check everything, then decode every prompt with each variant; the JSON-ready results."""
    config = load_config(s.model)
    s = replace(s, dtype=s.dtype or default_dtype(s.device))
    _check(s)
    mode = MODES[s.rule]
    shape = read_target_shape(s.target)
    check_draft(config, shape, config.target_layer_ids)
    refuse_quantized_model(s.model)
    arch = architecture_of(config)
    s = replace(s, include_layers=s.include_layers or arch.quantize_include)
    weights, embed = load_noting_embed(arch, s.model, s.target, config)
    check_finite(weights.items(), f"--model {s.model}: draft tensor")
    variants = check_variants_derived(
        settings_variants(s), s.model, weights, s.allow_foreign_variant
    )
    if s.capture is not None:
        check_capture_dir(s, {v.target for v in variants})
    docs = corpus_docs(s.corpus)
    served, prompts = _targets_and_prompts(s, docs, config, [v.target for v in variants])
    results = _description(s, config, shape, docs, embed)
    decoded = {}  # calibrated by decoding against the unquantized target:
    calibration = _calibrate(s, config, weights, served[DEFAULTS["target"]], docs, variants,
                             results, mode)  # fmt: skip
    for v in variants:
        var_weights, changed = variant_weights(v, weights, config, s, s.target)
        linears = served_linears(v, weights, config, s, calibration)
        draft = arch.build(config, var_weights, v, "cpu", linears)
        if progress is not None:  # counts this variant's prompts from none
            progress.start(len(prompts))
            progress.advance(f"speculate: {v.name}", 0)
        target = served[v.target].model  # the target this variant serves
        args = (s.new_tokens, mode, s.temperature, s.seed, progress)
        runs = decoded[v.name] = decode_prompts(target, draft, prompts, *args)
        summary = summarise(runs, config.block_size)
        results["variants"][v.name] = _variant_entry(v, changed, summary)
        results["runs"][v.name] = [
            {"document": i, "prompt_tokens": len(p), "anchors": r.anchors,
             "accepted": r.accepted, "tokens": r.tokens}
            for i, (p, r) in enumerate(zip(prompts, runs))
        ]  # fmt: skip
    if FLOOR in decoded:  # every variant's loss against bf16, over the same prompts
        for name, runs in decoded.items():
            loss = paired_loss(decoded[FLOOR], runs).to_json()
            results["variants"][name]["summary"]["loss_vs_bf16"] = loss
    if s.capture is not None:  # every variant decoded against one target (check_capture_dir)
        write_capture(s, config, shape, docs, served[variants[0].target], prompts, decoded)
        results["capture"] = {"path": s.capture, "streams": len(prompts)}
    return results


def _variant_entry(v: Variant, changed: list[str], summary: dict) -> dict:
    served = v.configuration()  # recorded when not the default (docs/speculate.md)
    return {"kind": v.kind, "source": v.source, **v.checks(), "dtype": v.compute_dtype,
            **({"configuration": served} if served != DEFAULTS else {}),
            "quantized_tensors": changed, "summary": summary}  # fmt: skip


def _calibrate(s: SpeculateSettings, config: DraftConfig, weights, target, docs: CorpusDocs,
               variants: tuple[Variant, ...], results: dict, mode) -> Calibration | None:  # fmt: skip
    """Calibration when a variant needs it: the FP32 reference draft decoding the documents
    after the ``--prompts`` ones, with the calibration seed."""
    if not any(v.calibrated for v in variants):
        return None
    rest = CorpusDocs(docs.name, docs.sha256, docs.texts[s.prompts : 2 * s.prompts])
    if not rest.texts:
        raise QStreamError(
            f"corpus {docs.name}: calibrating scales needs documents after the "
            f"--prompts {s.prompts} decoded ones; it holds {len(docs.texts)}"
        )
    prompts = _prompts(s, target.tokenizer, rest, len(rest.texts), config.vocab_size)
    seed = calibration_seed(s.seed)
    source = {"documents": [s.prompts, s.prompts + len(prompts)], "seed": seed,
              "drawn": "the reference draft decoding the documents after the prompts"}  # fmt: skip

    def feed(draft) -> None:
        decode_prompts(target.model, draft, prompts, s.new_tokens, mode, s.temperature, seed)

    results["calibration"] = source
    return calibrate(config, weights, "cpu", feed, source)


def _targets_and_prompts(
    s: SpeculateSettings, docs: CorpusDocs, config: DraftConfig, formats: list[str]
) -> tuple[dict[str, LoadedTarget], list[list[int]]]:
    """The target as each of ``formats`` serves it (docs/speculate.md, "A quantized target") and
    the prompts, refused when the target would read past its max_position_embeddings."""
    if len(docs.texts) < s.prompts:
        raise QStreamError(f"--prompts {s.prompts}: corpus {docs.name} holds only "
                           f"{len(docs.texts)} document(s)")  # fmt: skip
    loaded = load_target(s.target, DTYPES[s.dtype or default_dtype(s.device)], s.device)
    prompts = _prompts(s, loaded.tokenizer, docs, s.prompts, config.vocab_size)
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    prompt = max(len(p) for p in prompts)
    longest = prompt + s.new_tokens + config.block_size + (1 if s.capture else -1)
    if limit is not None and longest > limit:
        raise QStreamError(
            f"--new-tokens {s.new_tokens}: the longest prompt ({prompt} tokens), the new tokens "
            f"and a draft block ({config.block_size}) need {longest} positions, more than the "
            f"target's max_position_embeddings {limit} ({Path(s.target) / 'config.json'})"
        )
    served = {loaded.format: loaded}
    for fmt in dict.fromkeys(formats):
        if fmt not in served:
            served[fmt] = replace(loaded, model=copy.deepcopy(loaded.model), format=fmt)
            simulate_target(served[fmt].model, s.target, fmt)
    return served, prompts


def _prompts(
    s: SpeculateSettings, tokenizer, docs: CorpusDocs, count: int, vocab_size: int
) -> list[list[int]]:
    heads = [t.partition("\n") for t in docs.texts[:count]]
    if s.apply_chat_template:
        rows = chat_prompts(tokenizer, [head for head, _, _ in heads])
    else:
        texts = [head + sep for head, sep, _ in heads]
        rows = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    for i, ids in enumerate(rows):
        if not ids:
            raise QStreamError(f"corpus {docs.name}: document {i} gives an empty prompt")
        if max(ids) >= vocab_size:
            raise QStreamError(
                f"the target's tokenizer gives id {max(ids)} (document {i}), outside the "
                f"draft's vocab_size {vocab_size}"
            )
    return rows


def _description(
    s: SpeculateSettings, config: DraftConfig, shape: TargetShape, docs: CorpusDocs, embed: dict
) -> dict:
    import transformers

    return {
        "schema": SCHEMA,
        "settings": {
            "prompts": s.prompts,
            "prompt": CHAT_PROMPT if s.apply_chat_template else PROMPT,
            **({"chat_template": True} if s.apply_chat_template else {}),
            "new_tokens": s.new_tokens,
            "rule": s.rule,
            "temperature": s.temperature,
            "seed": s.seed,
            "target_dtype": s.dtype,
            "device": s.device,
            "selection": {"include": list(s.include_layers), "ignore": list(s.ignore_layers)},
        },
        "provenance": {
            "target": shape.identity(),
            "draft": {
                "path": str(s.model),
                "config_sha256": sha256_file(Path(s.model) / "config.json"),
                "architecture": config.to_json().get("architectures", ["?"])[0],
                "block_size": config.block_size,
                **({"embed_tokens": embed} if embed else {}),
            },
            "corpus": {"name": docs.name, "sha256": docs.sha256},
            "qstream_version": qstream.__version__,
            "torch_version": torch.__version__.split("+")[0],
            "transformers_version": transformers.__version__,
        },
        "variants": {},
        "runs": {},
    }


def check_capture_dir(s: SpeculateSettings, targets: set[str]) -> None:
    """Before any decoding: a greedy verifier, one target (``targets``: the variants'), and an
    absent or empty ``--capture`` outside ``--model`` and ``--target``."""
    assert s.capture is not None
    output, mode = Path(s.capture), MODES[s.rule]
    if not mode.greedy_verifier or len(targets) > 1:
        why = "one target= for all variants"
        if not mode.greedy_verifier:
            why = f"--rule {GREEDY.name} (got {mode.name})"
        raise QStreamError(f"--capture needs {why}: only then is one stream every variant's output")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise QStreamError(f"--capture {output}: exists and is not an empty directory")
    check_outside(output, "--capture", {"--model": s.model, "--target": s.target})
    check_parent(output, "--capture", "parent directory")


def write_capture(
    s: SpeculateSettings,
    config: DraftConfig,
    shape: TargetShape,
    docs: CorpusDocs,
    target: LoadedTarget,
    prompts: list[list[int]],
    runs: dict[str, list[Decoded]],
) -> None:
    """The streams, their states, capture.json and one anchors file per variant, published with
    one rename."""
    assert s.capture is not None
    layer_ids, block_size, output = config.target_layer_ids, config.block_size, Path(s.capture)
    sampling = {"rule": s.rule, "new_tokens": s.new_tokens, "prompts": s.prompts}
    if s.apply_chat_template:
        sampling["chat_template"] = True
    record = capture_record(QSTREAM, layer_ids, shape, docs, s.model, s.device, target.format,
                            source="speculate", sampling=sampling, dtype=s.dtype, max_tokens=None)  # fmt: skip
    record["files"] = {}
    first, *others = runs
    for name in others:
        for i, (a, b) in enumerate(zip(runs[first], runs[name])):
            if a.tokens != b.tokens:
                t = next(k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
                raise QStreamError(
                    f"prompt {i}: variants {first} and {name} emitted different tokens at "
                    f"{t} under greedy verification, where both must be the target's own"
                )
    with publishing(output, False, "--capture") as tmp:
        start_output(tmp, record)
        layers, norm = decoder_parts(target.model)
        for i, (prompt, run) in enumerate(zip(prompts, runs[first])):
            head = prompt + run.tokens
            row = head + target_greedy(target.model, head, block_size + 1)
            with torch.no_grad(), LayerTap(layers, norm, layer_ids) as tap:
                target.model.model(input_ids=torch.tensor([row], device=target.device))
            meta = {"document": str(i), "prompt_tokens": str(len(prompt))}
            write_batch(tmp, QSTREAM, [i], [row], tap, [meta])
            record_streams(tmp, record, [QSTREAM.stream_file(i)])
        for name, decoded in runs.items():
            blocks = [[i, p] for i, r in enumerate(decoded) for p in r.anchors]
            record = {"variant": name, "blocks": blocks}
            write_json_atomic(tmp / f"anchors-{name}.json", record, indent=None)
