"""Why eval-drift at the anchors the decoder visited differs from the decoder by a few
thousandths of a token on the trained pair (docs/calibration.md, "At the visited anchors"):
the two read different target states.  The decoder's come from its KV-cached verification
forwards (a prefill, then the anchor and its block at a time); ``speculate --capture`` writes
the states of one full forward over each stream.  Both are the fp32 target's, equal to
rounding, but a bf16 draft rounds them to bf16, and where a rounding flips near a tie the draft
proposes another token.

For the bf16 draft this re-decodes the first ``--prompts`` prompts exactly as ``qstream
speculate`` did (checked token for token against its JSON), keeps the states each drafted block
read, and drafts the same block again from the capture's states:

    python evals/decoder_states.py --out calibration/   # evals/calibration.py's --out

It prints the largest relative difference of the two states, the share of bf16 roundings that
differ, the blocks whose drafted tokens differ, and those whose accepted run differs, with the
mean acceptance length each way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from qstream.arch.registry import architecture_of, load_config
from qstream.capture.target import load_target
from qstream.serving import FLOOR_VARIANT
from qstream.speculate import decode
from qstream.verification import GREEDY


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, default=Path("examples/gsm8k-pair"))
    ap.add_argument("--out", type=Path, required=True, help="evals/calibration.py's --out")
    ap.add_argument("--prompts", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    config = load_config(args.pair / "draft")
    arch = architecture_of(config)
    weights = arch.load_weights(args.pair / "draft", args.pair / "target", config)
    draft = arch.build(config, weights, FLOOR_VARIANT)
    target = load_target(args.pair / "target", torch.float32)
    runs = json.loads((args.out / "speculate.json").read_text())["runs"]["bf16"]

    read: list[tuple[torch.Tensor, int, list[int]]] = []  # each block: states, token, drafted
    plain = decode._draft

    def keep(model, aux, token, mode, temperature, seed):
        drafted = plain(model, aux, token, mode, temperature, seed)
        read.append((aux[0].float(), token, drafted[0]))
        return drafted

    decode._draft = keep  # the decoder's own call, watched
    blocks = drafts_differ = accepted_differ = flips = elements = 0
    emitted_decoder = emitted_capture = 0
    largest = 0.0
    for i, run in enumerate(runs[: args.prompts]):
        capture = load_file(args.out / "capture" / f"stream-{i:06d}.safetensors")
        ids, states = capture["input_ids"].tolist(), capture["aux_hidden_states"].float()
        read.clear()
        out = decode.speculative_decode(target.model, draft, ids[: run["prompt_tokens"]], 128)
        if out.tokens != run["tokens"] or out.accepted != run["accepted"]:
            print(f"Error: prompt {i} decodes differently from speculate.json", file=sys.stderr)
            return 1
        for (aux, token, drafted), p, accepted in zip(read, out.anchors, out.accepted):
            theirs = states[:p]
            largest = max(largest, float((aux - theirs).abs().max() / theirs.abs().max()))
            flips += int((aux.bfloat16() != theirs.bfloat16()).sum())
            elements += aux.numel()
            again = plain(draft, theirs[None], token, GREEDY, 1.0, 0)[0]
            stream = ids[p + 1 : p + 1 + len(again)]
            run_length = next(
                (k for k, (a, b) in enumerate(zip(again, stream)) if a != b), len(again)
            )
            blocks += 1
            drafts_differ += again != drafted
            accepted_differ += run_length != accepted
            emitted_decoder += accepted + 1
            emitted_capture += run_length + 1
    decode._draft = plain
    print(f"{blocks} blocks over {min(args.prompts, len(runs))} prompts (bf16 draft)")
    print(f"largest relative difference of the states: {largest:.2e}")
    print(f"bf16 roundings that differ: {flips} of {elements} ({flips / elements:.2e})")
    print(f"blocks drafting other tokens from the capture's states: {drafts_differ}")
    print(f"blocks accepting another run: {accepted_differ}")
    print(f"mean acceptance length: decoder's states {emitted_decoder / blocks:.4f}, "
          f"capture's states {emitted_capture / blocks:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
