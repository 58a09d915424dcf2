"""Device support on the CPU (docs/eval-drift.md, "Devices" and "Memory"): a weight held in
bf16 and upcast per use gives bit-identical results to the same weight held in fp32; the
reference runs with TF32 and reduced-precision reductions off and the settings are restored
after; ``--device cuda`` without CUDA is one error line.  tests/test_cuda.py runs on a GPU."""

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

import qstream.arch.weights as weights_module
from qstream.arch.dspark_mla import PRESETS, load_weights
from qstream.arch.dspark_mla.model import LM_HEAD, DSpark
from qstream.arch.markov import rollout
from qstream.cli import cli
from qstream.device import exact_math, math_settings, resolve_device
from qstream.errors import QStreamError
from qstream.eval.drift import DriftSettings, evaluate_drift
from qstream.eval.variants import Variant, variant_weights
from tests.model_helpers import random_model_weights


def _uneven_chunks(monkeypatch):
    """Every bf16 weight of an fp32 model upcast per use, in row chunks of 40 rows (40 divides
    no dimension of the tiny preset).  Chunks of 7 rows are not bit-identical here: this CPU's
    GEMM takes another path for so few output columns (docs/eval-drift.md, "Memory")."""
    monkeypatch.setattr(weights_module, "HOLD_ELEMENTS", 0)
    monkeypatch.setattr(weights_module, "UPCAST_CHUNK_ELEMENTS", 0)
    monkeypatch.setattr(weights_module, "UPCAST_MIN_ROWS", 40)


@pytest.fixture
def upcast_everything(monkeypatch):
    _uneven_chunks(monkeypatch)


def _drafts(model: DSpark, cfg):
    gen = torch.Generator().manual_seed(7)
    aux = torch.randn(3, 20, cfg.aux_size, generator=gen).bfloat16()
    ctx = model.context(aux)
    stream, anchor = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 5, 19, 3, 20])
    first = torch.tensor([1, 2, 3, 4, 5])
    blocks = model.draft(ctx, stream, anchor, first)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    return [*ctx.latent, *ctx.rope_key, blocks.logits_base, blocks.hidden,
            rollout(model, blocks).logits, model.causal_hidden(ids)]  # fmt: skip


def test_bf16_held_reference_is_bit_identical_to_fp32_held(upcast_everything):
    cfg = PRESETS["tiny"]
    bf16 = {k: v.bfloat16() for k, v in random_model_weights(cfg, seed=3).items()}
    held_fp32 = DSpark(cfg, {k: v.float() for k, v in bf16.items()}, torch.float32)
    upcast = DSpark(cfg, bf16, torch.float32)
    # held once: the reference's storage is the caller's bf16 tensor itself
    assert upcast.w.stored[LM_HEAD].data_ptr() == bf16[LM_HEAD].data_ptr()
    assert all(t.dtype == torch.bfloat16 for t in upcast.w.stored.values())
    for a, b in zip(_drafts(held_fp32, cfg), _drafts(upcast, cfg)):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.slow  # two whole evaluations: CI's slow lane (pyproject.toml)
def test_evaluation_unchanged_by_how_weights_are_held(tiny, corpus, monkeypatch):
    settings = DriftSettings(regime=("gauss", "boot"), blocks=48, seed=4, acceptance=True)
    default = evaluate_drift(replace(settings, model=tiny), corpus)
    _uneven_chunks(monkeypatch)
    chunked = []
    linear = weights_module.ComputeWeights.linear

    def spy(self, name, x):
        n, k = self.stored[name].shape
        chunked.append(self.upcast_per_use(name) and weights_module.UPCAST_MIN_ROWS < n)
        return linear(self, name, x)

    monkeypatch.setattr(weights_module.ComputeWeights, "linear", spy)
    assert evaluate_drift(replace(settings, model=tiny), corpus) == default
    assert any(chunked)  # the patched constants steered some product to row chunks


def test_variants_share_unquantized_tensors(tiny):
    reference = load_weights(tiny)
    settings = DriftSettings(regime=("gauss",), formats=("fp8",))
    cfg = PRESETS["tiny"]
    weights, changed = variant_weights(
        Variant("fp8", "simulated", "fp8"), reference, cfg, settings, None
    )
    assert changed and all(weights[k] is not reference[k] for k in changed)
    assert all(weights[k] is reference[k] for k in reference if k not in changed)


def _flags():
    matmul = torch.backends.cuda.matmul
    return (matmul.fp32_precision, torch.backends.cudnn.fp32_precision,
            matmul.allow_bf16_reduced_precision_reduction)  # fmt: skip


