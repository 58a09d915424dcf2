#!/usr/bin/env bash
# qstream end to end, as a model card author runs it: synthesize a tiny DSpark draft, quantize it
# to each format, measure each format's drift against the FP32 reference in every aux regime,
# and write the card (markdown + PNG figures).  About 8 minutes on two CPU cores.
#
#   examples/card_end_to_end.sh [OUTPUT_DIR]   (default: a scratch directory, never the checkout)
#
# The checked-in examples/card_tiny/ is this script's output (CARD.md, CARD_files/*.png and the
# results.json the card was made from), regenerated with
# `examples/card_end_to_end.sh examples/card_tiny`.  Set QSTREAM to use another qstream.
#
# Each step says what it starts on stderr; qstream's own progress goes there too: a bar on a
# terminal, a line every 30 s when stderr is a pipe or a log (docs/guarantees.md).
set -euo pipefail

QSTREAM=${QSTREAM:-qstream}
OUT_ARG=${1:-${TMPDIR:-/tmp}/qstream-card-tiny}
OUT=$(mkdir -p "$OUT_ARG" && cd "$OUT_ARG" && pwd)
BLOCKS=${BLOCKS:-1024}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # relative directory names, so that the card shows "draft-fp8", not a temp path

# The modules a published DSpark FP8 card quantizes (docs/model.md).
INCLUDE=(mlp.gate_proj mlp.up_proj mlp.down_proj self_attn.o_proj self_attn.q_b_proj context_proj)
step() { echo "== $*" >&2; }

step "synth: the tiny draft"
"$QSTREAM" synth --preset tiny --output_dir draft --seed 0
for fmt in fp8 mxfp4 nvfp4; do
  step "quantize and verify: $fmt"
  # Every quantized width of the tiny preset is a multiple of 32: all three formats quantize the
  # same tensors.
  "$QSTREAM" quantize --model_dir draft --output_dir "draft-$fmt" --quant_format "$fmt" \
    --include_layers "${INCLUDE[@]}" > /dev/null
  # vLLM's loading decision replayed for every runtime layer (docs/vllm.md)
  "$QSTREAM" verify "draft-$fmt"
done

# Simulated formats, plus the FP8 checkpoint read back from disk (what ships is what is measured),
# with simulated acceptance under vLLM's verification rules and NVFP4's per-module sensitivity;
# three serving conditions (an fp8 KV cache, W8A8, W4A4) give the card its "Serving conditions".
step "eval-drift: every format in every regime, $BLOCKS blocks each (the longest step)"
"$QSTREAM" eval-drift --model draft --variant shipped-fp8=draft-fp8 \
  --formats bf16,fp8,mxfp4,nvfp4,bf16+kv=fp8_e4m3,fp8+a=fp8-dynamic,nvfp4+a=nvfp4 \
  --include_layers "${INCLUDE[@]}" --regime all --blocks "$BLOCKS" --seed 0 \
  --acceptance --sensitivity --json results.json > /dev/null

step "card: tables and figures"
"$QSTREAM" card results.json --checkpoint draft-fp8 --checkpoint draft-mxfp4 \
  --checkpoint draft-nvfp4 --base draft --output CARD.md

rm -rf "$OUT/CARD_files"
cp -r CARD.md CARD_files results.json "$OUT/"
echo "card written to $OUT/CARD.md"
