"""eval-drift at the Kimi-K3 draft's scale on this machine: peak host RSS against the weights'
size, achieved FLOP rate against the same run's matmul rate, and seconds per 100 blocks.

    qstream synth --preset k3 --output_dir k3-draft          # 7.1 GB on disk, once
    python evals/bench_eval_k3.py --model k3-draft --blocks 16 [--formats bf16,fp8,mxfp4,nvfp4]
    python evals/bench_eval_k3.py --model k3-draft --blocks 1 --formats bf16 \
        --context-lengths 16384,16392 --context-blocks 2     # peak RSS of a long-context bucket
    python evals/bench_eval_k3.py --model k3-draft --blocks 1 --formats bf16 --regime boot \
        --context-lengths 16384,16392 --context-blocks 2     # ... with the causal pass's aux

One regime (gauss unless ``--regime``) is evaluated exactly as ``qstream eval-drift`` does
(reference, then each format built, drafted and freed).  Each step's wall time comes from the
evaluator's own progress reports; a drafting step's FLOPs are evals/bench_eval.py's analytic
count (docs/eval-drift.md, "FLOP model"; boot's reference adds its causal pass), compared with
a [2048, 7168] x [7168, 7168] matmul in the step's dtype (the faster of two measurements,
before and after the evaluation).  Peak RSS is the process's ``ru_maxrss`` (it includes the
memory-mapped checkpoint pages that were read).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_eval import GSM8K, matmul_rate, useful_flops  # noqa: E402

from qstream.arch.dspark_mla import load_config  # noqa: E402
from qstream.arch.dspark_mla.model import causal_flops, longest_anchors  # noqa: E402
from qstream.eval.corpus import sample_anchors  # noqa: E402
from qstream.eval.drift import DriftSettings, evaluate_drift, load_run_corpus  # noqa: E402
from qstream.regimes import AUX_REGIMES, REGIMES  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class StepTimes:
    """A Progress that charges the time since the previous report to the step reported."""

    def __init__(self) -> None:
        self.last, self.seconds = time.perf_counter(), {}

    def start(self, total, work=None):
        pass

    def advance(self, what: str, blocks: int, work: float = 0.0, kind: str = "variants") -> None:
        now = time.perf_counter()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - self.last
        self.last = now


def _rate(dtype: str) -> float:
    return matmul_rate(getattr(torch, DTYPES[dtype]), k=7168, n=7168)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--formats", default="bf16,fp8,mxfp4,nvfp4")
    parser.add_argument("--corpus", default=str(GSM8K) if GSM8K.exists() else None)
    parser.add_argument(
        "--context-lengths",
        default=None,
        help="also run a long-context sweep with these edges (then only peak RSS is reported)",
    )
    parser.add_argument("--context-blocks", type=int, default=2)
    parser.add_argument("--regime", choices=AUX_REGIMES, default="gauss")
    args = parser.parse_args()
    formats = tuple(args.formats.split(","))
    settings = DriftSettings(
        model=args.model,
        corpus=args.corpus,
        regime=args.regime,
        formats=formats,
        blocks=args.blocks,
        context_lengths=args.context_lengths or (),
        context_blocks=args.context_blocks,
    )
    sweep = settings.edges
    before = {dtype: _rate(dtype) for dtype in DTYPES}  # the machine's rate, before and after
    steps, start = StepTimes(), time.perf_counter()
    evaluate_drift(settings, progress=steps)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if sweep:
        print(f"k3 preset, {args.blocks} blocks and a sweep over {sweep} "
              f"({args.context_blocks} blocks per bucket), {args.regime}, reference + "
              f"{', '.join(formats)}: peak RSS {peak / 1e9:.2f} GB, wall {wall:.0f} s")  # fmt: skip
        for what, seconds in steps.seconds.items():
            print(f"  {what}: {seconds:.1f} s")
        return
    config = load_config(args.model)
    corpus = load_run_corpus(args.model, args.corpus, None, config)
    plan = sample_anchors(corpus, args.blocks, config.block_size, 0,
                          max_context=config.max_position_embeddings - config.block_size)  # fmt: skip
    flops = useful_flops(config, plan)
    longest = longest_anchors(plan.stream, plan.anchor)  # boot: + the causal pass per stream
    boot = REGIMES[args.regime].causal
    causal = sum(causal_flops(config, T) for T in longest.values()) if boot else 0
    weight_bytes = sum(p.stat().st_size for p in Path(args.model).rglob("*.safetensors"))
    rates = {dtype: max(before[dtype], _rate(dtype)) for dtype in DTYPES}  # the stricter
    print(f"k3 preset, {args.blocks} blocks, {args.regime}, reference + {', '.join(formats)}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"peak RSS {peak / 1e9:.2f} GB / weights {weight_bytes / 1e9:.2f} GB "
          f"(bf16 on disk, lm_head included) = {peak / weight_bytes:.2f}x; wall {wall:.0f} s")  # fmt: skip
    for what, seconds in steps.seconds.items():
        name = what.split(": ", 1)[-1]
        if name == "reference" or name in formats:
            dtype = "fp32" if name == "reference" else "bf16"
            achieved = (flops + (causal if name == "reference" else 0)) / seconds
            print(f"  {name:>9}: {seconds:7.1f} s = {100 * seconds / args.blocks:7.1f} s per 100 "
                  f"blocks; {achieved / 1e9:6.1f} GFLOP/s = {achieved / rates[dtype]:5.1%} of "
                  f"the {dtype} matmul rate ({rates[dtype] / 1e9:.1f} GFLOP/s)")  # fmt: skip
        else:
            print(f"  {what}: {seconds:.1f} s")


if __name__ == "__main__":
    main()
