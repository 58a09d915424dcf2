"""Small checkpoints built on the fly for the checkpoint tests: Llama-style, DSpark-style MLA
(docs/model.md names and the tiny preset's shapes), sharded with a fused group across two
shards, and MoE-style with experts.  Weights are seeded bf16 N(0, 0.02^2) with a few outliers,
so that amaxes (and NVFP4 global scales) differ between tensors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from qstream.arch.dspark_mla import PRESETS

H, I, V = 64, 96, 128  # noqa: E741 - hidden, intermediate, vocab


def _weight(gen: torch.Generator, shape, dtype=torch.bfloat16) -> torch.Tensor:
    w = torch.randn(*shape, generator=gen) * 0.02
    if len(shape) == 2:
        w[0, 0] = 0.02 * (1 + torch.rand((), generator=gen) * 8)  # tensor-specific amax
    return w.to(dtype)


def llama_tensors(layers: int = 2, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": _weight(gen, (V, H), dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj", (H, H)),
            ("self_attn.k_proj", (32, H)),
            ("self_attn.v_proj", (32, H)),
            ("self_attn.o_proj", (H, H)),
            ("mlp.gate_proj", (I, H)),
            ("mlp.up_proj", (I, H)),
            ("mlp.down_proj", (H, I)),
        ):
            t[p + name + ".weight"] = _weight(gen, shape, dtype)
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=dtype)
    t["model.norm.weight"] = torch.ones(H, dtype=dtype)
    t["lm_head.weight"] = _weight(gen, (V, H), dtype)
    return t


def dspark_tensors(layers: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """docs/model.md's tensor table at the tiny preset (n=4, q_lora 48, kv_lora 32,
    nope 16, rope 8, v 12, markov rank 16, 5 target layers of width 64)."""
    gen = torch.Generator().manual_seed(seed)
    n, q_lora, kv_lora, nope, rope, v, r = 4, 48, 32, 16, 8, 12, 16
    t = {"context_proj.weight": _weight(gen, (H, 5 * H)), "context_norm.weight": torch.ones(H)}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in (
            ("input_layernorm", (H,)),
            ("post_attention_layernorm", (H,)),
            ("self_attn.q_a_proj", (q_lora, H)),
            ("self_attn.q_a_layernorm", (q_lora,)),
            ("self_attn.q_b_proj", (n * (nope + rope), q_lora)),
            ("self_attn.kv_a_proj_with_mqa", (kv_lora + rope, H)),
            ("self_attn.kv_a_layernorm", (kv_lora,)),
            ("self_attn.kv_b_proj", (n * (nope + v), kv_lora)),
            ("self_attn.o_proj", (H, n * v)),
            ("mlp.gate_proj", (I, H)),
            ("mlp.up_proj", (I, H)),
            ("mlp.down_proj", (H, I)),
        ):
            t[p + name + ".weight"] = _weight(gen, shape) if len(shape) == 2 else torch.ones(shape)
    t["final_norm.weight"] = torch.ones(H)
    t["markov_head.markov_w1.weight"] = _weight(gen, (V, r))
    t["markov_head.markov_w2.weight"] = _weight(gen, (V, r))
    t["confidence_head.proj.weight"] = _weight(gen, (1, H + r))
    t["confidence_head.proj.bias"] = torch.zeros(1)
    t["embed_tokens.weight"] = _weight(gen, (V, H))
    return {k: v.to(torch.bfloat16) for k, v in t.items()}


def dspark_config() -> dict:
    """The config.json of :func:`dspark_tensors`' draft, with every field vLLM sizes its
    layers from (the tiny preset with that draft's q_lora 48, v 12 and vocabulary)."""
    tiny = PRESETS["tiny"]
    return replace(tiny, q_lora_rank=48, v_head_dim=12, vocab_size=V).to_json()


# The recipe for a DSpark draft (what the published FP8 draft quantizes).
DSPARK_RECIPE = [
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.o_proj",
    "self_attn.q_b_proj",
    "context_proj",
]


def moe_tensors(experts: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """One Qwen-MoE-style layer (per-expert gate/up/down and a router ``mlp.gate``) and one
    Mixtral-style layer (block_sparse_moe.experts.<e>.w1/w2/w3)."""
    gen = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": _weight(gen, (V, H))}
    p = "model.layers.0."
    t[p + "mlp.gate.weight"] = _weight(gen, (experts, H))
    for e in range(experts):
        for name, shape in (("gate_proj", (32, H)), ("up_proj", (32, H)), ("down_proj", (H, 32))):
            t[f"{p}mlp.experts.{e}.{name}.weight"] = _weight(gen, shape)
    p = "model.layers.1."
    t[p + "block_sparse_moe.gate.weight"] = _weight(gen, (experts, H))
    for e in range(experts):
        for name, shape in (("w1", (32, H)), ("w2", (H, 32)), ("w3", (32, H))):
            t[f"{p}block_sparse_moe.experts.{e}.{name}.weight"] = _weight(gen, shape)
    t["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    t["lm_head.weight"] = _weight(gen, (V, H))
    return t


def write_checkpoint(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    config: dict | None = None,
    shards: list[list[str]] | None = None,
) -> Path:
    """Write ``tensors`` as ``model.safetensors``, or as the given shards (lists of names) with
    a ``model.safetensors.index.json``; plus config.json and a tokenizer file."""
    directory.mkdir(parents=True, exist_ok=True)
    config = config or {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": H,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "generation_config.json").write_text('{"do_sample": false}')
    if shards is None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i, names in enumerate(shards):
        shard = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(t.nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return directory


def sharded_llama(directory: Path, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """Two shards with layer 0's gate_proj in the first and its up_proj in the second."""
    tensors = llama_tensors(seed=seed)
    names = list(tensors)
    first = [n for n in names if "layers.1." not in n and "up_proj" not in n and "lm_head" not in n]
    second = [n for n in names if n not in first]
    assert "model.layers.0.mlp.gate_proj.weight" in first
    assert "model.layers.0.mlp.up_proj.weight" in second
    return write_checkpoint(directory, tensors, shards=[first, second]), tensors


def tree_digest(directory: Path) -> dict[str, str]:
    """Path -> sha256 of every file under ``directory`` (to show an input is untouched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
