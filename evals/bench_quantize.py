"""Time and peak RSS of ``qstream-quantize`` against llm-compressor's ``model_free_ptq`` on the
same randomly initialised ~0.5B-parameter Llama checkpoint, same machine, same run, for each
format and each worker count (both tools at the same one), and qstream's time against an I/O
floor measured in the same run: a fresh interpreter that imports torch, reads every input byte
and writes as many bytes as qstream's output has.  Each run is a fresh child process; its peak
RSS comes from ``os.wait4``.  Runs are interleaved in rounds and each figure is taken over
``--repeat`` rounds (best time, median RSS), so that load from other processes falls on
every tool alike; qstream / floor is also given paired (the median of each round's own ratio).
qstream runs twice a round: as users run it, and with ``--no-snr`` (the weight SNR is one more
pass over every weight, which neither model_free_ptq nor the floor makes).

    .venv/bin/python evals/bench_quantize.py --llmc-python /path/to/venv-llmc/bin/python

(the llm-compressor venv: ``python3 -m venv venv-llmc && venv-llmc/bin/pip install
llmcompressor``); ``--no-peer`` skips model_free_ptq and measures qstream against the floor only.  Targets (same worker count): FP8 >= 5x and MXFP4 / NVFP4 >= 6x
faster than model_free_ptq, peak RSS <= 0.2 of its, and qstream <= 1.5x the I/O floor for FP8,
<= 2x for the 4-bit formats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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

src, out, fmt, workers = sys.argv[1:5]
if fmt == "fp8":
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False))
else:
    scheme = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt]
model_free_ptq(src, out, scheme=scheme, ignore=["lm_head", "model.embed_tokens"],
               max_workers=int(workers), device="cpu")
"""

