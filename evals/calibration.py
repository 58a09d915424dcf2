"""The calibration study (docs/calibration.md): how well does drift against the FP32 reference,
and eval-drift's simulated acceptance, predict the acceptance a format loses when the target
itself verifies every block?  Run on the trained pair shipped in examples/gsm8k-pair/.

    python evals/calibration.py [--pair examples/gsm8k-pair] [--prompts 32] [--new-tokens 128] \
        [--blocks 1024] --out calibration/ [--doc docs/calibration.md] \
        [--card examples/card_gsm8k_pair]

A pair whose target is not shipped (the SmolLM2 pair: PAIR/draft only) takes ``--target DIR``;
a chat-tuned one ``--apply-chat-template``; ``--serving`` adds serving configurations (vLLM's
activations, KV cache, the target quantized: docs/speculate.md) to step 2's measured table, and
``--section NAME`` writes the doc's ``<!-- calibration:NAME:begin -->`` block instead.

Every number comes from the qstream commands it runs (each is printed before it runs):

1. ``qstream quantize`` the draft to fp8, mxfp4 and nvfp4 (the read-back checkpoints).
2. ``qstream speculate`` with greedy verification, the target in the loop, for bf16, each
   simulated format and each read-back checkpoint, ``--capture``: measured acceptance, and the
   decoded streams' states with every variant's visited anchors.
3. ``qstream eval-drift --states-anchors`` per variant: eval-drift at the anchors its decoder
   visited (there it must agree with step 2: the same blocks).
4. ``qstream eval-drift --acceptance`` at uniformly drawn anchors: the drift ceilings in the
   gauss, heavy and boot regimes (``--regime all``), and on the target's real states, with
   the simulated acceptance against the target, at anchors over every position of the
   streams (eval-drift's default) and over their decoded part only.
5. ``qstream card`` from those results, the checkpoints and step 2's measured acceptance.

It writes OUT/*.json, OUT/calibration.png and, with --doc, the tables into that markdown file
between its ``<!-- calibration:begin -->`` and ``<!-- calibration:end -->`` markers and the
figure beside it (docs/calibration.png); with --card, the model card into that directory
(CARD.md and CARD_files/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qstream.verification import GREEDY

FORMATS = "fp8,mxfp4,nvfp4"
# the ceiling's regimes; "states" is taken at anchors in the decoded text, as the card shows it
REGIMES = ("gauss", "heavy", "boot", "states")


def qstream(*args: str) -> None:
    command = [sys.executable, "-c", "from qstream.entry import main; main()", *args]
    print("$ qstream " + shlex.join(args), flush=True)
    subprocess.run(command, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, default=Path("examples/gsm8k-pair"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--doc", type=Path, default=None)
    ap.add_argument("--card", type=Path, default=None, help="directory for the model card")
    ap.add_argument("--target", type=Path, default=None, help="default: PAIR/target")
    ap.add_argument("--formats", default=FORMATS, help="the formats quantized and simulated")
    ap.add_argument("--no-readback", action="store_true", help="simulated formats only")
    ap.add_argument("--serving", default="", help="more speculate variants, comma-separated")
    ap.add_argument("--apply-chat-template", action="store_true")
    ap.add_argument("--section", default=None, help="the doc's named calibration block")
    args = ap.parse_args()
    draft, out = args.pair / "draft", args.out
    target = args.target or args.pair / "target"
    formats = args.formats.split(",")
    serving = [v for v in args.serving.split(",") if v]
    chat = ["--apply-chat-template"] if args.apply_chat_template else []
    other_target = [v for v in serving if "+target=" in v]
    same_target = [v for v in serving if v not in other_target]
    for directory in (out, args.card):
        if directory is not None and directory.exists() and any(directory.iterdir()):
            print(f"Error: {directory} exists and is not empty", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    quantized = [] if args.no_readback else formats
    for fmt in quantized:
        qstream("quantize", "--model_dir", str(draft), "--output_dir", str(out / f"draft-{fmt}"),
                "--quant_format", fmt)  # fmt: skip
    readback = [f"{fmt}-ckpt={out / f'draft-{fmt}'}" for fmt in quantized]
    names = ["bf16", *formats, *(v.split("=")[0] for v in readback)]
    common = ["--model", str(draft), "--target", str(target)]
    tokenizer = ["--tokenizer", str(target / "tokenizer.json")]
    qstream("speculate", *common, "--prompts", str(args.prompts), "--new-tokens",
            str(args.new_tokens), "--dtype", "float32", *chat,
            "--formats", ",".join(["bf16", *formats, *same_target]),
            *(x for v in readback for x in ("--variant", v)), "--capture", str(out / "capture"),
            "--json", str(out / "speculate.json"))  # fmt: skip
    if other_target:  # --capture needs one target for every variant: these decode apart
        qstream("speculate", *common, "--prompts", str(args.prompts), "--new-tokens",
                str(args.new_tokens), "--dtype", "float32", *chat,
                "--formats", ",".join(["bf16", *other_target]),
                "--json", str(out / "speculate-target.json"))  # fmt: skip
    for name, spec in zip(names, [None, *formats, *readback]):
        selection = ["--formats", name] if spec in (None, *formats) else ["--formats", "", "--variant", spec]  # fmt: skip
        qstream("eval-drift", *common, *tokenizer, "--states", str(out / "capture"), "--states-anchors",
                str(out / "capture" / f"anchors-{name}.json"), *selection, "--acceptance",
                "--json", str(out / f"visited-{name}.json"))  # fmt: skip
    variants = [
        "--formats",
        ",".join(["bf16", *formats]),
        *(x for v in readback for x in ("--variant", v)),
    ]
    blocks = ["--acceptance", "--blocks", str(args.blocks)]
    qstream("eval-drift", *common, *tokenizer, "--regime", "all", *variants, *blocks,
            "--json", str(out / "uniform-synthetic.json"))  # fmt: skip
    qstream("eval-drift", *common, *tokenizer, "--states", str(out / "capture"), *variants,
            *blocks, "--json", str(out / "uniform-states.json"))  # fmt: skip
    continuation_anchors(out, args.blocks)
    qstream("eval-drift", *common, *tokenizer, "--states", str(out / "capture"), "--states-anchors",
            str(out / "anchors-continuation.json"), *variants, "--acceptance",
            "--json", str(out / "uniform-continuation.json"))  # fmt: skip
    if args.card is not None:  # the card's inputs are kept beside it (tests/test_example_cards.py)
        card = args.card
        card.mkdir(parents=True, exist_ok=True)
        for source, name in (("uniform-synthetic", "results-synthetic"),
                             ("uniform-continuation", "results-states"), ("speculate", "speculate")):  # fmt: skip
            shutil.copyfile(out / f"{source}.json", card / f"{name}.json")
        qstream("card", str(card / "results-synthetic.json"), str(card / "results-states.json"),
                *(x for v in readback for x in ("--checkpoint", v.split("=", 1)[1])),
                "--base", str(draft), "--speculate", str(card / "speculate.json"),
                "--output", str(card / "CARD.md"))  # fmt: skip
    table = study(out, names, serving)
    table["seconds"] = round(time.perf_counter() - clock, 1)
    (out / "calibration.json").write_text(json.dumps(table, indent=2) + "\n")
    figure(table, out / "calibration.png")
    text = markdown(table)
    print(text)
    if args.doc is not None:
        splice(args.doc, text, args.section)
        png = args.doc.with_suffix(".png")
        figure(table, png if args.section is None else png.with_stem(f"{png.stem}_{args.section}"))
    return 0


def continuation_anchors(out: Path, blocks: int, seed: int = 0) -> None:
    """``blocks`` distinct anchors drawn uniformly over the decoded part of the streams (where a
    decoder drafts; eval-drift's own draw also takes anchors in the prompts)."""
    import random

    spec = json.loads((out / "speculate.json").read_text())
    runs = spec["runs"]["bf16"]
    # stream i: the prompt, the decoded tokens, then one block more (speculate --capture), so
    # every decoded position has its block in the stream
    pool = [(i, p) for i, r in enumerate(runs)
            for p in range(r["prompt_tokens"], r["prompt_tokens"] + len(r["tokens"]))]  # fmt: skip
    chosen = random.Random(seed).sample(pool, min(blocks, len(pool)))
    text = json.dumps({"blocks": sorted([list(b) for b in chosen])})
    (out / "anchors-continuation.json").write_text(text + "\n")


def _est(entry: dict) -> dict:
    return {k: entry[k] for k in ("value", "lo", "hi")}


def study(out: Path, names: list[str], serving: list[str]) -> dict:
    """Per variant: measured acceptance, eval-drift at the visited anchors, eval-drift at
    uniform anchors (simulated against the target), and each regime's drift ceiling; per
    serving configuration, its measured acceptance and paired loss."""
    spec = json.loads((out / "speculate.json").read_text())
    uniform = {}
    for part in ("synthetic", "states"):
        uniform.update(json.loads((out / f"uniform-{part}.json").read_text())["regimes"])
    continuation = json.loads((out / "uniform-continuation.json").read_text())["regimes"]["states"]
    ceilings = {**{r: uniform[r] for r in REGIMES if r != "states"}, "states": continuation}
    rows = {}
    for name in names:
        measured = spec["variants"][name]["summary"]
        visited = json.loads((out / f"visited-{name}.json").read_text())["regimes"]["states"]
        states = uniform["states"]["variants"][name]
        rows[name] = {
            "measured": _est(measured["mean_acceptance_length"]),
            "tokens_per_target_forward": _est(measured["tokens_per_target_forward"]),
            "accepted_at_least": [s["value"] for s in measured["accepted_at_least"]],
            "visited": _est(
                visited["variants"][name]["acceptance"]["target"][GREEDY.name]["emitted"]
            ),
            "uniform": _est(states["acceptance"]["target"][GREEDY.name]["emitted"]),
            "continuation": _est(
                continuation["variants"][name]["acceptance"]["target"][GREEDY.name]["emitted"]
            ),
            "measured_loss": _est(measured["loss_vs_bf16"]),
            "ceiling": {
                r: _est(block["variants"][name]["metrics"]["rollouts"]["greedy"]["ceiling"])
                for r, block in ceilings.items()
            },  # fmt: skip
        }
    measured_only = {}
    other = out / "speculate-target.json"
    other_spec = json.loads(other.read_text()) if other.exists() else {"variants": {}}
    for name in serving:
        summary = (spec if name in spec["variants"] else other_spec)["variants"][name]["summary"]
        measured_only[name] = {"measured": _est(summary["mean_acceptance_length"]),
                               "measured_loss": _est(summary["loss_vs_bf16"])}  # fmt: skip
    return {
        "variants": rows,
        "serving": measured_only,
        "settings": spec["settings"],
        "blocks": uniform["states"].get("blocks"),
        "command": shlex.join(["python", "evals/calibration.py", *sys.argv[1:]]),
    }


def _fmt(e: dict, digits: int = 2) -> str:
    return f"{e['value']:.{digits}f} [{e['lo']:.{digits}f}, {e['hi']:.{digits}f}]"


def markdown(table: dict) -> str:
    rows = table["variants"]
    lines = [
        f"Measured by `{table['command']}` in {table['seconds']:.0f} s (two CPU cores, "
        f"{time.strftime('%Y-%m-%d')}).",
        "",
        "**Acceptance, tokens per verification (≤ 8), greedy verification, 95% intervals.**",
        "",
        "| variant | measured (decoder) | eval-drift at the visited anchors | eval-drift, uniform anchors in the decoded text | eval-drift, uniform anchors (prompts too) | tokens per target forward |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {_fmt(r['measured'])} | {_fmt(r['visited'])} | "
                     f"{_fmt(r['continuation'])} | {_fmt(r['uniform'])} | "
                     f"{_fmt(r['tokens_per_target_forward'])} |")  # fmt: skip
    lines += [
        "",
        "**Greedy ceiling against the FP32 reference draft (tokens, ≤ 7), per regime, and the "
        "acceptance each format loses against bf16.**",
        "",
        "| variant | "
        + " | ".join("states (decoded text)" if g == "states" else g for g in REGIMES)
        + " | measured loss vs bf16 (paired) | eval-drift's loss vs bf16, decoded text |",
        "|---|" + "---|" * (len(REGIMES) + 2),
    ]
    base = rows["bf16"]
    for name, r in rows.items():
        loss = r["measured_loss"]
        uloss = base["continuation"]["value"] - r["continuation"]["value"]
        cells = " | ".join(_fmt(r["ceiling"][g]) for g in REGIMES)
        lines.append(
            f"| {name} | {cells} | {loss['value']:+.3f} [{loss['lo']:+.3f}, "
            f"{loss['hi']:+.3f}] | {uloss:+.3f} |"
        )
    if table["serving"]:
        lines += ["", "**Serving configurations, measured by the decoder (docs/speculate.md).**", "",
                  "| configuration | measured (decoder) | measured loss vs bf16 (paired) |",
                  "|---|---|---|"]  # fmt: skip
        for name, r in table["serving"].items():
            loss = r["measured_loss"]
            lines.append(f"| `{name}` | {_fmt(r['measured'])} | {loss['value']:+.3f} "
                         f"[{loss['lo']:+.3f}, {loss['hi']:+.3f}] |")  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(table: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = table["variants"]
    fig = Figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    names = list(rows)
    for k, (key, label) in enumerate([("measured", "measured (decoder)"),
                                      ("visited", "eval-drift, visited anchors"),
                                      ("continuation", "eval-drift, uniform (decoded text)"),
                                      ("uniform", "eval-drift, uniform (prompts too)")]):  # fmt: skip
        xs = [i + (k - 1.5) * 0.2 for i in range(len(names))]
        ys = [rows[n][key]["value"] for n in names]
        err = [[rows[n][key]["value"] - rows[n][key]["lo"] for n in names],
               [rows[n][key]["hi"] - rows[n][key]["value"] for n in names]]  # fmt: skip
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens per verification")
    ax.set_title("Acceptance under greedy verification, 95% intervals")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def splice(doc: Path, text: str, section: str | None) -> None:
    """Replace the text between the doc's markers (``calibration:SECTION:begin`` / ``:end``,
    or ``calibration:begin`` / ``calibration:end`` without a section)."""
    tag = "calibration" if section is None else f"calibration:{section}"
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    old = doc.read_text()
    if begin not in old or end not in old:
        raise SystemExit(f"Error: {doc} has no {begin} ... {end} block")
    head, _, rest = old.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{begin}\n{text}{end}{tail}")


if __name__ == "__main__":
    sys.exit(main())
