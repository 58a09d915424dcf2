#!/usr/bin/env bash
# Real target states end to end (docs/capture.md): build a tiny DeepSeek-V3 target with
# transformers, synthesize a DSpark draft shaped for it, capture the target's own samples and
# hidden states, measure drift and acceptance against the target on them, and write the card.
# About half a minute on two CPU cores; nothing is downloaded.
#
#   examples/capture_end_to_end.sh [OUTPUT_DIR]   (default: a scratch directory, never the checkout)
#
# The checked-in examples/capture_tiny/ is this script's output (CARD.md, CARD_files/*.png,
# results.json and the capture's capture.json), regenerated with
# `examples/capture_end_to_end.sh examples/capture_tiny`.  Set QSTREAM / PYTHON to use others.
set -euo pipefail

QSTREAM=${QSTREAM:-qstream}
PYTHON=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT_ARG=${1:-${TMPDIR:-/tmp}/qstream-capture-tiny}
OUT=$(mkdir -p "$OUT_ARG" && cd "$OUT_ARG" && pwd)
BLOCKS=${BLOCKS:-384}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # relative directory names in the results and the card

# 1. The target: DeepSeek-V3's architecture (MLA, MoE), 6 layers, H 64, random weights.
"$PYTHON" "$HERE/make_tiny_target.py" target --family deepseek_v3 --seed 0

# 2. A draft for it: the target's width, vocabulary, tokenizer and embed_tokens; layer ids
#    spread over its depth; lm_head borrowed from the target at load time (--target).
"$QSTREAM" synth --target target --output_dir draft --seed 0

# 3. The target's own samples at the evaluation's temperature and top-p (a 16-token prompt
#    from the GSM8K test split, then 48 sampled tokens), and its hidden states on them.
"$QSTREAM" capture --target target --model draft --output states --dtype float32 \
  --generate --max-tokens 16 --new-tokens 48 --streams 12 --temperature 1.0 --top-p 0.95 --seed 0

# 4. Drift, and acceptance against the target itself, on the captured states.
"$QSTREAM" eval-drift --model draft --target target --states states --formats bf16,fp8,mxfp4,nvfp4 \
  --temperature 1.0 --top-p 0.95 --blocks "$BLOCKS" --seed 0 --acceptance --json results.json > /dev/null

# 5. The card.
"$QSTREAM" card results.json --output CARD.md

rm -rf "$OUT/CARD_files"
cp -r CARD.md CARD_files results.json "$OUT/"
cp states/capture.json "$OUT/capture.json"
echo "card written to $OUT/CARD.md"
