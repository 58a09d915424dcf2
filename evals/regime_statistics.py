"""Do the synthetic aux regimes look like a real target's states? (docs/calibration.md, "The
regimes against SmolLM2's states").  Per aux layer, the statistics of what the draft reads that
matter for quantizing what reads it: each channel's RMS over the tokens (sorted), the largest
channel RMS over the median one, each token's crest factor (max |h| over the token's RMS), the
share of the energy in the top channels, and the kurtosis of all values.  The same statistics
for what each synthetic regime feeds the draft at the same token positions, made by qstream's
own regime code (``qstream.eval.batches.AuxStates``, as eval-drift gets them), in the bf16
eval-drift hands the draft:

    python evals/regime_statistics.py --states CAPTURE --model DRAFT --target TARGET \\
        --json stats.json --figure docs/regime_statistics.png

It prints a table, writes the numbers as JSON and one figure panel per aux layer (each regime's
sorted channel RMS over its median channel's).  Every position of each stream but the last is
taken (the context of a block anchored at the stream's end); the captured states are also
reported without each stream's first position (``states[1:]``), where a pretrained target
keeps its massive activations, and so is heavy (``heavy[1:]``), which draws a sink there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from qstream.arch.family import load_noting_embed
from qstream.arch.interface import DraftConfig
from qstream.arch.registry import architecture_of, load_config
from qstream.errors import QStreamError
from qstream.eval.batches import AuxStates, check_boot_compatible, make_batches
from qstream.eval.corpus import AnchorPlan, Corpus
from qstream.eval.states import CapturedStates, read_states
from qstream.regimes import REGIMES, STATES, Regime
from qstream.serving import REFERENCE_VARIANT

TOP_K = 8  # the energy share of the largest TOP_K channels, beside the largest one's
CREST_QUANTILES = (0.5, 0.99)  # of the per-token crest factor, beside its max
# the captured states without each stream's first position, where a pretrained target's massive
# activations sit (Sun et al., "Massive Activations in Large Language Models", 2024)
AFTER_FIRST = "states[1:]"


def layer_statistics(x: torch.Tensor, top_k: int = TOP_K) -> dict:
    """The statistics of one aux layer's states ``x`` [N tokens, H channels], in float64."""
    x = x.double()
    energy = x.pow(2).mean(0)  # [H] each channel's mean square over the tokens
    channel_rms = energy.sqrt().sort(descending=True).values
    median = torch.quantile(channel_rms, 0.5)
    token_rms = x.pow(2).mean(1).sqrt()  # [N]
    live = token_rms > 0
    crest = x.abs().amax(1)[live] / token_rms[live]
    share = energy.sort(descending=True).values.cumsum(0) / energy.sum()
    centred = x - x.mean()
    return {
        "rms": float(energy.mean().sqrt()),
        "max_abs": float(x.abs().max()),
        "max_over_median_channel_rms": float(channel_rms[0] / median),
        # the spread of log channel RMS: heavy draws it as HEAVY_SIGMA (qstream/eval/batches.py)
        "channel_rms_log_sd": float(channel_rms[channel_rms > 0].log().std()),
        "crest": {
            **{f"p{round(q * 100)}": float(torch.quantile(crest, q)) for q in CREST_QUANTILES},
            "max": float(crest.max()),
        },
        "top1_energy_share": float(share[0]),
        f"top{top_k}_energy_share": float(share[top_k - 1]),
        "kurtosis": float(centred.pow(4).mean() / centred.pow(2).mean().pow(2)),
        "channel_rms_sorted": channel_rms.tolist(),
    }


def whole_streams(corpus: Corpus) -> AnchorPlan:
    """One block per stream, anchored at its last token: its context is every other position."""
    last = torch.tensor([s.numel() - 1 for s in corpus.streams])
    return AnchorPlan(torch.arange(len(last)), last)


def regime_aux(
    regime: Regime, corpus: Corpus, config: DraftConfig, seed: int, reference=None
) -> list[torch.Tensor]:
    """What ``regime`` feeds the draft at ``corpus``'s positions, [T_s - 1, A] per stream, in
    AuxStates' dtype: the captured states when ``corpus`` is :class:`CapturedStates`; boot's
    need the FP32 ``reference``."""
    plan, rows = whole_streams(corpus), {}
    aux = AuxStates(regime, corpus, config, seed)
    try:
        for batch in make_batches(plan, corpus, config):
            got = aux.get(batch, reference)
            if not isinstance(got, torch.Tensor):
                raise SystemExit(f"Error: {regime.name}: a batch too large to hold; fewer streams")
            for row, stream in enumerate(batch.streams):
                rows[stream] = got[row, : corpus.streams[stream].numel() - 1]
    finally:
        aux.close()
    return [rows[s] for s in sorted(rows)]  # in stream order, however batched