@pytest.fixture
def permissive_math():
    """TF32 and reduced-precision reductions on, as a user's script may leave them."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = _flags()
    matmul.fp32_precision = cudnn.fp32_precision = "tf32"
    matmul.allow_bf16_reduced_precision_reduction = True
    yield _flags()
    matmul.fp32_precision, cudnn.fp32_precision = saved[0], saved[1]
    matmul.allow_bf16_reduced_precision_reduction = saved[2]


def test_exact_math_turns_tf32_off_and_restores(permissive_math):
    with exact_math():
        inside = math_settings()
    assert inside["cuda_matmul_fp32_precision"] == inside["cudnn_fp32_precision"] == "ieee"
    assert not inside["cuda_bf16_reduced_precision_reduction"]
    assert not inside["cuda_fp16_reduced_precision_reduction"]
    assert _flags() == permissive_math
    with pytest.raises(RuntimeError), exact_math():
        raise RuntimeError("a pass that fails")
    assert _flags() == permissive_math


def test_reference_pass_runs_with_tf32_off(tiny, corpus, permissive_math, monkeypatch):
    seen = []
    draft = DSpark.draft

    def spy(self, *args, **kwargs):
        seen.append((self.dtype, torch.backends.cuda.matmul.fp32_precision,
                     torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction))  # fmt: skip
        return draft(self, *args, **kwargs)

    monkeypatch.setattr(DSpark, "draft", spy)
    settings = DriftSettings(regime=("gauss",), formats=("bf16",), blocks=8)
    results = evaluate_drift(replace(settings, model=tiny), corpus)
    assert {dtype for dtype, *_ in seen} == {torch.float32, torch.bfloat16}
    assert all(precision == "ieee" and not reduced for _, precision, reduced in seen)
    assert _flags() == permissive_math
    compute = results["compute"]
    assert compute["device"] == "cpu" and compute["math"]["cuda_matmul_fp32_precision"] == "ieee"


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cuda0", ""])
def test_bad_device_names(text):
    with pytest.raises(QStreamError, match="expected cpu, cuda or cuda:N"):
        resolve_device(text)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
@pytest.mark.parametrize("command", ["eval-drift", "synth", "capture"])
def test_cuda_without_cuda_is_one_error_line(tiny, tmp_path, command):
    args = {
        "eval-drift": ["eval-drift", "--model", str(tiny), "--blocks", "4", "--device", "cuda"],
        "synth": [
            "synth",
            "--preset",
            "tiny",
            "--output_dir",
            str(tmp_path / "t"),
            "--device",
            "cuda",
        ],
        "capture": [
            "capture",
            "--target",
            str(tiny),
            "--model",
            str(tiny),
            "--output",
            str(tmp_path / "t"),
            "--device",
            "cuda",
        ],  # fmt: skip
    }[command]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(
        "Error: --device cuda: CUDA is not available"
    )
    assert not (tmp_path / "t").exists()


def test_trim_heap_gives_freed_heap_pages_back():
    """eval-drift trims the heap between batches (qstream/bounded.py).  On glibc, freed chunks
    below the mmap threshold stay resident until trimmed; after trim_heap they are gone."""
    import ctypes
    import sys

    import qstream.bounded as memory

    if not sys.platform.startswith("linux") or memory._TRIM is None:
        pytest.skip("malloc_trim is glibc's")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD (at most 32 MiB): these come from the heap
    try:
        blocks = [libc.malloc(1 << 20) for _ in range(256)]  # 256 MiB in 1 MiB blocks
        for b in blocks:
            ctypes.memset(b, 1, 1 << 20)
        keep = libc.malloc(1 << 20)  # above them: pins the heap's top, as a live tensor does
        for b in blocks:
            libc.free(b)
        before = _rss()
        memory.trim_heap()
        assert before - _rss() > 200 << 20, (before, _rss())
        libc.free(keep)
    finally:
        libc.mallopt(-3, 128 << 10)


def test_big_temporaries_are_reused_inside_a_reuse_freed_heap_hygiene():
    """eval-drift's reference passes run inside heap_hygiene(reuse_freed=True): a block above
    glibc's mmap threshold comes from the heap, so freeing and allocating it again faults no
    pages (mapped afresh, all 16,384 pages of 64 MiB fault in again, as they do once the block
    ends)."""
    import ctypes
    import resource
    import sys

    import qstream.bounded as memory

    if not sys.platform.startswith("linux") or memory._MALLOPT is None:
        pytest.skip("mallopt is glibc's")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20

    def faults_of_a_second_block() -> int:
        first = libc.malloc(size)
        ctypes.memset(first, 1, size)
        libc.free(first)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        second = libc.malloc(size)
        ctypes.memset(second, 1, size)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        libc.free(second)
        return faults

    with memory.heap_hygiene(reuse_freed=True):
        assert faults_of_a_second_block() < 1000
    assert faults_of_a_second_block() > 10_000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