# The I/O floor: what any torch-based tool pays to start, read the input and write the output.
FLOOR_SCRIPT = r"""
import sys, torch
out, size, *inputs = sys.argv[1:]
buf = bytearray(64 << 20)
for path in inputs:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
left = int(size)
with open(out, "wb", buffering=0) as f:
    while left:
        left -= f.write(memoryview(buf)[:min(left, len(buf))])
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
        names.update(
            {
                p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                p + "self_attn.k_proj.weight": (KV, HIDDEN),
                p + "self_attn.v_proj.weight": (KV, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                p + "mlp.up_proj.weight": (INTER, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, INTER),
                p + "input_layernorm.weight": (HIDDEN,),
                p + "post_attention_layernorm.weight": (HIDDEN,),
            }
        )
    names.update({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    # Shards split at layer boundaries: model_free_ptq (llm-compressor 0.14) fails on NVFP4 when
    # a q/k/v group straddles two shards ("Matched ... k_proj twice before completing set").
    per_shard = -(-LAYERS // shards)
    shard_of = {
        n: min(int(n.split(".")[2]) // per_shard, shards - 1)
        if ".layers." in n
        else (0 if "embed" in n else shards - 1)
        for n in names
    }
    weight_map = {}
    for s in range(shards):
        file = (
            f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        )
        part = {
            n: (torch.randn(*names[n], generator=gen) * 0.02).bfloat16()
            for n in names
            if shard_of[n] == s
        }
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        del part
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "intermediate_size": INTER,
                "num_hidden_layers": LAYERS,
                "num_attention_heads": 16,
                "num_key_value_heads": KV // 64,
                "vocab_size": VOCAB,
                "torch_dtype": "bfloat16",
            }
        )
    )
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
    out = subprocess.run(
        [sys.executable, "-S", "-c", LAUNCHER, *cmd], capture_output=True, text=True, check=True
    )
    seconds, rss, status = out.stdout.split()
    if int(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr}")
    return float(seconds), int(rss)


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def bench_round(args, src: Path, work: Path, fmt: str, workers: int) -> dict:
    """One qstream run, one model_free_ptq run and one floor run, all fresh processes."""
    q_out, l_out, f_out = work / f"qstream-{fmt}", work / f"llmc-{fmt}", work / "floor.bin"
    for d in (q_out, l_out):
        shutil.rmtree(d, ignore_errors=True)
    qstream = [args.qstream, "--model_dir", str(src), "--output_dir", str(q_out)]
    qstream += ["--quant_format", fmt, "--ignore_layers", "lm_head", "--workers", str(workers)]
    # without the weight SNR (one more pass over every weight, which neither model_free_ptq nor
    # the floor makes): like for like
    q_nosnr = run([*qstream, "--no-snr"])
    shutil.rmtree(q_out)
    q = run(qstream)
    out_bytes = _dir_bytes(q_out)
    peer = [args.llmc_python, "-c", LLMC_SCRIPT, str(src), str(l_out), fmt, str(workers)]
    lc = (None, None) if args.no_peer else run(peer)  # None: not run, never a NaN in the JSON
    inputs = [str(p) for p in sorted(src.iterdir()) if p.is_file()]
    floor = run([sys.executable, "-c", FLOOR_SCRIPT, str(f_out), str(out_bytes), *inputs])
    for d in (q_out, l_out):
        shutil.rmtree(d, ignore_errors=True)
    f_out.unlink(missing_ok=True)
    return {
        "qstream_s": q[0],
        "qstream_nosnr_s": q_nosnr[0],
        "qstream_rss": q[1],
        "llmc_s": lc[0],
        "llmc_rss": lc[1],
        "floor_s": floor[0],
    }


def summarize(fmt: str, workers: int, rounds: list[dict]) -> dict:
    """Times are the best of the rounds (what each command costs when the machine lets it
    run; load from other processes only ever adds), for every command alike; peak RSS, which
    load does not change, the median."""
    best = {k: min(r[k] for r in rounds) for k in ("qstream_s", "qstream_nosnr_s", "floor_s")}
    q_rss = statistics.median(r["qstream_rss"] for r in rounds)
    peer = rounds[0]["llmc_s"] is not None  # --no-peer: model_free_ptq was not run
    llmc_s = min(r["llmc_s"] for r in rounds) if peer else None
    llmc_rss = statistics.median(r["llmc_rss"] for r in rounds) if peer else None
    return {
        "format": fmt,
        "workers": workers,
        "rounds": len(rounds),
        **best,
        "llmc_s": llmc_s,
        "qstream_rss_gib": q_rss / 2**30,
        "llmc_rss_gib": None if llmc_rss is None else llmc_rss / 2**30,
        "speedup": None if llmc_s is None else llmc_s / best["qstream_s"],
        "rss_ratio": None if llmc_rss is None else q_rss / llmc_rss,
        "over_floor": best["qstream_s"] / best["floor_s"],
        "nosnr_over_floor": best["qstream_nosnr_s"] / best["floor_s"],
        # each round's own ratio, the median: robust to a round whose floor ran unusually fast
        "over_floor_paired": statistics.median(r["qstream_s"] / r["floor_s"] for r in rounds),
    }


HEADER = (
    "format  w | qstream s   GiB | no-snr s | model_free_ptq s   GiB | floor s | speedup "
    "| RSS ratio | qstream/floor (paired) | no-snr/floor"
)


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    """A figure, or n/a right-aligned to its width when it was not measured (--no-peer)."""
    width = int(spec.split(".")[0])
    return f"{'n/a':>{width + len(suffix)}}" if value is None else f"{value:{spec}}{suffix}"


def row(r: dict) -> str:
    return (
        f"{r['format']:6s} {r['workers']:2d} | {r['qstream_s']:9.2f} {r['qstream_rss_gib']:5.2f}"
        f" | {r['qstream_nosnr_s']:8.2f} | {_cell(r['llmc_s'], '16.2f')}"
        f" {_cell(r['llmc_rss_gib'], '5.2f')} | {r['floor_s']:7.2f}"
        f" | {_cell(r['speedup'], '6.2f', 'x')} | {_cell(r['rss_ratio'], '9.3f')}"
        f" | {r['over_floor']:12.2f}x ({r['over_floor_paired']:.2f}x)"
        f" | {r['nosnr_over_floor']:11.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llmc-python", default="/work/venv-llmc/bin/python")
    parser.add_argument("--qstream", default=str(Path(sys.executable).parent / "qstream-quantize"))
    parser.add_argument(
        "--no-peer", action="store_true", help="skip model_free_ptq (no llm-compressor needed)"
    )
    parser.add_argument("--formats", default="fp8,mxfp4,nvfp4")
    parser.add_argument("--workers", default="1,2", help="worker counts, both tools alike")
    parser.add_argument("--repeat", type=int, default=3, help="rounds: best time, median peak RSS")
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="input shards (0.5B models ship as one model.safetensors)",
    )
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
        subprocess.run(
            [sys.executable, __file__, "--write-only", str(src), "--shards", str(args.shards)],
            check=True,
        )
    for shard in src.glob("*.safetensors"):  # both tools then read from the page cache
        with open(shard, "rb") as f:
            while f.read(64 << 20):
                pass
    cases = [(fmt, int(w)) for fmt in args.formats.split(",") for w in args.workers.split(",")]
    rounds: dict[tuple[str, int], list[dict]] = {c: [] for c in cases}
    try:
        for i in range(args.repeat):
            for fmt, workers in cases:
                rounds[fmt, workers].append(bench_round(args, src, work, fmt, workers))
                print(
                    f"round {i + 1}/{args.repeat} {fmt} w{workers}: "
                    + " ".join(
                        f"{k} {v:.2f}"
                        for k, v in rounds[fmt, workers][-1].items()
                        if k.endswith("_s") and v is not None  # None: not run (--no-peer)
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = [summarize(fmt, workers, rounds[fmt, workers]) for fmt, workers in cases]
    print(
        f"{os.cpu_count()} CPUs, {args.shards} shard(s); best time and median peak RSS of "
        f"{args.repeat} rounds"
    )
    print(HEADER)
    for r in results:
        print(row(r))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpus": os.cpu_count(),
                    "shards": args.shards,
                    "repeat": args.repeat,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
