"""vLLM's loading decision for a DSpark draft, replayed (docs/vllm.md): for every runtime
Linear layer (and ParallelLMHead built with the quant config), the scheme vLLM picks (ignore entries matched exactly or as ``re:`` regexes), the
parameters that scheme expects from each checkpoint shard, and whether the checkpoint stores
exactly those; the modules vLLM never quantizes; what it does at the tensor-parallel size.
``qstream.vllm.verify`` reports what this finds."""

from __future__ import annotations

from dataclasses import dataclass, field

from qstream.checkpoint.files import Checkpoint
from qstream.errors import QStreamError
from qstream.formats import FORMATS
from qstream.vllm import profiles as serving
from qstream.vllm.patterns import matches
from qstream.vllm.profiles import Profile, RuntimeModule


@dataclass
class Replay:
    """What the replay found, for one L and one tensor-parallel size."""

    target_layers: int  # L used for the draft's runtime names
    tensor_parallel_size: int
    # vLLM's decision per runtime Linear layer: {"module", "shards", "scheme", "why"}
    runtime_modules: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def matches_ignore(entry: str, module: str) -> bool:
    """compressed-tensors / vLLM semantics for ignore entries: equal, or ``re:`` regex."""
    return matches(entry, module) if entry.startswith("re:") else entry == module


def draft_target_layers(checkpoint: Checkpoint, given: int | None) -> int:
    if given is not None:
        if given < 0:
            raise QStreamError(f"--target-layers {given}: must be at least 0")
        return given
    value = serving.target_layers_of(checkpoint.config)
    if value is None:
        raise QStreamError(
            f"{checkpoint.directory / 'config.json'}: no integer "
            "target_num_hidden_layers; pass the target checkpoint (--target DIR) or its "
            "layer count (--target-layers L)"
        )
    return value


def replay_vllm(
    checkpoint: Checkpoint,
    fmt: str,
    profile: Profile,
    holders: list[str],
    quantized: set[str],
    targets_ignore: tuple[list, list],
    report: Replay,
) -> None:
    """vLLM's decision for every runtime Linear layer of the draft (docs/vllm.md), against
    what the checkpoint stores for each of its shards; and the modules vLLM never quantizes."""
    runtime = serving.runtime_modules(profile, holders, report.target_layers)
    for rt in runtime:
        scheme, why = _vllm_scheme(rt, fmt, *targets_ignore)
        report.runtime_modules.append(
            {"module": rt.name, "shards": list(rt.shards), "scheme": scheme, "why": why}
        )
        for shard in rt.shards:
            line = _shard_mismatch(checkpoint, fmt, rt, shard, scheme, why, shard in quantized)
            if line:
                report.problems.append(line)
    for module in holders:
        never = serving.never_quantized(profile, module)
        if never and module in quantized:
            report.problems.append(
                f"{module}: stored {fmt}, but vLLM never quantizes it "
                f"({never}); it must keep the base dtype"
            )
        head = serving.head_problem(profile, module, fmt, checkpoint.config)
        if head and module in quantized:
            report.problems.append(f"{module}: stored {fmt}, but {head}")
    _replay_tp(checkpoint, fmt, profile, holders, quantized, report)


def _replay_tp(
    checkpoint: Checkpoint,
    fmt: str,
    profile: Profile,
    holders: list[str],
    quantized: set[str],
    report: Replay,
) -> None:
    """What vLLM 0.32.0 does with the draft at the tensor-parallel size (docs/vllm.md): it
    cannot build a draft whose heads or split dimensions do not divide by it, and it gives an
    FP4 row-parallel shard that is not a whole number of blocks the wrong block scales."""
    tp = report.tensor_parallel_size
    shapes = {m: _logical_shape(checkpoint, fmt, m, m in quantized) for m in holders}
    cannot = serving.tp_build_problem(profile, checkpoint.config, shapes, tp)
    if cannot:
        report.problems.append(
            f"vLLM 0.32.0 cannot build the draft at tensor_parallel_size {tp}: {cannot}"
        )
        return
    block = FORMATS[fmt].block_size
    for module in holders:
        shape = shapes[module]
        why = (
            serving.tp_scale_problem(profile, module, shape[1], block, tp)
            if module in quantized and len(shape) == 2
            else None
        )
        if why:
            report.problems.append(f"{module}: stored {fmt}, but {why}")


def _logical_shape(
    checkpoint: Checkpoint, fmt: str, module: str, stored_quantized: bool
) -> tuple[int, ...]:
    """[N, K] of ``module``'s weight as vLLM sizes its layer (packed codes unpacked)."""
    spec = FORMATS[fmt]
    packed = stored_quantized and spec.codes_per_byte > 1
    name = f"{module}.{spec.stored[0] if packed else 'weight'}"
    if name not in checkpoint.tensor_shard:
        return ()
    shape = tuple(checkpoint.info(name).shape)
    if not packed:
        return shape
    n, packed_k = shape
    return (n, packed_k * spec.codes_per_byte)


def _vllm_scheme(
    rt: RuntimeModule, fmt: str, targets: list, ignore: list
) -> tuple[str | None, str]:
    """compressed-tensors in vLLM: a Linear layer is ignored iff an ignore entry equals its
    name or is ``re:`` + a regex that re.match-es it; otherwise it takes the group's scheme if a
    target names its class ("Linear" matches every Linear class) or matches its name."""
    hit = next((e for e in ignore if matches_ignore(e, rt.quant_name)), None)
    if hit is not None:
        return None, f"ignore entry {hit!r} matches {rt.quant_name}"
    if ("Linear" in targets and rt.linear) or any(
        matches_ignore(t, rt.quant_name) for t in targets
    ):
        return fmt, f"no ignore entry matches {rt.quant_name}"
    if not rt.linear:  # CompressedTensorsConfig.get_quant_method, find_matched_target
        return None, f"no config group target names the ParallelLMHead {rt.quant_name}"
    return None, f"no config group target matches {rt.quant_name}"


def _shard_mismatch(
    checkpoint: Checkpoint,
    fmt: str,
    rt: RuntimeModule,
    shard: str,
    scheme: str | None,
    why: str,
    stored_quantized: bool,
) -> str | None:
    expects = ", ".join(FORMATS[fmt].stored)
    if scheme is not None and not stored_quantized:
        name = f"{shard}.weight"
        have = (
            f"{checkpoint.info(name).dtype} {list(checkpoint.info(name).shape)} {name}"
            if name in checkpoint.tensor_shard
            else "no weight"
        )
        return (
            f"{rt.name}: vLLM builds it {fmt} ({why}) and expects {shard}.{{{expects}}}, "
            f"but the checkpoint has {have}"
        )
    if scheme is None and stored_quantized:
        return (
            f"{rt.name}: vLLM builds it unquantized ({why}) and expects {shard}.weight in "
            f"the base dtype, but the checkpoint stores {shard}.{{{expects}}}"
        )
    return None
