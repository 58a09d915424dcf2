"""qstream card: the card from a fixed results JSON (a real eval-drift run, 48 blocks, every
regime, tests/data/card_results.json) against a stored expected markdown; every printed number
traced back to the JSON; figures written; missing data reported, never invented; merging rules;
checkpoint tables from real quantized directories; one-line CLI errors.

Regenerate the expected markdown deliberately, when the card's format changes, with
``QSTREAM_UPDATE_GOLDEN=1 pytest tests/test_card.py`` and review the diff.
"""

import copy
import json
import os
import re
import struct
from pathlib import Path

import pytest
from card_helpers import tables
from checkpoints import DSPARK_RECIPE, dspark_tensors, write_checkpoint
from click.testing import CliRunner

from qstream.card.build import write_card
from qstream.card.checkpoints import PROVENANCE
from qstream.cli import cli
from qstream.quant import quantize_checkpoint

DATA = Path(__file__).parent / "data"
RESULTS = DATA / "card_results.json"
EXPECTED = DATA / "card_expected.md"
NUMBER = re.compile(r"[-+]?\d+\.\d+(?:e[-+]\d+)?")


def _results() -> dict:
    return json.loads(RESULTS.read_text())


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def _json_numbers(node) -> list[float]:
    if isinstance(node, bool) or node is None:
        return []
    if isinstance(node, (int, float)):
        return [float(node)]
    if isinstance(node, dict):
        return [x for v in node.values() for x in _json_numbers(v)]
    if isinstance(node, list):
        return [x for v in node for x in _json_numbers(v)]
    return []


def _renderings(values: list[float]) -> set[str]:
    """Every way the card prints a JSON number: fixed 1-4 decimals, or 3 significant digits."""
    out = {f"{x:.2e}" for x in values}
    out |= {f"{x:.{d}f}" for x in values for d in range(1, 5)}
    return out


