"""Rebuild the trained draft-target pair shipped in examples/gsm8k-pair/ (docs/calibration.md).

A small transformers Qwen3 target is trained on GSM8K train, then a Qwen3-style DSpark draft
(block 7, 5 aux layers, Markov head, confidence head) is trained on the target's own hidden
states with speculators' model definitions and speculators' own loss (cross-entropy on the
target's argmax plus total variation against the target's distribution, which the draft reads
through the target's final norm and lm_head). speculators' trainer needs CUDA and its offline
data pipeline, so the loop here is a plain one over ``DSparkDraftModel.forward``.

Run it in the speculators environment (docs/testing.md: speculators pins an older transformers
than qstream's own), from the repository root, with two threads; everything is seeded:

    PYTHONPATH=$PWD .venv-spec/bin/python evals/train_pair.py \
        --gsm8k ../shared/data/gsm8k --output examples/gsm8k-pair

It writes OUTPUT/target/ (config, bf16 weights, tokenizer), OUTPUT/draft/ (speculators'
``save_pretrained`` layout) and OUTPUT/train.json (settings, losses, the target's GSM8K test
perplexity, the draft's teacher-forced top-1 agreement with the target, timings, sha256s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from qstream.synth.corpus import read_corpus, train_tokenizer, write_tokenizer

EOS, PAD, MASK = 0, 1, 2  # SPECIAL_TOKENS' ids
VOCAB = 2048
TARGET = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=48)  # fmt: skip
DRAFT_LAYERS = 2
AUX_IDS = [1, 2, 3, 4, 5]  # hidden-states indices: the outputs of target layers 0..4
BLOCK = 7  # drafted tokens (speculators' block_size with sample_from_anchor)
MARKOV_RANK = 64
LOSS = '{"ce": 1.0, "tv": 1.0}'
PACK, ANCHORS = 1024, 128  # tokens per packed sequence, blocks drawn from it per step
THREADS = 2


def fresh_run(out: Path, threads: int) -> bool:
    """Start a seeded training run: ``threads`` intra-op threads, deterministic algorithms, and
    ``out`` absent or empty (else one Error line and False)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    if out.exists() and any(out.iterdir()):
        print(f"Error: {out} exists and is not empty", file=sys.stderr)
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gsm8k", type=Path, required=True, help="directory of train.jsonl, test.jsonl"
    )
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--target-epochs", type=int, default=2)
    ap.add_argument("--draft-epochs", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="first N train docs (smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = args.output
    if not fresh_run(out, THREADS):
        return 2
    (out / "target").mkdir(parents=True, exist_ok=True)
    record: dict = {"seed": args.seed, "threads": THREADS, "torch": torch.__version__}
    clock = time.perf_counter()

    train_docs = read_corpus(args.gsm8k / "train.jsonl")[: args.limit]
    test_docs = read_corpus(args.gsm8k / "test.jsonl")
    tok = train_tokenizer(train_docs, VOCAB)
    write_tokenizer(tok, out / "target")
    train = [encode(tok, d) for d in train_docs]
    test = [encode(tok, d) for d in test_docs]
    record["tokens"] = {
        "train": sum(len(d) for d, _ in train),
        "test": sum(len(d) for d, _ in test),
    }

    torch.manual_seed(args.seed)  # the target's initial weights
    target = build_target()
    record["target_loss"] = train_target(
        target, [d for d, _ in train], args.target_epochs, args.seed
    )
    round_to_bf16(target)
    record["target_test_perplexity"] = perplexity(target, [d for d, _ in test])
    record["target_seconds"] = round(time.perf_counter() - clock, 1)
    save_target(target, out / "target")
    print(
        f"target: {record['target_seconds']} s, test perplexity {record['target_test_perplexity']:.3f}",
        flush=True,
    )

    draft = build_draft(out / "target", args.seed)
    clock_draft = time.perf_counter()
    record["draft_loss"] = train_draft(draft, target, train, args.draft_epochs, args.seed)
    record["draft_seconds"] = round(time.perf_counter() - clock_draft, 1)
    record["draft_teacher_forced_top1"] = teacher_forced_top1(draft, target, test[:200], args.seed)
    draft.config.speculators_config.verifier.name_or_path = None
    round_to_bf16(draft)
    draft.to(torch.bfloat16).save_pretrained(out / "draft")
    drop_remote_code(out / "draft")
    record["seconds"] = round(time.perf_counter() - clock, 1)
    record["sha256"] = {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*.safetensors"))
    }
    (out / "train.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("target_test_perplexity",
          "draft_teacher_forced_top1", "seconds")}))  # fmt: skip
    return 0


