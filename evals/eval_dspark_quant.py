"""The full model-card evaluation of a DSpark draft: every format against the FP32 reference in
every aux regime, one results JSON per regime (the layout the published card's harness writes),
ready for `qstream card`.

    python evals/eval_dspark_quant.py --model DRAFT_DIR [--target TARGET_DIR] \
        [--corpus ../shared/data/gsm8k/test.jsonl] [--variant shipped=FP8_DIR] \
        [--blocks 1024] [--seed 0] --out results/

writes results/drift_gauss.json, results/drift_heavy.json, results/drift_boot.json.  Without
--model it evaluates the built-in synthetic tiny draft on the built-in corpus.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qstream.cli import write_json
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.eval.vocabulary import VARIANT_FORMATS
from qstream.regimes import AUX_REGIMES

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--target")
    parser.add_argument("--corpus", default=str(GSM8K) if GSM8K.exists() else None)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for regime in AUX_REGIMES:
        settings = DriftSettings(
            model=args.model,
            target=args.target,
            corpus=args.corpus,
            regime=regime,
            formats=VARIANT_FORMATS,
            variant=tuple(args.variant),
            blocks=args.blocks,
            seed=args.seed,
        )
        results = evaluate_drift(settings)
        path = out / f"drift_{regime}.json"
        write_json(results, str(path))
        ceilings = {
            name: v["metrics"]["rollouts"]["greedy"]["ceiling"]["value"]
            for name, v in results["regimes"][regime]["variants"].items()
        }
        print(
            f"{regime:>5}: wrote {path}; greedy ceiling "
            + ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items())
        )


if __name__ == "__main__":
    main()
