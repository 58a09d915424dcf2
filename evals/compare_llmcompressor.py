"""Same bytes as llm-compressor?  Quantize one small Llama checkpoint with qstream and with
llm-compressor's ``model_free_ptq`` (FP8 per-channel weight-only, NVFP4A16, MXFP4A16, same
ignore list) and compare every output tensor byte for byte.

llm-compressor lives in its own virtual environment (it pins its own compressed-tensors), so
it runs in a subprocess of that interpreter:

    /work/venv/bin/python evals/compare_llmcompressor.py --llmc-python /work/venv-llmc/bin/python

Exit status 0 when every tensor of every format is identical.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from checkpoints import llama_tensors, write_checkpoint  # noqa: E402

from qstream.quant import quantize_checkpoint  # noqa: E402

# llm-compressor's scheme for each qstream format; FP8 per-channel weight-only has no preset.
LLMC_SCRIPT = r"""
import sys
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq

src, out, fmt = sys.argv[1:4]
ignore = sys.argv[4:]
if fmt == "fp8":
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False))
else:
    scheme = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt]
model_free_ptq(src, out, scheme=scheme, ignore=ignore, max_workers=1, device="cpu")
"""


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def compare(fmt: str, src: Path, work: Path, llmc_python: str) -> dict:
    ours = quantize_checkpoint(src, work / f"qstream-{fmt}", fmt)
    # model_free_ptq skips *norm modules itself; give it the rest of qstream's ignore list
    ignore = [m for m in ours.modules_ignored if not m.endswith("norm")]
    subprocess.run(
        [llmc_python, "-c", LLMC_SCRIPT, str(src), str(work / f"llmc-{fmt}"), fmt, *ignore],
        check=True,
        capture_output=True,
        text=True,
    )
    a, b = _tensors(work / f"qstream-{fmt}"), _tensors(work / f"llmc-{fmt}")
    differing = [
        n
        for n in sorted(set(a) & set(b))
        if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or _bytes(a[n]) != _bytes(b[n])
    ]
    qa = json.loads((work / f"qstream-{fmt}" / "config.json").read_text())["quantization_config"]
    qb = json.loads((work / f"llmc-{fmt}" / "config.json").read_text())["quantization_config"]
    wa, wb = (
        qa["config_groups"]["group_0"]["weights"],
        next(iter(qb["config_groups"].values()))["weights"],
    )
    return {
        "format": fmt,
        "tensors_qstream": len(a),
        "tensors_llmcompressor": len(b),
        "only_qstream": sorted(set(a) - set(b)),
        "only_llmcompressor": sorted(set(b) - set(a)),
        "identical": len(set(a) & set(b)) - len(differing),
        "differing": differing,
        "config_format": [qa["format"], qb["format"]],
        "config_targets": [
            qa["config_groups"]["group_0"]["targets"],
            next(iter(qb["config_groups"].values()))["targets"],
        ],
        "weights_args_disagree": {k: [wa.get(k), wb.get(k)] for k in wa if wa.get(k) != wb.get(k)},
        "version": [qa["version"], qb["version"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llmc-python", default="/work/venv-llmc/bin/python")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = write_checkpoint(work / "llama", llama_tensors(layers=args.layers))
        results = [compare(fmt, src, work, args.llmc_python) for fmt in ("fp8", "nvfp4", "mxfp4")]
    for r in results:
        verdict = (
            "IDENTICAL"
            if not r["differing"] and not r["only_qstream"] and not r["only_llmcompressor"]
            else "DIFFERENT"
        )
        print(
            f"{r['format']:6s} {verdict}: {r['identical']} identical tensors, "
            f"{len(r['differing'])} differing, only in qstream {r['only_qstream']}, "
            f"only in llm-compressor {r['only_llmcompressor']}; targets "
            f"{r['config_targets']}, weights args that differ {r['weights_args_disagree']}, "
            f"versions {r['version']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    same = all(
        not r["differing"] and not r["only_qstream"] and not r["only_llmcompressor"]
        for r in results
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
