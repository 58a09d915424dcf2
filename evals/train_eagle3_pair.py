"""Train the EAGLE-3 draft shipped in examples/gsm8k-pair/eagle3/ (docs/eagle3.md, "A trained
EAGLE-3 draft") on the shipped pair's target.

speculators 0.9.0's ``Eagle3DraftModel`` (the Qwen3 form: one midlayer shaped like the target's
layers) is built from its own config classes with speculators' training defaults: 3 test-time
training steps (so it drafts k = 3), every step's loss weighted alike (``ttt_step_loss_decay``
1.0), the ``kl_div`` loss against the target's distribution, ``norm_before_residual`` true,
the target's embedding and lm_head frozen; the optimiser and schedule are train_pair.py's
(AdamW at 2e-3, warm-up then cosine; speculators' default rate is 1e-3), for a short budget.
Its inputs are the target's hidden states over GSM8K train (the aux layers ``AUX_IDS`` and the state entering the target's final norm), captured with
evals/train_pair.py's ``target_states`` and shifted per document with speculators' own
``shift_batch`` (the aux states at t beside the token at t + 1). speculators' trainer needs
CUDA and its offline data pipeline, so the loop is train_pair.py's plain one over
``Eagle3DraftModel.forward``. The vocabulary is the target's full 2048 tokens (no d2t).

Run it in the speculators environment from the repository root, on one thread; everything is
seeded:

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-spec/bin/python evals/train_eagle3_pair.py \
        --gsm8k ../shared/data/gsm8k --target examples/gsm8k-pair/target \
        --output examples/gsm8k-pair/eagle3 --limit 3000

(the first 3,000 GSM8K train documents, one epoch: 569 packed sequences, 18 min on one thread
of a shared two-core machine, 2026-12-07; train.json records each stage's seconds).

It writes OUTPUT/ (speculators' ``save_pretrained`` layout, bf16) and OUTPUT/train.json
(settings, seconds per stage, the loss curve, teacher-forced accuracy on GSM8K test, sha256s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_pair import (  # noqa: E402
    TARGET,
    VOCAB,
    as_float,
    drop_remote_code,
    encode,
    fresh_run,
    packs,
    round_to_bf16,
    schedule,
    target_states,
    update,
    window_means,
)

from qstream.synth.corpus import read_corpus  # noqa: E402

AUX_IDS = [1, 3, 5]  # vLLM's aux ids: the residual streams entering target layers 1, 3 and 5
TTT_STEPS = 3  # speculators' default ttt_steps; the draft's speculative_tokens
LOSS = "kl_div"  # speculators' default loss for EAGLE-3
LR = 2e-3  # train_pair.py's draft rate (speculators defaults to 1e-3): a short budget
PACK = 1024  # tokens per packed sequence
THREADS = 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--gsm8k", type=Path, required=True, help="directory of train.jsonl, test.jsonl"
    )
    ap.add_argument("--target", type=Path, required=True, help="the shipped pair's target")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="first N train docs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = args.output
    if not fresh_run(out, THREADS):
        return 2
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    record: dict = {
        "seed": args.seed, "threads": THREADS, "torch": torch.__version__,
        "epochs": args.epochs, "limit": args.limit, "aux_layer_ids": AUX_IDS,
        "ttt_steps": TTT_STEPS, "loss": LOSS, "lr": LR, "pack": PACK, "seconds": {},
    }  # fmt: skip
    clock = time.perf_counter()
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    train = [encode(tok, d) for d in read_corpus(args.gsm8k / "train.jsonl")[: args.limit]]
    test = [encode(tok, d) for d in read_corpus(args.gsm8k / "test.jsonl")]
    target = Qwen3ForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    record["train_tokens"] = sum(len(d) for d, _ in train)

    draft = build_draft(args.target, args.seed)
    record["loss_curve"] = train_draft(draft, target, train, args.epochs, args.seed, record)
    clock_eval = time.perf_counter()
    round_to_bf16(draft)
    record["teacher_forced_test"] = teacher_forced(draft, target, test[:200], args.seed)
    record["seconds"]["evaluate"] = round(time.perf_counter() - clock_eval, 1)
    draft.config.speculators_config.verifier.name_or_path = None
    draft.to(torch.bfloat16).save_pretrained(out)
    drop_remote_code(out)
    record["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    record["sha256"] = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.glob("*")) if p.name != "train.json"
    }  # fmt: skip
    (out / "train.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("teacher_forced_test", "seconds")}))
    return 0


def build_draft(target_dir: Path, seed: int):
    """The Qwen3-form draft, one midlayer of the target's shape, its embedding, lm_head and
    verifier norm loaded from ``target_dir``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(
        vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **{**TARGET, "num_hidden_layers": 1},
    )  # fmt: skip
    layer._attn_implementation = "eager"  # flex attention compiles, and only for CUDA
    spec = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=str(target_dir), architectures=["Qwen3ForCausalLM"]),
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VOCAB,
        eagle_aux_hidden_state_layer_ids=AUX_IDS, norm_before_residual=True,
        speculators_config=spec,
    )  # fmt: skip
    torch.manual_seed(seed + 1)
    model = Eagle3DraftModel(config)
    model.load_verifier_weights()
    return model


