#!/usr/bin/env bash
# Every output qstream writes, on small inputs, and the sha256 of each: run it at two commits and
# diff the listings to show that a change of structure changed no byte of any result.
#
#   evals/outputs_fingerprint.sh OUT_DIR > listing.txt
#
# Results name their input directories by absolute path: compare two runs made into the same OUT_DIR.
#
# It covers synth (the preset and a draft shaped for a Hugging Face target), quantize in every
# format (the card's module list, the defaults, and a generic target), verify and inspect JSON,
# eval-drift (--regime all with a read-back variant, acceptance and sensitivity; context lengths;
# captured states with acceptance against the target) and the cards made from those results.
# About five minutes on two CPU cores.  Set QSTREAM / PYTHON to use others.
set -euo pipefail

QSTREAM=${QSTREAM:-qstream}
PYTHON=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$OUT"  # relative names in every output
rm -rf ./*
INCLUDE=(mlp.gate_proj mlp.up_proj mlp.down_proj self_attn.o_proj self_attn.q_b_proj context_proj)
q() { "$QSTREAM" "$@" > /dev/null 2>&1 || { echo "failed: qstream $*" >&2; exit 1; }; }

q synth --preset tiny --output_dir draft --seed 0 --json synth.json
"$PYTHON" "$HERE/examples/make_tiny_target.py" target --family deepseek_v3 --seed 0 > /dev/null 2>&1
q synth --target target --output_dir tdraft --seed 0
for fmt in fp8 mxfp4 nvfp4; do
  q quantize --model_dir draft --output_dir "draft-$fmt" --quant_format "$fmt" --include_layers "${INCLUDE[@]}"
  q quantize --model_dir draft --output_dir "default-$fmt" --quant_format "$fmt"
  q quantize --model_dir target --output_dir "target-$fmt" --quant_format "$fmt" --skip-incompatible
  q verify "draft-$fmt" --json "verify-$fmt.json"
  q inspect "draft-$fmt" --json "inspect-$fmt.json"
done
q eval-drift --model draft --formats bf16,fp8,mxfp4,nvfp4 --variant shipped-fp8=draft-fp8 \
  --include_layers "${INCLUDE[@]}" --regime all --blocks 48 --seed 0 --acceptance --sensitivity \
  --json all.json
q eval-drift --model draft --formats bf16,nvfp4 --regime heavy --blocks 32 --seed 1 \
  --context-lengths --json context.json
q capture --target target --model tdraft --output states --dtype float32 --generate \
  --max-tokens 16 --new-tokens 48 --streams 6 --temperature 1.0 --top-p 0.95 --seed 0
q eval-drift --model tdraft --target target --states states --formats bf16,fp8,nvfp4 \
  --temperature 1.0 --top-p 0.95 --blocks 96 --seed 0 --acceptance --json states.json
q card all.json --checkpoint draft-fp8 --checkpoint draft-mxfp4 --checkpoint draft-nvfp4 \
  --base draft --output CARD.md
q card states.json --output CARD-states.md
q card context.json --output CARD-context.md
# A capture's stream files carry safetensors metadata, whose key order the safetensors library
# takes from a hash map (it changes from run to run): those are listed by their tensors and sorted
# header, and the two records of their sha256 (capture.json, and states.json that copies them)
# with those digests masked.  Every other file is listed by its bytes.
"$PYTHON" - <<'PY'
import hashlib, json, pathlib, re, struct
for path in sorted(p for p in pathlib.Path(".").rglob("*") if p.is_file()):
    if path.parts[0] == "target":
        continue  # written by transformers, not by qstream
    data = path.read_bytes()
    if path.parts[0] == "states" and path.suffix == ".safetensors":
        size = struct.unpack("<Q", data[:8])[0]
        header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True).encode()
        data = header + data[8 + size :]
    if path.name in ("capture.json", "states.json"):
        data = re.sub(rb'"[0-9a-f]{64}"', b'"sha256"', data)
    print(hashlib.sha256(data).hexdigest(), path)
PY
