"""The decoder's own streams as a capture, and the anchors each variant's decoder visited
(docs/speculate.md, "At the anchors the decoder visited"): ``qstream speculate --capture DIR``.

Under greedy verification every variant emits the target's own greedy continuation, so one
capture serves them all: stream i is prompt i, the decoded tokens, then the target's greedy
tokens for one more block (the last anchor's block must exist in the stream). Its states come
from one teacher-forced target forward, written in qstream's layout (docs/capture.md), and
``anchors-NAME.json`` names the blocks variant NAME drafted, for ``eval-drift --states DIR
--states-anchors DIR/anchors-NAME.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qstream.capture.hooks import LayerTap
from qstream.capture.layout import record_streams, start_output, write_batch
from qstream.capture.target import LoadedTarget, decoder_parts
from qstream.errors import QStreamError
from qstream.eval.states.layouts import QSTREAM
from qstream.publish import check_outside, check_parent, publishing, write_json_atomic
from qstream.speculate.decode import Decoded, target_greedy


def check_capture_dir(output: Path, rule: str, inputs: dict[str, str]) -> None:
    """Before any decoding: a greedy run, and a directory that is absent or empty, outside the
    ``inputs`` (option -> directory), in a writable directory."""
    if rule != "greedy":
        raise QStreamError(
            f"--capture needs --rule greedy (got {rule}): only then is one stream every "
            "variant's output"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise QStreamError(f"--capture {output}: exists and is not an empty directory")
    check_outside(output, "--capture", inputs)
    check_parent(output, "--capture", "parent directory")


def write_capture(
    output: Path,
    target: LoadedTarget,
    layer_ids: tuple[int, ...],
    block_size: int,
    prompts: list[list[int]],
    runs: dict[str, list[Decoded]],
    record: dict[str, Any],
) -> None:
    """The streams, their states and capture.json, then one anchors file per variant: built in
    a temporary directory beside ``output`` and published with one rename, or not at all."""
    first, *others = runs
    for name in others:
        for i, (a, b) in enumerate(zip(runs[first], runs[name])):
            if a.tokens != b.tokens:
                t = next(k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
                raise QStreamError(
                    f"prompt {i}: variants {first} and {name} emitted different tokens at "
                    f"{t} under greedy verification, where both must be the target's own"
                )
    with publishing(output, False, "--capture") as tmp:
        start_output(tmp, record)
        layers, norm = decoder_parts(target.model)
        for i, (prompt, run) in enumerate(zip(prompts, runs[first])):
            head = prompt + run.tokens
            row = head + target_greedy(target.model, head, block_size + 1)
            with torch.no_grad(), LayerTap(layers, norm, layer_ids) as tap:
                target.model.model(input_ids=torch.tensor([row], device=target.device))
            meta = {"document": str(i), "prompt_tokens": str(len(prompt))}
            write_batch(tmp, QSTREAM, [i], [row], tap, [meta])
            record_streams(tmp, record, [QSTREAM.stream_file(i)])
        for name, decoded in runs.items():
            blocks = [[i, p] for i, r in enumerate(decoded) for p in r.anchors]
            record = {"variant": name, "blocks": blocks}
            write_json_atomic(tmp / f"anchors-{name}.json", record, indent=None)
