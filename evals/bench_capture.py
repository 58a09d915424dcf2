"""Peak memory of ``qstream capture`` against what it cannot avoid: the target's weights plus
one batch's activations (docs/capture.md, "Memory").

A synthetic Llama target (random weights, ~100 M parameters, ~0.4 GB fp32) is written once;
then two fresh processes, each starting from the same imports:

* **capture**: ``run_capture`` over ``--streams`` streams, ``--batch-size`` at a time;
* **bound**: the target loaded the same way, then one forward of one full batch (the longest
  streams) with nothing kept: weights + one batch's activations.

Both report peak RSS above their post-import RSS; the ratio capture / bound says whether the
capture holds anything beyond one batch (states of earlier batches, a second copy of the
weights, all N+1 hidden states).

    PYTHONPATH=. python evals/bench_capture.py [--streams 32] [--batch-size 8] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def build(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_targets import make_draft_config

    from qstream.synth.corpus import builtin_corpus, train_tokenizer, write_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                         tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory / "target")
    write_tokenizer(train_tokenizer(builtin_corpus(n=2000), 4096), directory / "target")
    draft = make_draft_config(directory / "draft", (1, 3, 5), layers=8)
    text = json.loads((draft / "config.json").read_text())
    text.update(hidden_size=768, target_hidden_size=768, vocab_size=32000)
    (draft / "config.json").write_text(json.dumps(text))


def child(mode: str, directory: Path, args: argparse.Namespace) -> dict:
    import torch

    from qstream.capture.run import CaptureSettings, corpus_docs, encode, run_capture
    from qstream.capture.target import load_target

    base = _rss_now()
    settings = CaptureSettings(str(directory / "target"), str(directory / "draft"),
                               str(directory / f"out-{mode}"), dtype="float32",
                               max_tokens=args.max_tokens, streams=args.streams,
                               batch_size=args.batch_size)  # fmt: skip
    if mode == "capture":
        summary = run_capture(settings)
        return {"base": base, "peak": _peak(), "tokens": summary.tokens}
    target = load_target(settings.target, torch.float32)
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    encoded = encode(target.tokenizer, corpus_docs(None).texts, args.max_tokens)
    rows = sorted(encoded, key=len)[-args.batch_size :]  # the longest batch
    ids = torch.tensor([r + [0] * (args.max_tokens - len(r)) for r in rows])
    loaded = _rss_now()
    with torch.no_grad():
        target.model.model(input_ids=ids, use_cache=False)
    return {"base": base, "loaded": loaded, "peak": _peak(), "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--child", choices=["capture", "bound"])
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        runs = {}
        for mode in ("bound", "capture"):
            cmd = [sys.executable, __file__, "--child", mode, "--dir", tmp, "--streams",
                   str(args.streams), "--batch-size", str(args.batch_size), "--max-tokens",
                   str(args.max_tokens)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[mode] = json.loads(out.strip().splitlines()[-1])
    bound, cap = runs["bound"], runs["capture"]
    activations = bound["peak"] - bound["loaded"]
    need = bound["peak"] - bound["base"]
    used = cap["peak"] - cap["base"]
    print(f"target weights        {bound['weights'] / GIB:.3f} GiB (fp32)")
    print(
        f"one batch activations {activations / GIB:.3f} GiB ({args.batch_size} x {args.max_tokens} tokens)"
    )
    print(f"bound: load + 1 batch {need / GIB:.3f} GiB above imports")
    print(
        f"capture peak          {used / GIB:.3f} GiB above imports ({args.streams} streams, {cap['tokens']:,} tokens)"
    )
    print(f"ratio capture / bound {used / need:.2f}")


if __name__ == "__main__":
    main()
