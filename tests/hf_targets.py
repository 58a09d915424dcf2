"""Tiny real-architecture Hugging Face targets for the capture tests: Llama and DeepSeek-V3
built by transformers from a config (random weights, fixed seed), saved with
``save_pretrained`` beside a byte-level BPE tokenizer trained on generated word problems, so
that nothing is downloaded and nothing outside the repository is read."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from qstream.model.config import PRESETS
from qstream.model.corpus import builtin_corpus, train_tokenizer, write_tokenizer

VOCAB = 512  # tokenizer and model vocabulary
HIDDEN = 64
LAYERS = 6


def _config(family: str):
    from transformers import DeepseekV3Config, LlamaConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2 if family == "llama" else 4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
    )
    if family == "llama":
        return LlamaConfig(**common)
    return DeepseekV3Config(
        **common,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


def make_target(directory: Path, family: str, seed: int = 0) -> Path:
    """Write a tiny ``family`` ("llama" or "deepseek_v3") target into ``directory``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(train_tokenizer(builtin_corpus(n=600, seed=seed), VOCAB), directory)
    return directory


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
