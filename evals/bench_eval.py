"""Achieved FLOP rate of eval-drift's reference (fp32) and bf16 passes on the `small` preset, as
a ratio to this machine's matmul rate for the same dtype, measured in the same run.

    python evals/bench_eval.py [--model DIR] [--blocks 256] [--corpus ../shared/data/gsm8k/test.jsonl]

The FLOPs are counted analytically (multiply-adds x 2) for the work the draft must do: the
context projection and per-layer context latents once per stream position, per-layer K/V
expansion of the context once per stream, the block pass (projections, attention over context
plus block, SwiGLU), lm_head and the Markov head for every drafted position.  Padding, masking,
softmax and norms are not counted, so the ratio is a lower bound on hardware utilisation.
The aux states are drawn before the timed passes: eval-drift draws them once per regime and
shares them between the reference and every variant.
Target (issue eval-drift): at least 50% of the matmul rate.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from qstream.arch.dspark_mla import load_config, load_weights
from qstream.arch.dspark_mla.model import DSpark, blocks_flops
from qstream.arch.markov import BLOCK_DRAFTER
from qstream.eval.batches import AuxStates, make_batches, propose
from qstream.eval.corpus import sample_anchors
from qstream.eval.drift import load_run_corpus
from qstream.regimes import GAUSS
from qstream.synth.draft import synth_checkpoint

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def matmul_rate(dtype: torch.dtype, m: int = 2048, k: int = 1024, n: int = 3072) -> float:
    """Best-of-5 FLOP/s of one [m, k] @ [k, n] matmul, the shape class of the draft's layers,
    into a preallocated output (the GEMM alone: no page faults of a fresh output counted)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = torch.zeros(m, n, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def useful_flops(config, plan) -> float:
    """The plan's work by the FLOP model (qstream/arch/dspark_mla/model.py, docs/eval-drift.md)."""
    return blocks_flops(config, plan.stream, plan.anchor)


def run_pass(model: DSpark, batches, aux) -> float:
    """One greedy drafting pass over every batch (aux states drawn beforehand, untimed)."""
    start = time.perf_counter()
    for batch, states in zip(batches, aux):
        BLOCK_DRAFTER.rollout(propose(model, states, batch))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a `small` draft directory (default: synthesize one)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--corpus", default=str(GSM8K) if GSM8K.exists() else None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or synth_checkpoint("small", Path(tmp) / "small", seed=0).output_dir
        config = load_config(model_dir)
        corpus = load_run_corpus(model_dir, args.corpus, None, config)
        plan = sample_anchors(corpus, args.blocks, config.block_size, seed=0)
        batches = make_batches(plan, corpus, config)
        weights = load_weights(model_dir, None, config)
        gauss = AuxStates(GAUSS, corpus, config, seed=0)
        aux = [gauss.get(b) for b in batches]
        flops = useful_flops(config, plan)
        print(
            f"small preset: H={config.hidden_size} V={config.vocab_size}, {args.blocks} blocks "
            f"(mean context {plan.anchor.double().mean():.0f}), {len(batches)} batches, "
            f"{flops / 1e9:.1f} GFLOP per pass; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads"
        )
        for name, dtype in (("reference fp32", torch.float32), ("variant bf16", torch.bfloat16)):
            peak = matmul_rate(dtype)
            model = DSpark(config, weights, dtype)
            run_pass(model, batches[:1], aux[:1])  # warm-up
            seconds = min(run_pass(model, batches, aux) for _ in range(2))
            achieved = flops / seconds
            print(
                f"{name:>15}: {seconds:6.2f} s  {achieved / 1e9:6.1f} GFLOP/s  matmul peak "
                f"{peak / 1e9:6.1f} GFLOP/s  ->  {achieved / peak:5.1%} of matmul rate"
            )
            del model


if __name__ == "__main__":
    main()
