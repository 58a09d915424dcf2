"""Tiny real-architecture Hugging Face targets for the capture tests (built by
``examples/make_tiny_target.py``: Llama and DeepSeek-V3 from a config, random weights, fixed
seed, a BPE tokenizer; nothing downloaded) and a draft config.json shaped for them."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

from qstream.arch.dspark_mla import PRESETS

_EXAMPLE = Path(__file__).parent.parent / "examples" / "make_tiny_target.py"
_spec = importlib.util.spec_from_file_location("make_tiny_target", _EXAMPLE)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

VOCAB, HIDDEN, LAYERS = _module.VOCAB, _module.HIDDEN, _module.LAYERS
make_target = _module.make_target


def make_draft_config(directory: Path, layer_ids=(0, 2, 3), layers: int = LAYERS) -> Path:
    """A draft config.json shaped for the tiny targets (capture reads only the config)."""
    config = replace(
        PRESETS["tiny"],
        hidden_size=HIDDEN,
        target_hidden_size=HIDDEN,
        vocab_size=VOCAB,
        target_num_hidden_layers=layers,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=len(layer_ids),
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return directory


QWEN3_ROPE_THETA = 500000.0  # not transformers' default (10000), so a copied value shows


def make_qwen3_target(
    directory: Path, seed: int = 0, layers: int = LAYERS, head_dim: int = 16
) -> Path:
    """A tiny transformers Qwen3 target (``Qwen3ForCausalLM``, model_type ``qwen3``): GQA with
    2 query heads per key/value head, ``head_dim`` (vLLM's CPU attention needs 32 or more),
    untied lm_head, random weights from ``seed``, saved with ``save_pretrained`` beside the
    same BPE tokenizer as the others."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qstream.synth.corpus import builtin_corpus, train_tokenizer, write_tokenizer

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN3_ROPE_THETA},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(train_tokenizer(builtin_corpus(n=600, seed=seed), VOCAB), directory)
    return directory
