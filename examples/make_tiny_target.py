"""Write a tiny DeepSeek-V3 (or Llama) target with transformers: a real Hugging Face
architecture built from a config with random weights (fixed seed), saved with
``save_pretrained`` beside a byte-level BPE tokenizer trained on generated word problems.
Nothing is downloaded.  The capture example (capture_end_to_end.sh) and the tests use it.

    python examples/make_tiny_target.py OUTPUT_DIR [--family deepseek_v3|llama] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qstream.synth.corpus import builtin_corpus, train_tokenizer, write_tokenizer

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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--family", choices=["deepseek_v3", "llama"], default="deepseek_v3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {make_target(args.output, args.family, args.seed)}")
