"""Tiny real-architecture Hugging Face targets for the capture tests (built by
``examples/make_tiny_target.py``: Llama and DeepSeek-V3 from a config, random weights, fixed
seed, a BPE tokenizer; nothing downloaded) and a draft config.json shaped for them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cli_helpers import load_script

from qstream.arch.dspark_mla import PRESETS

_module = load_script(Path(__file__).parent.parent / "examples" / "make_tiny_target.py")

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


# llama.cpp's GGUF tensor names for a Llama (convert_hf_to_gguf.py's tensor map)
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _rope_permute(weight, heads: int):
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (interleaved RoPE pairs), which
    transformers' GGUF loader undoes."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def peaked_qwen3_target(vocab: int = 8, hidden: int = 32):
    """A tiny in-memory transformers Qwen3 target (3 layers, seed 0) whose lm_head is scaled by
    40: peaked distributions, so acceptance and rejection both occur in speculate's tests."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def make_gguf_target(directory: Path, seed: int = 0) -> Path:
    """The tiny Llama target of :func:`make_target` written as llama.cpp's converter writes
    one (``gguf``'s GGUFWriter: F32 tensors, q/k permuted, its BPE as a gpt2 tokenizer) to
    ``directory/tiny-llama.gguf``; returns the transformers directory it was made from."""
    import gguf
    from transformers import AutoModelForCausalLM

    source = make_target(directory / "hf", "llama", seed)
    model = AutoModelForCausalLM.from_pretrained(source)
    c = model.config
    spec = json.loads((source / "tokenizer.json").read_text())
    tokens = [""] * VOCAB
    for token, i in spec["model"]["vocab"].items():
        tokens[i] = token
    special = {a["id"] for a in spec["added_tokens"]}
    writer = gguf.GGUFWriter(str(directory / "tiny-llama.gguf"), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(VOCAB)])  # 3: control
    writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(c.eos_token_id)
    writer.add_pad_token_id(c.pad_token_id)
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module in GGUF_NAMES:
            writer.add_tensor(f"{GGUF_NAMES[module]}.weight", tensor.numpy())
            continue
        layer, inner = module.split(".")[2], ".".join(module.split(".")[3:])
        if inner.split(".")[-1] in heads:
            tensor = _rope_permute(tensor, heads[inner.split(".")[-1]])
        writer.add_tensor(f"blk.{layer}.{GGUF_LAYER_NAMES[inner]}.weight", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return source
