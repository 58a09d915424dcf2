"""Time and peak RSS of ``qstream-quantize`` against llm-compressor's ``model_free_ptq`` on the
same randomly initialised ~0.5B-parameter Llama checkpoint, same machine, same run, for each
format.  Each run is a fresh child process; its peak RSS comes from ``os.wait4``.

    /work/venv/bin/python evals/bench_quantize.py --llmc-python /work/venv-llmc/bin/python

Targets (issue 3, two cores): >= 4x faster for the 4-bit formats, >= 3x for FP8, peak RSS at
most a quarter of model_free_ptq's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

LLMC_SCRIPT = r"""
import sys
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq

src, out, fmt = sys.argv[1:4]
if fmt == "fp8":
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False))
else:
    scheme = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt]
model_free_ptq(src, out, scheme=scheme, ignore=["lm_head", "model.embed_tokens"],
               max_workers=1, device="cpu")
"""

# ~0.5B parameters: 28 layers of hidden 1024, intermediate 4096, 8 KV heads of 64, vocab 32000.
HIDDEN, INTER, LAYERS, KV, VOCAB = 1024, 4096, 28, 512, 32000


def write_random_llama(directory: Path, shards: int = 2) -> int:
    """Write the checkpoint shard by shard (bf16 N(0, 0.02^2)); returns the parameter count."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    names = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names.update({p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                      p + "self_attn.k_proj.weight": (KV, HIDDEN),
                      p + "self_attn.v_proj.weight": (KV, HIDDEN),
                      p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                      p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                      p + "mlp.up_proj.weight": (INTER, HIDDEN),
                      p + "mlp.down_proj.weight": (HIDDEN, INTER),
                      p + "input_layernorm.weight": (HIDDEN,),
                      p + "post_attention_layernorm.weight": (HIDDEN,)})
    names.update({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    # Shards split at layer boundaries: model_free_ptq (llm-compressor 0.14) fails on NVFP4 when
    # a q/k/v group straddles two shards ("Matched ... k_proj twice before completing set").
    per_shard = -(-LAYERS // shards)
    shard_of = {n: min(int(n.split(".")[2]) // per_shard, shards - 1) if ".layers." in n
                else (0 if "embed" in n else shards - 1) for n in names}
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 \
            else "model.safetensors"
        part = {n: (torch.randn(*names[n], generator=gen) * 0.02).bfloat16()
                for n in names if shard_of[n] == s}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        del part
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 16,
        "num_key_value_heads": KV // 64, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}))
    return sum(torch.Size(s).numel() for s in names.values())


# Linux carries the high-water RSS of the image a child was forked from across exec into its
# ru_maxrss, so a child of this (torch-importing, checkpoint-writing) process would report at
# least our own peak.  Each tool is therefore started by this small torch-free launcher, which
# reports the tool's own wall time and peak RSS from os.wait4.
LAUNCHER = r"""
import os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, status, usage = os.wait4(proc.pid, 0)
err = proc.stderr.read().decode()[-2000:]
print(time.perf_counter() - start, usage.ru_maxrss * 1024, status)
sys.stderr.write(err)
"""


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one tool run."""
    out = subprocess.run([sys.executable, "-S", "-c", LAUNCHER, *cmd], capture_output=True,
                         text=True, check=True)
    seconds, rss, status = out.stdout.split()
    if int(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr}")
    return float(seconds), int(rss)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llmc-python", default="/work/venv-llmc/bin/python")
    parser.add_argument("--qstream", default=str(Path(sys.executable).parent / "qstream-quantize"))
    parser.add_argument("--formats", default="fp8,mxfp4,nvfp4")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=1,
                        help="input shards (0.5B models ship as one model.safetensors)")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-only", default=None, metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_only:
        params = write_random_llama(Path(args.write_only), args.shards)
        print(f"wrote {params / 1e9:.3f}B-parameter checkpoint to {args.write_only}")
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="qstream-bench-"))
    src = work / "llama-0.5b"
    if not src.exists():  # in a child, so that this process stays small (see LAUNCHER)
        subprocess.run([sys.executable, __file__, "--write-only", str(src),
                        "--shards", str(args.shards)], check=True)
    for shard in src.glob("*.safetensors"):  # both tools then read from the page cache
        with open(shard, "rb") as f:
            while f.read(64 << 20):
                pass
    results = []
    try:
        for fmt in args.formats.split(","):
            q_out, l_out = work / f"qstream-{fmt}", work / f"llmc-{fmt}"
            shutil.rmtree(q_out, ignore_errors=True)
            shutil.rmtree(l_out, ignore_errors=True)
            q = run([args.qstream, "--model_dir", str(src), "--output_dir", str(q_out),
                     "--quant_format", fmt, "--ignore_layers", "lm_head",
                     "--workers", str(args.workers)])
            lc = run([args.llmc_python, "-c", LLMC_SCRIPT, str(src), str(l_out), fmt])
            r = {"format": fmt, "qstream_s": q[0], "qstream_rss_gib": q[1] / 2**30,
                 "llmc_s": lc[0], "llmc_rss_gib": lc[1] / 2**30,
                 "speedup": lc[0] / q[0], "rss_ratio": q[1] / lc[1]}
            results.append(r)
            print(f"{fmt:6s} qstream {q[0]:6.1f} s {q[1] / 2**30:5.2f} GiB | model_free_ptq "
                  f"{lc[0]:6.1f} s {lc[1] / 2**30:5.2f} GiB | {r['speedup']:.2f}x faster, "
                  f"RSS {r['rss_ratio']:.3f} of model_free_ptq's", flush=True)
            shutil.rmtree(q_out, ignore_errors=True)
            shutil.rmtree(l_out, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), "shards": args.shards,
                                               "workers": args.workers, "results": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
