#!/usr/bin/env bash
# An EAGLE-3 draft end to end (docs/eagle3.md, "A trained EAGLE-3 draft"): the draft trained on
# the shipped pair's target (examples/gsm8k-pair/eagle3) is quantized to fp8 and nvfp4, each
# checkpoint verified against vLLM 0.32.0's loading rules, every format's drift and simulated
# acceptance measured in every aux regime, its acceptance measured with the real target in the
# loop, and the card written.  About 5 minutes on one thread; nothing is downloaded.
#
#   examples/eagle3_end_to_end.sh [OUTPUT_DIR]   (default: a scratch directory, never the checkout)
#
# BLOCKS (eval-drift's blocks per regime), PROMPTS and NEW_TOKENS (speculate's) size the run;
# set QSTREAM to use another qstream.  The checked-in examples/card_eagle3_pair/ is this
# script's output, regenerated with `examples/eagle3_end_to_end.sh examples/card_eagle3_pair`.  tests/test_eagle3_chain.py runs the same chain on
# `qstream synth --preset eagle3-tiny` at small sizes.
set -euo pipefail

QSTREAM=${QSTREAM:-qstream}
HERE=$(cd "$(dirname "$0")" && pwd)
PAIR=$HERE/gsm8k-pair
OUT_ARG=${1:-${TMPDIR:-/tmp}/qstream-eagle3-pair}
OUT=$(mkdir -p "$OUT_ARG" && cd "$OUT_ARG" && pwd)
BLOCKS=${BLOCKS:-512}
PROMPTS=${PROMPTS:-32}
NEW_TOKENS=${NEW_TOKENS:-128}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # relative directory names, so that the card shows "eagle3-fp8", not a temp path
step() { echo "== $*" >&2; }

# speculators' layout has no tokenizer: the target's is the draft's
cp -r "$PAIR/eagle3" eagle3
ln -s "$PAIR/target" target
TARGET=(--target target)
for fmt in fp8 nvfp4; do
  step "quantize and verify: $fmt"
  "$QSTREAM" quantize --model_dir eagle3 --output_dir "eagle3-$fmt" --quant_format "$fmt" > /dev/null
  # the midlayer's runtime name is model.layers.{L}, L the target's depth (docs/vllm.md)
  "$QSTREAM" verify "eagle3-$fmt" "${TARGET[@]}"
done

step "eval-drift: every format in every regime, $BLOCKS blocks each, with acceptance"
"$QSTREAM" eval-drift --model eagle3 "${TARGET[@]}" --tokenizer target/tokenizer.json \
  --variant shipped-fp8=eagle3-fp8 --variant shipped-nvfp4=eagle3-nvfp4 \
  --formats bf16,fp8,mxfp4,nvfp4 --regime all --blocks "$BLOCKS" --seed 0 --acceptance \
  --json results.json > /dev/null

step "speculate: the target in the loop, $PROMPTS prompts of $NEW_TOKENS tokens"
"$QSTREAM" speculate "${TARGET[@]}" --model eagle3 --variant shipped-fp8=eagle3-fp8 \
  --variant shipped-nvfp4=eagle3-nvfp4 --formats bf16,fp8,mxfp4,nvfp4 --prompts "$PROMPTS" \
  --new-tokens "$NEW_TOKENS" --json spec.json > /dev/null

step "card: tables and figures"
"$QSTREAM" card results.json --speculate spec.json --checkpoint eagle3-fp8 \
  --checkpoint eagle3-nvfp4 --base eagle3 --output CARD.md

rm -rf "$OUT/CARD_files"
cp -r CARD.md CARD_files results.json spec.json "$OUT/"
echo "card written to $OUT/CARD.md"
