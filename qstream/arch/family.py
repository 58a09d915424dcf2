"""What every DSpark-family architecture shares (docs/model.md, "Architectures"): its drafter
kind, the block drafter (qstream/arch/markov.py), the confidence head's width hint, and the
checks of a batch of blocks and of a tensor table.  Pure Python at import: torch is imported
where a call needs it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qstream.arch.interface import TARGET_HEAD_DIR, DraftConfig, Drafter
from qstream.errors import QStreamError

if TYPE_CHECKING:
    pass

Shapes = Mapping[str, tuple[int, ...]]

CONFIDENCE_WEIGHT = "confidence_head.proj.weight"
D2T = "d2t"  # [draft_vocab] int64: target id = draft id + d2t[draft id] (vLLM's draft_id_to_target_id)


class DSparkFamily:
    """The descriptor methods the same in every DSpark (config, width hint, the heads' calls)."""

    config_type: type

    def parse_config(self, data: Mapping[str, Any]) -> Any:
        parse: Callable[[dict], Any] = getattr(self.config_type, "from_json")
        return parse(dict(data))

    def shape_hint(self, config: Any, name: str, shape: tuple[int, ...]) -> str:
        return shape_hint(config, name, shape)

    @property
    def drafter(self) -> Drafter:
        """The block drafter (qstream/arch/markov.py), imported with torch when first asked."""
        from qstream.arch.markov import BLOCK_DRAFTER

        return BLOCK_DRAFTER


def shape_hint(config: DraftConfig, name: str, shape: tuple[int, ...]) -> str:
    """Why a confidence head of the other width does not fit (vLLM 0.32 sizes the head from
    ``confidence_head_with_markov``, default false: a [1, H+r] head written without the key
    fails its loader); empty for every other mismatch."""
    H, r = config.hidden_size, config.markov_rank
    if name != CONFIDENCE_WEIGHT or not config.enable_confidence_head or r == 0:
        return ""
    if tuple(shape) == (1, H + r) and not config.confidence_head_with_markov:
        return (
            " (a [1, H+r] head: vLLM builds that width only when config.json sets "
            "confidence_head_with_markov: true)"
        )
    if tuple(shape) == (1, H) and config.confidence_head_with_markov:
        return (
            " (a [1, H] head: vLLM builds [1, H+r] because config.json sets "
            "confidence_head_with_markov: true)"
        )
    return ""


def check_blocks(vocab_size: int, lengths: Any, stream: Any, anchor: Any, first_token: Any):
    """``(stream, anchor, first_token)`` as 1-D int64 tensors of one length, every anchor
    within its stream's context ``lengths`` and every first token a vocabulary id (ValueError
    otherwise): the arguments of a model's ``draft``."""
    import torch

    stream, anchor = torch.as_tensor(stream).long(), torch.as_tensor(anchor).long()
    first_token = torch.as_tensor(first_token).long()
    if not (stream.shape == anchor.shape == first_token.shape) or stream.dim() != 1:
        raise ValueError("stream, anchor and first_token must be 1-D of equal length")
    if stream.numel() and bool((anchor > lengths[stream]).any() or (anchor < 0).any()):
        raise ValueError("every anchor p must satisfy 0 <= p <= its stream's context length")
    if first_token.numel() and not (
        0 <= int(first_token.min()) and int(first_token.max()) < vocab_size
    ):
        raise ValueError(f"first_token ids must lie in [0, {vocab_size})")
    return stream, anchor, first_token


def check_table(
    required: Shapes,
    allowed: Shapes,
    shapes: Shapes,
    where: str,
    what: str,
    hint: Callable[[str, tuple[int, ...]], str],
    why_missing: Callable[[str], str] = lambda name: "",
) -> None:
    """Every ``required`` name present, nothing outside ``allowed``, every shape exact (``hint``
    explains a wrong one): QStreamError naming the first offender and ``where`` it was found."""
    for name in required:
        if name not in shapes:
            raise QStreamError(
                f"{where}: missing tensor {name!r} (expected shape {list(required[name])}"
                f"{why_missing(name)})"
            )
    for name, shape in shapes.items():
        if name not in allowed:
            raise QStreamError(
                f"{where}: unexpected tensor {name!r} {list(shape)} "
                f"(not part of a {what} of this config)"
            )
        if tuple(shape) != allowed[name]:
            raise QStreamError(
                f"{where}: tensor {name!r} has shape {list(shape)}, expected "
                f"{list(allowed[name])}{hint(name, shape)}"
            )


def borrow_from_target(
    model_dir: Path,
    target: str | Path | None,
    names: list[str],
    expected: tuple[int, ...],
    missing: str,
    read: Callable[[Path, list[str]], dict] | None = None,
) -> dict:
    """``names`` of shape ``expected`` from ``target`` (default ``model_dir/target_head``, as synth
    writes it), read by ``read`` (default ``read_target_tensors``)."""
    if target is None:
        target = model_dir / TARGET_HEAD_DIR
        if not target.is_dir():
            raise QStreamError(
                f"{model_dir}: the draft has no {missing} of its own; pass the "
                f"target checkpoint (--target DIR) or add {TARGET_HEAD_DIR}/"
            )
    from qstream.checkpoint.read import read_target_tensors

    borrowed = (read or read_target_tensors)(Path(target), names)
    for name, tensor in borrowed.items():
        if tuple(tensor.shape) != expected:
            raise QStreamError(
                f"{target}: {name} has shape {list(tensor.shape)}, the draft needs {list(expected)}"
            )
    return borrowed


def d2t_problem(d2t: Any, vocab_size: int) -> str | None:
    """Why the stored ``d2t`` tensor is not a map of every draft id ``d`` to its own target id
    ``d + d2t[d]`` in [0, vocab_size) (None: it is).  The one check of a d2t: loading, quantize
    and verify all make it."""
    if str(d2t.dtype) not in ("torch.int64", "torch.int32"):
        return f"tensor {D2T!r} is {str(d2t.dtype).removeprefix('torch.')}, expected int64 offsets"
    target = d2t.long() + d2t.new_tensor(range(len(d2t))).long()
    bad = ((target < 0) | (target >= vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        return (f"{D2T}[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(target[i])}, "
                f"outside the target vocabulary [0, {vocab_size})")  # fmt: skip
    ids, order = target.sort(stable=True)
    same = (ids[1:] == ids[:-1]).nonzero()
    if len(same):
        i, j = int(order[int(same[0])]), int(order[int(same[0]) + 1])
        return (f"{D2T}[{j}] = {int(d2t[j])} maps draft id {j} to target id {int(target[j])}, "
                f"as {D2T}[{i}] = {int(d2t[i])} maps draft id {i}: each draft id needs its own")  # fmt: skip
    return None
