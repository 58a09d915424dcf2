"""Quantize one Kimi-K3-sized MLP weight (bf16 [14336, 7168]) with each format and report
parameters per second as a ratio to a plain copy of the same tensor, timed in the same run.

    python evals/bench_formats.py [--rows 14336 --cols 7168 --repeats 3]

Targets on two CPU cores (issue "Foundation"): FP8 >= 30% of copy speed, MXFP4 and NVFP4 >= 15%.
Best-of-N wall times; the machine is shared, so only the ratios are meaningful.
"""

from __future__ import annotations

import argparse
import time

import torch

from qstream.formats import FORMATS, quantize

TARGET = {"fp8": 0.30, "mxfp4": 0.15, "nvfp4": 0.15}


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=14336)
    parser.add_argument("--cols", type=int, default=7168)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(args.rows, args.cols, generator=gen) * 0.02).to(torch.bfloat16)
    n = w.numel()
    print(
        f"weight bf16 [{args.rows}, {args.cols}] = {n / 1e6:.1f} M params, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    copy_s = best_time(lambda: w.clone(), args.repeats)
    print(f"{'copy':>6}: {copy_s * 1e3:8.1f} ms  {n / copy_s / 1e9:6.2f} G params/s  (peer)")
    for fmt in FORMATS:
        t = best_time(lambda: quantize(fmt, w), args.repeats)
        ratio = copy_s / t
        verdict = "meets" if ratio >= TARGET[fmt] else "BELOW"
        print(
            f"{fmt:>6}: {t * 1e3:8.1f} ms  {n / t / 1e9:6.2f} G params/s  "
            f"{ratio:6.1%} of copy speed ({verdict} target {TARGET[fmt]:.0%})"
        )


if __name__ == "__main__":
    main()