def encode(tok, doc: str) -> tuple[list[int], int]:
    """A document as the decoder meets it, and where its answer starts: the question up to
    and including its newline tokenized alone (the prompt ``qstream speculate`` gives the
    target), then the answer, then EOS."""
    question, _, answer = doc.partition("\n")
    prompt = tok.encode(question + "\n").ids
    return prompt + tok.encode(answer).ids + [EOS], len(prompt)


def drop_remote_code(directory: Path) -> None:
    """``save_pretrained`` copies speculators' config class beside the config (config.py, named
    by ``auto_map``); the project does not ship others' code, and speculators, vLLM and qstream
    read the config through their own registries."""
    (directory / "config.py").unlink(missing_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config.pop("auto_map", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --- the target -----------------------------------------------------------------------------


def build_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, **TARGET,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def batches(docs: list[list[int]], size: int, gen: torch.Generator | None):
    """Batches of ``size`` documents, right-padded: (ids, attention mask, labels). Shuffled with
    ``gen``: documents of similar length share a batch (sorted within runs of 16 batches, so
    little is padding) and the batches come in random order; without ``gen``, by length."""
    if gen is None:
        order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    else:
        perm = torch.randperm(len(docs), generator=gen).tolist()
        run = 16 * size
        order = [i for k in range(0, len(perm), run)
                 for i in sorted(perm[k : k + run], key=lambda i: len(docs[i]))]  # fmt: skip
    chunks = [order[k : k + size] for k in range(0, len(order), size)]
    if gen is not None:
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=gen).tolist()]
    for chunk in chunks:
        ids, mask = pad_right([docs[i] for i in chunk])
        yield ids, mask, ids.masked_fill(mask == 0, -100)


def pad_right(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows right-padded with PAD to the longest: (ids, attention mask)."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return ids, mask


def update(opt, params, loss: torch.Tensor, lr: float) -> None:
    """One optimiser step at ``lr``, gradients clipped to norm 1."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def schedule(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_target(model, docs: list[list[int]], epochs: int, seed: int) -> list[float]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    size = 32
    total = epochs * math.ceil(len(docs) / size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses, step = [], 0
    model.train()
    for epoch in range(epochs):
        for ids, mask, labels in batches(docs, size, gen):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            update(opt, model.parameters(), loss, 3e-3 * schedule(step, total, 50))
            losses.append(float(loss.detach()))
            step += 1
            if step % 20 == 0:
                print(f"target epoch {epoch} step {step}/{total} loss {loss:.3f}", flush=True)
    model.eval()
    return window_means(losses, 50)


def window_means(losses: list[float], window: int) -> list[float]:
    """The mean loss of each run of ``window`` steps (the last one may be shorter), as
    train.json records the training curves."""
    return [round(sum(losses[i : i + window]) / len(losses[i : i + window]), 4)
            for i in range(0, len(losses), window)]  # fmt: skip


def as_float(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The target's captured states with its bf16 tensors upcast: the draft trains in fp32."""
    return {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in states.items()}


def round_to_bf16(model) -> None:
    """The shipped weights are bf16; everything after this point sees exactly those."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def perplexity(model, docs: list[list[int]]) -> float:
    """exp of the mean next-token cross-entropy over every token of ``docs`` (EOS included)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids, mask, labels in batches(docs, 32, None):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            target = labels[:, 1:]
            nll += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100, reduction="sum"))  # fmt: skip
            count += int((target != -100).sum())
    return math.exp(nll / count)


