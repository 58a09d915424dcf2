"""Qwen3-style DSpark drafts for the serving tests, written on the fly (docs/vllm.md): the
``qwen3-tiny`` preset's tensor table (qstream/arch/dspark_qwen3/__init__.py) filled with seeded
bf16 N(0, 0.02^2) weights with one tensor-specific outlier each (so NVFP4 global scales differ
between tensors), ones for the norms, a valid d2t for a reduced vocabulary, and config.json in
vLLM's dense layout.  Until ``qstream synth --preset qwen3-tiny`` exists, this is the input the
tests quantize."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from qstream.arch.dspark_qwen3 import D2T, EMBED, PRESETS, Qwen3DSparkConfig, tensor_shapes

TINY = PRESETS["qwen3-tiny"]
REDUCED = replace(TINY, draft_vocab_size=512)  # a draft vocabulary half the target's


def qwen3_tensors(config: Qwen3DSparkConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(config).items():
        if name == D2T:  # draft id i -> target id 2i: d2t[i] = i
            out[name] = torch.arange(shape[0], dtype=torch.int64)
        elif len(shape) == 1:
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.randn(*shape, generator=gen) * 0.02
            w[0, 0] = 0.02 * (1 + torch.rand((), generator=gen) * 8)
            out[name] = w.to(torch.bfloat16)
    return out


def write_qwen3_draft(
    directory: Path,
    config: Qwen3DSparkConfig = TINY,
    seed: int = 0,
    embed: bool = True,
) -> Path:
    """A bf16 draft of ``config`` in ``directory`` (without embed_tokens: ``embed`` False)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = qwen3_tensors(config, seed)
    if not embed:
        del tensors[EMBED]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_json(), indent=2))
    return directory


def speculators_config(config: Qwen3DSparkConfig = TINY) -> dict:
    """``config`` in speculators' saved layout (as ``DSparkSpeculatorConfig`` writes it): the
    backbone nested in ``transformer_layer_config``, hidden-states indices for the layers."""
    backbone = ("hidden_size intermediate_size num_hidden_layers num_attention_heads "
                "num_key_value_heads head_dim vocab_size rms_norm_eps max_position_embeddings "
                "rope_parameters eos_token_id").split()  # fmt: skip
    dense = config.to_json()
    return {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "transformer_layer_config": {
            **{k: dense[k] for k in backbone if k in dense},
            "model_type": "qwen3",
        },
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "draft_vocab_size": config.draft_vocab_size,
        "block_size": config.block_slots,
        "mask_token_id": config.mask_token_id,
        "target_hidden_size": config.target_hidden_size,
        "markov_rank": config.markov_rank,
        "markov_head_type": config.markov_head_type,
        "enable_confidence_head": config.enable_confidence_head,
        "confidence_head_with_markov": config.confidence_head_with_markov,
        "sample_from_anchor": config.sample_from_anchor,
    }