def statistics(
    states: CapturedStates,
    config: DraftConfig,
    regimes: list[str],
    seed: int,
    reference=None,
) -> dict[str, list[dict]]:
    """Per regime (``states`` first, then the same without each stream's first position, as
    for heavy, which draws a sink there), the statistics of each aux layer; the synthetic regimes over the captured token streams (a
    plain corpus: AuxStates reads captured states from a :class:`CapturedStates` whatever the
    regime)."""
    tokens = Corpus(states.name, states.sha256, states.streams, states.tokenizer)
    shape = (config.num_target_layers, config.target_hidden_size)

    def per_layer(aux: torch.Tensor) -> list[dict]:
        layers = aux.unflatten(-1, shape)
        return [layer_statistics(layers[:, i]) for i in range(layers.shape[1])]

    captured = regime_aux(STATES, states, config, seed)
    out = {STATES.name: per_layer(torch.cat(captured))}
    out[AFTER_FIRST] = per_layer(torch.cat([rows[1:] for rows in captured]))
    for name in regimes:
        aux = regime_aux(REGIMES[name], tokens, config, seed, reference)
        out[name] = per_layer(torch.cat(aux))
        if REGIMES[name].channel_scales:  # heavy draws a sink at position 0: compare without it
            out[f"{name}[1:]"] = per_layer(torch.cat([rows[1:] for rows in aux]))
    return out


def table(stats: dict[str, list[dict]], layer_ids: list[int]) -> list[str]:
    """A markdown table: one row per aux layer and regime."""
    lines = [
        "| layer | regime | RMS | max abs | max/median channel RMS | log-sd channel RMS | "
        f"crest p50 / p99 / max | top-1 / top-{TOP_K} energy | kurtosis |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, layer in enumerate(layer_ids):
        for name, per_layer in stats.items():
            s, c = per_layer[i], per_layer[i]["crest"]
            lines.append(
                f"| {layer} | {name} | {s['rms']:.3g} | {s['max_abs']:.3g} | "
                f"{s['max_over_median_channel_rms']:.1f} | {s['channel_rms_log_sd']:.2f} | "
                f"{c['p50']:.1f} / {c['p99']:.1f} / {c['max']:.1f} | "
                f"{s['top1_energy_share']:.2f} / {s[f'top{TOP_K}_energy_share']:.2f} | "
                f"{s['kurtosis']:.3g} |"
            )
    return lines


def figure(stats: dict[str, list[dict]], layer_ids: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = iter(f"C{n}" for n in range(10))
    styles: dict[str, str] = {}
    for n in stats:  # a regime without each stream's first position: its own colour, dashed
        whole = n.removesuffix("[1:]")
        styles[n] = styles[whole][:-1] + "--" if whole in styles else next(colours) + "-"
    fig, axes = plt.subplots(1, len(layer_ids), figsize=(3 * len(layer_ids), 3.2), sharey=True)
    for i, (ax, layer) in enumerate(zip(axes, layer_ids)):
        for name, per_layer in stats.items():
            rms = torch.tensor(per_layer[i]["channel_rms_sorted"])
            x, y = torch.arange(1, len(rms) + 1), rms / torch.quantile(rms, 0.5)
            ax.loglog(x, y, styles[name], label=name, linewidth=1.2)
        ax.set_title(f"aux layer {layer} (layer output)", fontsize=9)
        ax.set_xlabel("channel rank", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("channel RMS / median channel RMS", fontsize=8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    try:
        run()
    except QStreamError as e:
        raise SystemExit(f"Error: {e}") from None


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", required=True, help="captured states (qstream capture's output)")
    ap.add_argument("--model", required=True, help="the draft directory")
    ap.add_argument("--target", help="the target (lm_head and embeddings, as eval-drift's)")
    ap.add_argument("--regimes", default="gauss,heavy,boot", help="synthetic regimes to compare")
    ap.add_argument("--seed", type=int, default=0, help="eval-drift's --seed (heavy's scales)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--figure", type=Path, required=True)
    args = ap.parse_args()
    regimes = [r for r in args.regimes.split(",") if r]
    for name in regimes:
        if name not in REGIMES or REGIMES[name].captured:
            raise SystemExit(f"Error: --regimes {name!r}: choose from gauss, heavy, boot")
    config = load_config(args.model)
    states = read_states(args.states, config, target=args.target)
    reference = None
    if any(REGIMES[r].causal for r in regimes):
        check_boot_compatible(config)
        arch = architecture_of(config)
        weights, _ = load_noting_embed(arch, args.model, args.target, config)
        reference = arch.build(config, weights, REFERENCE_VARIANT, "cpu")
    stats = statistics(states, config, regimes, args.seed, reference)
    layer_ids = list(config.target_layer_ids)
    print("\n".join(table(stats, layer_ids)))
    positions = sum(s.numel() - 1 for s in states.streams)
    record = {
        "states": args.states,
        "model": args.model,
        "seed": args.seed,
        "layer_ids": {"convention": "layer-output", "ids": layer_ids},
        "streams": len(states.streams),
        "positions": positions,
        "dtype": "bfloat16 (what eval-drift hands the draft)",
        "regimes": stats,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    figure(stats, layer_ids, args.figure)


if __name__ == "__main__":
    main()