@pytest.fixture(scope="module")
def card_md(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "CARD.md"
    card, written = write_card([RESULTS], out)
    return card, out, written


def test_card_matches_expected_markdown(card_md):
    _, out, _ = card_md
    text = out.read_text()
    if os.environ.get("QSTREAM_UPDATE_GOLDEN") == "1":
        EXPECTED.write_text(text)
    assert text == EXPECTED.read_text(), (
        "the card changed; if on purpose, regenerate with QSTREAM_UPDATE_GOLDEN=1 and review"
    )


def test_every_result_number_traces_to_the_json(card_md):
    card, _, _ = card_md
    printed = _renderings(_json_numbers(_results()["regimes"]))
    result_tables = [
        t
        for key, t in tables(card).items()
        if key.startswith(("ceiling_", "matched_prefix_", "agreement_", "metrics_"))
    ]
    assert len(result_tables) == 2 + 3 + 1
    checked = 0
    for table in result_tables:
        for row in table.rows:
            for column, cell in zip(table.columns, row):
                if "gap to bf16" in column:
                    continue
                for number in NUMBER.findall(cell.text):
                    assert number in printed, f"{table.key} {column}: {number} is not in the JSON"
                    checked += 1
    assert checked > 300


def test_ceiling_table_values_and_gaps(card_md):
    card, _, _ = card_md
    data = _results()["regimes"]
    table = tables(card)["ceiling_greedy"]
    assert [row[0].text for row in table.rows] == ["bf16", "fp8", "mxfp4", "nvfp4", "shipped-fp8"]
    for row in table.rows:
        for i, regime in enumerate(("gauss", "heavy", "boot")):
            e = data[regime]["variants"][row[0].text]["metrics"]["rollouts"]["greedy"]["ceiling"]
            value, lo, hi = (float(x) for x in NUMBER.findall(row[1 + 2 * i].text))
            assert (value, lo, hi) == tuple(round(e[k], 2) for k in ("value", "lo", "hi"))
            if row[0].text != "bf16":
                floor = data[regime]["variants"]["bf16"]["metrics"]["rollouts"]["greedy"]
                gap = e["value"] - floor["ceiling"]["value"]
                assert row[2 + 2 * i].text == f"{gap:+.3f}"
    assert "difference computed for this card" in table.caption


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_figures_are_written_and_referenced(card_md):
    _, out, written = card_md
    text = out.read_text()
    assert [p.name for p in written[1:]] == ["seq_agree.png", "ceiling.png", "kl.png"]
    for png in written[1:]:
        width, height = _png_size(png)
        assert 800 <= width <= 4000 and 400 <= height <= 3000, (png.name, width, height)
        assert png.stat().st_size > 20_000
        assert f"(CARD_files/{png.name})" in text


def _without(data: dict, regime: str | None = None, variant: str | None = None) -> dict:
    data = copy.deepcopy(data)
    if regime:
        del data["regimes"][regime]
    if variant:
        for block in data["regimes"].values():
            block["variants"].pop(variant, None)
        del data["variants"][variant]
    return data


def test_missing_regime_and_format_are_reported_not_invented(tmp_path):
    data = _without(_without(_results(), regime="boot"), variant="nvfp4")
    del data["regimes"]["gauss"]["variants"]["bf16"]
    path = _write(tmp_path / "partial.json", data)
    result = CliRunner().invoke(
        cli, ["card", str(path), "--output", str(tmp_path / "c.md"), "--no-figures"]
    )
    assert result.exit_code == 0, result.output
    for line in (
        "regime boot: not in the results",
        "format nvfp4: not in any results file",
        "variant bf16: no results for regime gauss",
        "regime gauss: no bf16 floor, so its gaps to bf16 are n/a",
    ):
        assert f"missing: {line}" in result.stderr
        assert f"- {line}" in (tmp_path / "c.md").read_text()
    card = (tmp_path / "c.md").read_text()
    assert "nvfp4" not in card.split("## Greedy acceptance ceiling")[1]
    assert "boot [95% CI]" not in card
    ceiling = card.split("**Drift-limited acceptance ceiling under greedy")[1].split("\n\n")[1]
    bf16_row = next(r for r in ceiling.splitlines() if r.startswith("| bf16 "))
    assert bf16_row.startswith("| bf16 | not evaluated | n/a |")
    fp8_row = next(r for r in ceiling.splitlines() if r.startswith("| fp8 "))
    assert fp8_row.split(" | ")[2] == "n/a"  # gauss gap: no floor to subtract


def test_default_regime_falls_back_and_says_so(tmp_path):
    path = _write(tmp_path / "gauss.json", _without(_without(_results(), "heavy"), "boot"))
    card, _ = write_card([path], tmp_path / "c.md", figures=False)
    assert "metrics_gauss" in tables(card)
    assert any("default, heavy, is not in the results" in m for m in card.missing)


def test_sampled_rollout_is_labelled_with_the_runs_own_settings(tmp_path):
    """A card from a --temperature 0.7 --top-p 0.9 run says so (it once said T=1.0, top-p 0.95
    whatever the run used), and says the 0.9 is the verifier's: the drafter samples the full
    softmax."""
    data = _results()
    data["sampling"] = {
        **data["sampling"],
        "temperature": 0.7,
        "verifier": {"top_p": 0.9, "top_k": None},
    }
    out = tmp_path / "CARD.md"
    write_card([_write(tmp_path / "t07.json", data)], out, figures=False)
    text = out.read_text()
    assert "sampled rollout (T=0.7, full softmax)" in text
    assert "verifier T=0.7, top-p 0.9, top-k off" in text
    assert "T=1.0" not in text and "top-p 1.0" not in text


def test_per_regime_files_merge_to_the_same_tables(tmp_path, card_md):
    whole, _, _ = card_md
    data = _results()
    paths = [
        _write(tmp_path / f"{r}.json", _without(_without(data, regime=o1), regime=o2))
        for r, o1, o2 in (
            ("gauss", "heavy", "boot"),
            ("heavy", "gauss", "boot"),
            ("boot", "gauss", "heavy"),
        )
    ]
    # a file given twice is harmless
    merged, _ = write_card([*paths, paths[0]], tmp_path / "merged.md", figures=False)
    for key, table in tables(whole).items():
        if key != "evaluation":
            assert tables(merged)[key].rows == table.rows, key


def _cli_error(args: list[str]) -> str:
    result = CliRunner().invoke(cli, ["card", *args])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output
    return result.stderr


def test_conflicting_duplicate_and_other_model_are_refused(tmp_path):
    data = _results()
    changed = copy.deepcopy(data)
    changed["regimes"]["heavy"]["variants"]["fp8"]["metrics"]["kl"]["p99"] *= 1.5
    other = copy.deepcopy(data)
    other["model"]["config_sha256"] = "0" * 64
    out = str(tmp_path / "c.md")
    err = _cli_error([str(RESULTS), str(_write(tmp_path / "x.json", changed)), "--output", out])
    assert "regime 'heavy', variant 'fp8' conflicts" in err
    err = _cli_error([str(RESULTS), str(_write(tmp_path / "y.json", other)), "--output", out])
    assert "different model" in err
    assert not Path(out).exists()


def test_cli_errors_are_one_line(tmp_path):
    out = str(tmp_path / "c.md")
    assert "missing results file" in _cli_error([str(tmp_path / "nope.json"), "--output", out])
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something-else"}')
    assert "not eval-drift results" in _cli_error([str(bad), "--output", out])
    gauss = _write(tmp_path / "g.json", _without(_without(_results(), "heavy"), "boot"))
    assert "--regime boot: not in the results" in _cli_error(
        [str(gauss), "--regime", "boot", "--output", out]
    )
    assert "does not exist" in _cli_error([str(RESULTS), "--output", str(tmp_path / "no/c.md")])


def test_checkpoint_that_is_not_quantized_is_refused(tmp_path):
    base = write_checkpoint(tmp_path / "base", dspark_tensors())
    err = _cli_error([str(RESULTS), "--checkpoint", str(base), "--output", str(tmp_path / "c.md")])
    assert "no quantization_config" in err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    base = write_checkpoint(root / "base", dspark_tensors())
    quantize_checkpoint(base, root / "fp8", "fp8", include=DSPARK_RECIPE)
    quantize_checkpoint(
        base, root / "mxfp4", "mxfp4", include=DSPARK_RECIPE, skip_incompatible=True
    )
    for name in ("fp8", "mxfp4"):  # as if written by another tool: the card must reconstruct
        (root / name / "qstream_quantize.json").unlink()
    return root


def test_size_and_quantization_tables_come_from_the_directories(checkpoints, tmp_path):
    root = checkpoints
    card, _ = write_card(
        [RESULTS],
        tmp_path / "c.md",
        checkpoints=[root / "fp8", root / "mxfp4"],
        base=root / "base",
        figures=False,
    )
    t = tables(card)
    files = {
        name: sum(p.stat().st_size for p in (root / name).glob("*.safetensors"))
        for name in ("base", "fp8", "mxfp4")
    }
    for row in t["size"].rows:
        assert row[2].data == files[row[0].text]
        assert row[4].text == f"{100 * files[row[0].text] / files['base']:.1f}%"
    params = t["quantized_fp8"].rows[0][1].data
    assert params["quantized"] == 5 * (3 * 96 * 64 + 96 * 48 + 64 * 48) + 64 * 320
    kept = {row[0].text: row[4].text for row in t["kept_mxfp4"].rows}
    assert kept["layers.*.self_attn.q_b_proj"].startswith("shape rule: K=48")
    assert kept["layers.*.self_attn.q_a_proj"].startswith("not selected; fused group")
    assert kept["layers.*.input_layernorm"].startswith("1-D weight")
    md = (tmp_path / "c.md").read_text()
    assert "Reconstructed from `config.json`" in md
    command = next(line for line in md.splitlines() if "--quant_format mxfp4" in line).split()
    assert command[command.index("--include_layers") + 1 :] == [
        "context_proj",
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    ]  # checkpoint order
    assert not any("no --checkpoint" in m for m in card.missing)


def test_recorded_command_is_used_when_present(checkpoints, tmp_path):
    qdir = tmp_path / "fp8"
    qdir.mkdir()
    for f in (checkpoints / "fp8").iterdir():
        (qdir / f.name).write_bytes(f.read_bytes())
    command = "qstream-quantize --model_dir base --output_dir fp8 --quant_format fp8 --workers 2"
    (qdir / PROVENANCE).write_text(
        json.dumps({"command": command, "summary": {}, "qstream_version": "9.9.9"})
    )
    write_card([RESULTS], tmp_path / "c.md", checkpoints=[qdir], figures=False)
    md = (tmp_path / "c.md").read_text()
    assert f"```\n{command}\n```" in md and "by qstream 9.9.9" in md


def test_json_and_html_formats(tmp_path):
    runner = CliRunner()
    out = tmp_path / "card.json"
    result = runner.invoke(
        cli,
        [
            "card",
            str(RESULTS),
            "--output",
            str(out),
            "--format",
            "json",
            "--regime",
            "boot",
            "--no-figures",
        ],
    )
    assert result.exit_code == 0, result.output
    card = json.loads(out.read_text())
    assert card["schema"] == "qstream.card/1"
    by_key = {t["key"]: t for s in card["sections"] for t in s["tables"]}
    row = next(r for r in by_key["matched_prefix_sampled"]["rows"] if r["variant"] == "nvfp4")
    nvfp4 = _results()["regimes"]["heavy"]["variants"]["nvfp4"]["metrics"]
    assert row["heavy [95% CI]"] == nvfp4["rollouts"]["sampled"]["matched_prefix"]
    assert "metrics_boot" in by_key
    assert not any(s["figures"] for s in card["sections"])
    assert not (tmp_path / "card_files").exists()
    html_out = tmp_path / "card.html"
    result = runner.invoke(
        cli, ["card", str(RESULTS), "--output", str(html_out), "--format", "html"]
    )
    assert result.exit_code == 0, result.output
    page = html_out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<table>") == 7
    assert '<img src="card_files/ceiling.png"' in page
    assert (tmp_path / "card_files" / "kl.png").is_file()


def test_variants_quantizing_different_tensors_say_so(tmp_path):
    """Formats are ranked like for like only on the same tensors: when a variant quantized a
    different set (e.g. MXFP4 leaving K % 32 != 0 weights in bf16), its row label says so."""
    data = _results()
    for block in data["regimes"].values():
        block["variants"]["mxfp4"]["quantized_tensors"] = block["variants"]["mxfp4"][
            "quantized_tensors"
        ][:16]
    out = tmp_path / "CARD.md"
    card = write_card([_write(tmp_path / "sets.json", data)], out, figures=False)[0]
    rows = [row[0].text for row in tables(card)["ceiling_greedy"].rows]
    assert rows[2] == "mxfp4 (quantizes 16 tensors; quantized sets differ)"
    assert rows[1] == "fp8 (quantizes 26 tensors; quantized sets differ)"
    assert rows[0] == "bf16"
    same = write_card([RESULTS], tmp_path / "SAME.md", figures=False)[0]
    assert [r[0].text for r in tables(same)["ceiling_greedy"].rows][2] == "mxfp4"