def shifted(target, rows: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """One packed sequence's inputs in fp32, each document shifted by speculators'
    ``shift_batch`` as its EAGLE-3 data pipeline does, then packed again."""
    from speculators.models.eagle3.data import shift_batch

    states = as_float(target_states(target, rows, AUX_IDS))
    docs = states.pop("document_ids")[0]
    parts = []
    for d in range(len(rows)):
        keep = docs == d
        one = {k: v[0][keep] for k, v in states.items()}
        parts.append(shift_batch({**one, "lengths": torch.tensor([int(keep.sum())])}))
    out = {k: torch.cat([p[k] for p in parts])[None] for k in states}
    out["document_ids"] = torch.cat(
        [torch.full((len(p["input_ids"]),), d) for d, p in enumerate(parts)]
    )[None]
    return out


def train_draft(draft, target, docs, epochs: int, seed: int, record: dict) -> list[float]:
    """Capture the target's states once, then train ``epochs`` over them; the capture's and the
    training's seconds go to ``record``. Returns the mean loss of each run of 100 steps."""
    from speculators.models.eagle3 import Eagle3DraftModel

    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=LOSS, loss_implementation="eager", ttt_steps=TTT_STEPS, ttt_step_loss_decay=1.0
    )
    torch.manual_seed(seed + 2)
    gen = torch.Generator().manual_seed(seed + 2)
    clock = time.perf_counter()
    cache = [shifted(target, rows) for rows in packs(docs, PACK, gen)]
    record["seconds"]["capture"] = round(time.perf_counter() - clock, 1)
    record["packed_sequences"] = len(cache)
    print(f"capture: {len(cache)} packed sequences, {record['seconds']['capture']} s", flush=True)
    clock = time.perf_counter()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    total, losses, step = epochs * len(cache), [], 0
    draft.train()
    for epoch in range(epochs):
        for i in torch.randperm(len(cache), generator=gen).tolist():
            _, loss, _ = draft(**cache[i], **kwargs)
            update(opt, params, loss, LR * schedule(step, total, 50))
            losses.append(float(loss.detach()))
            step += 1
            if step % 100 == 0:
                seconds = time.perf_counter() - clock
                print(
                    f"epoch {epoch} step {step}/{total} loss {loss:.4f} {seconds:.0f} s", flush=True
                )
    draft.eval()
    record["seconds"]["train"] = round(time.perf_counter() - clock, 1)
    return window_means(losses, 100)


def teacher_forced(draft, target, docs, seed: int) -> dict:
    """On GSM8K test documents' answers: per TTT step, the share of positions whose argmax is
    the target's (``full_acc``) and the share among those right at every earlier step
    (``cond_acc``), speculators' own metrics."""
    from speculators.models.eagle3 import Eagle3DraftModel

    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=LOSS, loss_implementation="eager", ttt_steps=TTT_STEPS, ttt_step_loss_decay=1.0
    )
    sums: dict[str, float] = {}
    with torch.no_grad():
        for rows in packs(docs, PACK, torch.Generator().manual_seed(seed + 3)):
            _, _, metrics = draft(**shifted(target, rows), **kwargs)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    ratio = lambda name: round(sums[f"{name}_sum"] / sums[f"{name}_total"], 4)  # noqa: E731
    return {
        "full_acc": [ratio(f"full_acc_{k}") for k in range(TTT_STEPS)],
        "cond_acc": [ratio(f"cond_acc_{k}") for k in range(TTT_STEPS)],
    }


if __name__ == "__main__":
    sys.exit(main())