def save_target(model, directory: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(directory)
    model.float()


# --- the draft ------------------------------------------------------------------------------


def build_draft(
    target_dir: Path, seed: int, layer: dict | None = None, vocab: int = VOCAB,
    aux_ids: list[int] = AUX_IDS, mask: int = MASK, architecture: str = "Qwen3ForCausalLM",
):  # fmt: skip
    """The draft, its verifier-owned weights loaded from ``target_dir``. ``layer``: the Qwen3
    layer shape (default this pair's target's); ``aux_ids``: speculators' hidden-states indices."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    shape = layer or dict(max_position_embeddings=1024, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          **{**TARGET, "num_hidden_layers": DRAFT_LAYERS})  # fmt: skip
    layer = Qwen3Config(vocab_size=vocab, **shape)
    layer._attn_implementation = "eager"  # flex attention compiles, and only for CUDA
    spec = SpeculatorsConfig(
        algorithm="dspark",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=str(target_dir), architectures=[architecture]),
    )
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=vocab, block_size=BLOCK,
        aux_hidden_state_layer_ids=aux_ids, mask_token_id=mask, sample_from_anchor=True,
        markov_rank=MARKOV_RANK, enable_confidence_head=True, confidence_head_with_markov=True,
        speculators_config=spec,
    )  # fmt: skip
    torch.manual_seed(seed + 1)
    model = DSparkDraftModel(config)
    model.load_verifier_weights()  # embed_tokens, lm_head, the final norm: the target's, frozen
    return model


def packs(docs: list[tuple[list[int], int]], length: int, gen: torch.Generator):
    """Shuffled documents packed into sequences of at most ``length`` tokens."""
    order = torch.randperm(len(docs), generator=gen).tolist()
    pack: list[int] = []
    for i in order:
        if pack and sum(len(docs[j][0]) for j in pack) + len(docs[i][0]) > length:
            yield [docs[j] for j in pack]
            pack = []
        pack.append(i)
    if pack:
        yield [docs[j] for j in pack]


def target_states(target, docs: list[tuple[list[int], int]], aux_ids: list[int] = AUX_IDS):
    """One packed sequence's draft inputs: its documents run through the target as one
    right-padded batch (each document attends only to itself); the loss mask covers the
    answers, where the decoder drafts. ``aux_ids``: hidden-states indices."""
    ids, mask = pad_right([row for row, _ in docs])
    width = ids.shape[1]
    captured: dict = {}
    hook = target.model.norm.register_forward_hook(lambda m, a, o: captured.update(x=a[0]))
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hook.remove()
    aux = torch.cat([hs.hidden_states[i] for i in aux_ids], dim=-1)
    keep = mask.bool()
    position = torch.arange(width).expand(len(docs), width)
    starts = torch.tensor([start for _, start in docs])[:, None]
    document = torch.arange(len(docs))[:, None].expand(len(docs), width)
    return {
        "hidden_states": aux[keep][None].to(torch.bfloat16),
        "input_ids": ids[keep][None],
        "verifier_last_hidden_states": captured["x"][keep][None].to(torch.bfloat16),
        "document_ids": document[keep][None],
        "position_ids": position[keep][None],
        "loss_mask": (position >= starts)[keep][None].long(),
    }


def train_draft(
    draft,
    target,
    docs: list[tuple[list[int], int]],
    epochs: int,
    seed: int,
    aux_ids: list[int] = AUX_IDS,
    anchors: int = ANCHORS,
    pack: int = PACK,
    timings: dict | None = None,
    window: int = 200,
) -> list[float]:
    """Capture the target's states of ``docs`` once (packed sequences of ``pack`` tokens), then
    train for ``epochs`` over them, ``anchors`` blocks per step; ``timings`` gets both stages'
    seconds. Returns the mean loss of each run of ``window`` steps."""  # fmt: skip
    from speculators.models.dspark import DSparkDraftModel

    loss_kwargs, _ = DSparkDraftModel.get_trainer_kwargs(loss_fn=LOSS, loss_implementation="eager",
                                                         max_anchors=anchors)  # fmt: skip
    torch.manual_seed(seed + 2)
    gen = torch.Generator().manual_seed(seed + 2)
    clock = time.perf_counter()
    cache = [target_states(target, rows, aux_ids) for rows in packs(docs, pack, gen)]
    print(f"draft: {len(cache)} packed sequences of target states", flush=True)
    if timings is not None:
        timings["capture"] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    total, losses, step = epochs * len(cache), [], 0
    draft.train()
    for epoch in range(epochs):
        for i in torch.randperm(len(cache), generator=gen).tolist():
            _, loss, _ = draft(**as_float(cache[i]), **loss_kwargs)
            update(opt, params, loss, 2e-3 * schedule(step, total, 100))
            losses.append(float(loss.detach()))
            step += 1
            if step % window == 0:
                print(f"draft epoch {epoch} step {step}/{total} loss {loss:.4f}", flush=True)
    draft.eval()
    if timings is not None:
        timings["train"] = round(time.perf_counter() - clock, 1)
    return window_means(losses, window)


def teacher_forced_top1(draft, target, docs: list[tuple[list[int], int]], seed: int) -> dict:
    """On GSM8K test documents: the share of drafted positions k whose top-1 (with the Markov
    bias of the true previous token) equals the target's argmax, per k and overall."""
    torch.manual_seed(seed + 3)
    from speculators.models.dspark import DSparkDraftModel

    loss_kwargs, _ = DSparkDraftModel.get_trainer_kwargs(loss_fn=LOSS, loss_implementation="eager",
                                                         max_anchors=ANCHORS)  # fmt: skip
    sums: dict[str, float] = {}
    with torch.no_grad():
        for rows in packs(docs, PACK, torch.Generator().manual_seed(seed + 3)):
            _, _, metrics = draft(**as_float(target_states(target, rows)), **loss_kwargs)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    ratio = lambda name: round(sums[f"{name}_sum"] / sums[f"{name}_total"], 4)  # noqa: E731
    return {
        "per_position": [ratio(f"position_{k}_acc") for k in range(BLOCK)],
        "all_positions": ratio("full_acc"),
        "greedy_accept_length": ratio("eal"),
        "expected_accept_length": ratio("accept_len"),
    }


if __name__ == "__main__":
    sys.exit(main())
