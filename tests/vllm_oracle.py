"""vLLM 0.32.0's own DSpark, DFlash and EAGLE-3 drafts, loaded and run on CPU as vLLM's drafters
run them, for the vLLM lane's oracle tests (docs/vllm.md, "vLLM's own forward and sampler").
The shims are all in tests/vllm_cpu_shims.py.

>>> draft = load_vllm_draft(directory, torch.float32, embed, lm_head)  # "dflash", "eagle3": method
>>> block = draft_block(draft, aux, first_token)          # K3; qwen3_block: the Qwen3 drafts
>>> chain = eagle3_chain(draft, ids, aux, k)              # EAGLE-3: a prefill and k chained steps
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm_cpu_shims import BlockMetadata, K3Shims, Qwen3Shims

from qstream.checkpoint.files import open_checkpoint
from qstream.vllm.loader import Recorder, _init_distributed, _write_target, cpu_shims

BLOCK_SLOTS = 16  # the cache's block size


@dataclass
class VllmDraft:
    model: torch.nn.Module  # the draft class as load_dspark_model / load_dflash_model returns it
    config: object  # vLLM's VllmConfig
    dtype: torch.dtype


def load_vllm_draft(
    directory: str | Path,
    dtype: torch.dtype,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    method: str = "dspark",
) -> VllmDraft:
    """The draft through ``load_dspark_model`` (vllm/v1/worker/gpu/spec_decode/dspark/utils.py;
    ``method`` "dflash": ``load_dflash_model``, dflash/utils.py; "eagle3": ``load_eagle_model``,
    eagle/utils.py) in ``dtype``, beside a target
    whose embedding and lm_head (vLLM's own ``VocabParallelEmbedding`` and ``ParallelLMHead``)
    hold ``embed`` and ``lm_head``: a draft without its own uses the target's (docs/vllm.md)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode.dflash.utils import load_dflash_model
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    load = {"dspark": load_dspark_model, "dflash": load_dflash_model, "eagle3": load_eagle_model}

    checkpoint = open_checkpoint(directory)
    layers = int(checkpoint.config["target_num_hidden_layers"])
    speculative = {"method": method, "model": str(checkpoint.directory)}
    # vLLM reads a DSpark draft's token count from block_size; DFlash's is given (its anchor
    # slot is the bonus token), and EAGLE-3's (one a step)
    if method == "dflash":
        speculative["num_speculative_tokens"] = int(checkpoint.config["block_size"]) - 1
    if method == "eagle3":
        speculative["num_speculative_tokens"] = int(checkpoint.config["num_speculative_tokens"])
    with tempfile.TemporaryDirectory(prefix="qstream-oracle-target-") as target:
        _write_target(Path(target), checkpoint.config, layers)  # config only: its depth, widths
        with cpu_shims(Recorder()):
            args = EngineArgs(
                model=target,
                speculative_config=speculative,
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
            )
            config = args.create_engine_config()
            with set_current_vllm_config(config):
                _init_distributed()
                if not is_workspace_manager_initialized():
                    init_workspace_manager(torch.device("cpu"))
                stand_in = _stand_in_target(config, embed, lm_head, dtype)
                model = load[method](stand_in, config)
    return VllmDraft(model, config, dtype)


def _stand_in_target(config, embed: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype):
    """What ``load_dspark_model`` reads of the target: vLLM's own embedding and lm_head layers
    holding ``embed`` and ``lm_head``, as the target's loader leaves them (its
    ``process_weights_after_loading``: the CPU gemm dispatch of the lm_head)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.model.embed_tokens = VocabParallelEmbedding(*embed.shape, params_dtype=dtype)
    target.model.embed_tokens.weight.data[: embed.shape[0]].copy_(embed)  # vocab padded
    target.lm_head = ParallelLMHead(*lm_head.shape, params_dtype=dtype)
    target.lm_head.weight.data[: lm_head.shape[0]].copy_(lm_head)
    process_weights_after_loading(target, config.model_config, torch.device("cpu"))
    return target


@dataclass
class VllmBlock:
    logits: torch.Tensor  # [B, V] fp32: U_k + the Markov bias, as the drafter samples them
    tokens: torch.Tensor  # [B] the greedy draft
    confidence: torch.Tensor | None  # [B] sigmoid scores


def draft_block(draft: VllmDraft, aux: torch.Tensor, first_token: int) -> VllmBlock:
    """One request drafting at anchor p = len(aux): the context precompute over aux [p, A]
    (``combine_hidden_states``, ``precompute_and_store_context_kv``), the block forward at
    positions p..p+B-1 over ``[first_token, mask, ...]``, then
    ``DSparkSpeculator._sample_sequential`` (greedy, with the confidence head)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    model, hf = draft.model, draft.model.config
    B, p = int(hf.block_size), aux.shape[0]
    shims = K3Shims(model)
    layers = [layer.self_attn for layer in model.model.layers]
    slots = p + B
    blocks = (slots + BLOCK_SLOTS - 1) // BLOCK_SLOTS
    for attn in layers:  # each layer's latent cache [blocks, BLOCK_SLOTS, kv_lora + rope]
        attn.kv_cache = torch.zeros(blocks, BLOCK_SLOTS, attn.head_size, dtype=draft.dtype)
        shims.caches[attn.kv_cache.data_ptr()] = attn.kv_cache
    ids = torch.full((B,), int(hf.mask_token_id), dtype=torch.int64)
    ids[0] = first_token
    positions = p + torch.arange(B)
    with torch.inference_mode(), set_current_vllm_config(draft.config), shims.installed():
        context = model.combine_hidden_states(aux.to(draft.dtype))  # [p, H]
        model.precompute_and_store_context_kv(context, torch.arange(p), torch.arange(p))
        metadata = BlockMetadata(B, torch.arange(slots))
        with set_forward_context(
            {attn.layer_name: metadata for attn in layers},
            draft.config,
            slot_mapping={attn.layer_name: positions for attn in layers},
        ):
            hidden = model(ids, positions)  # [B, H]: the final-normed block states
        return _sample_sequential(model, ids, hidden)


def _sample_sequential(model, ids: torch.Tensor, hidden: torch.Tensor) -> VllmBlock:
    """``DSparkSpeculator._sample_sequential`` (vllm/v1/worker/gpu/spec_decode/dspark/
    speculator.py) itself, on a speculator holding only the buffers it reads for one request
    (the full one needs a GPU model runner); ``_sample_logits`` is the speculator's own,
    recorded on the way through."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    B = ids.shape[0]
    seen: list[torch.Tensor] = []

    class OneRequest:
        _sample_sequential = DSparkSpeculator._sample_sequential

        def _sample_logits(self, logits, idx_map, sample_pos, step):
            seen.append(logits.float().clone())
            return DSparkSpeculator._sample_logits(self, logits, idx_map, sample_pos, step)

        def _maybe_predict_acceptance(self, *args) -> None:  # no acceptance estimator
            pass

    spec = OneRequest()
    spec.__dict__.update(
        model=model,
        num_speculative_steps=B,
        _draft_topk=None,
        draft_logits=None,  # draft_sample_method=greedy
        sample_indices=torch.arange(B),
        sample_idx_mapping=torch.zeros(B, dtype=torch.int32),
        sample_pos=torch.arange(B),
        input_buffers=SimpleNamespace(input_ids=ids),
        _anchor_idx=torch.zeros(1, dtype=torch.int64),
        _step_cols=torch.arange(B, dtype=torch.int32),
        use_confidence_head=model.model.confidence_head is not None,
        draft_tokens=torch.zeros(1, B, dtype=torch.int64),
        draft_token_confidence_probs=torch.zeros(1, B, dtype=torch.float32),
    )
    spec._sample_sequential(1, hidden)
    confidence = spec.draft_token_confidence_probs[0] if spec.use_confidence_head else None
    return VllmBlock(torch.cat(seen), spec.draft_tokens[0].clone(), confidence)


# ---------------------------------------------------------------------------------------------
# The Qwen3-style drafts (vllm/model_executor/models/qwen3_dspark.py over qwen3_dflash.py)


def qwen3_block(draft: VllmDraft, aux: torch.Tensor, first_token: int) -> VllmBlock:
    """One request drafting at anchor p = len(aux), as :func:`draft_block` for K3:
    ``combine_hidden_states`` (fc, hidden_norm), ``precompute_and_store_context_kv`` (every
    layer's k/v projection, k_norm, RoPE, each layer's cache update) over aux [p, A], the model
    forward over ``[first_token, mask, ...]`` at positions p.. through vLLM's generic
    ``Attention`` layer and the CPU backend (``CPUAttentionBackendImpl``, metadata from its own
    ``CPUAttentionMetadataBuilder``, non-causal), then the drafter's sampling: DSpark's
    ``_sample_sequential`` (Markov head, confidence), or DFlash's ``sample_draft`` over the mask
    slots (``DFlashSpeculator._generate_draft``: the anchor slot is the bonus token)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    model, hf = draft.model, draft.model.config
    slots, p = int(hf.block_size), aux.shape[0]
    attns, spec, blocks = _empty_kv_caches(draft, p + slots)
    ids = torch.full((slots,), int(model.model.mask_token_id), dtype=torch.int64)
    ids[0] = first_token
    positions = p + torch.arange(slots)
    with torch.inference_mode(), set_current_vllm_config(draft.config), Qwen3Shims().installed():
        metadata = _cpu_attention_metadata(draft, spec, attns, p, slots, blocks, positions)
        context = model.combine_hidden_states(aux.to(draft.dtype))  # [p, H]
        model.precompute_and_store_context_kv(context, torch.arange(p), torch.arange(p))
        with set_forward_context(
            {attn.layer_name: metadata for attn in attns},
            draft.config,
            slot_mapping={attn.layer_name: positions for attn in attns},
        ):
            hidden = model(ids, positions)  # [slots, H]: the final-normed block states
        if hasattr(model, "markov_embed"):
            return _sample_sequential(model, ids, hidden)
        return _sample_draft(model, hidden[1:])


def _empty_kv_caches(draft, positions: int):
    """Each attention layer's zeroed KV cache for ``positions`` positions, in the CPU backend's
    layout [blocks, kv heads, block size, 2 * head]: (the layers, their spec, the block count)."""
    attns = [layer.self_attn.attn for layer in draft.model.model.layers]
    spec = attns[0].get_kv_cache_spec(draft.config)
    blocks = (positions + spec.block_size - 1) // spec.block_size
    for attn in attns:
        shape = (blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
        attn.kv_cache = torch.zeros(shape, dtype=draft.dtype)
    return attns, spec, blocks


def _cpu_attention_metadata(draft, spec, attns, p, slots, blocks, positions, causal=False):
    """What vLLM's model runner hands the CPU backend for one request of ``slots`` query tokens
    after p context tokens, all in its own blocks: ``CPUAttentionMetadataBuilder.build``
    (vllm/v1/attention/backends/cpu_attn.py) on the common metadata (non-causal: a block)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    start = torch.tensor([0, slots], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=start,
        query_start_loc_cpu=start,
        seq_lens=torch.tensor([p + slots], dtype=torch.int32),
        num_reqs=1,
        num_actual_tokens=slots,
        max_query_len=slots,
        max_seq_len=p + slots,
        block_table_tensor=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=positions,
        causal=causal,
    )
    names = [attn.layer_name for attn in attns]
    builder = CPUAttentionMetadataBuilder(spec, names, draft.config, torch.device("cpu"))
    return builder.build(0, common)


def _sample_draft(model, hidden: torch.Tensor) -> VllmBlock:
    """``DraftModelSpeculator.sample_draft`` (vllm/v1/worker/gpu/spec_decode/speculator.py)
    itself, greedy (no draft logits), over the mask slots' states (EAGLE-3: one step's):
    ``compute_draft_logits`` (the model's ``compute_logits``) and argmax."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    seen: list[torch.Tensor] = []

    class OneRequest:
        sample_draft = DraftModelSpeculator.sample_draft
        use_local_argmax_reduction = False

        def compute_draft_logits(self, hidden_states, spec_step_idx):
            logits = DraftModelSpeculator.compute_draft_logits(self, hidden_states, spec_step_idx)
            seen.append(logits.float().clone())
            return logits

        def _maybe_predict_acceptance(self, *args) -> None:  # no acceptance estimator
            pass

    spec = OneRequest()
    spec.model = model
    B = hidden.shape[0]
    none = torch.zeros(B, dtype=torch.int64)
    tokens = spec.sample_draft(hidden, none, none, none, none, none, None)
    return VllmBlock(seen[0], tokens.clone(), None)


# ---------------------------------------------------------------------------------------------
# The EAGLE-3 draft (vllm/model_executor/models/llama_eagle3.py, qwen3_eagle3.py)


@dataclass
class VllmChain:
    hidden: torch.Tensor  # [P, H] the prefill's states as handed on (LlamaModel's aux_output)
    logits: torch.Tensor  # [P, V] fp32 compute_logits at every prefill position
    tokens: torch.Tensor  # [k] the greedy chain (target ids)
    chain_logits: torch.Tensor  # [k, V] fp32 the logits each token was drawn from
    chain_hidden: torch.Tensor  # [k, H] the state each step hands on


def eagle3_chain(draft: VllmDraft, ids: torch.Tensor, aux: torch.Tensor, k: int) -> VllmChain:
    """One request of P = len(aux) target positions drafting k tokens, as
    ``TargetDependentARSpeculator.propose`` (vllm/v1/worker/gpu/spec_decode/target_dependent_ar/
    speculator.py) runs an EAGLE-3 draft: ``combine_hidden_states`` over aux [P, A], then
    ``_prefill``: the model over ids [P] (the target's tokens shifted by one, the last the
    token the target sampled) at positions 0..P-1, causal through the CPU backend, and
    ``sample_draft`` at the last position; then each of ``_generate_draft``'s steps: the model
    over the token just drawn and the state its step handed on (``update_draft_inputs``) at the
    next position, attending to the request's cache, and ``sample_draft`` again."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    model, P = draft.model, aux.shape[0]
    attns, spec, blocks = _empty_kv_caches(draft, P + k)

    def forward(input_ids, positions, hidden):  # -> (final-normed, handed-on) states
        context = int(positions[0])  # the request's tokens before these, all cached
        metadata = _cpu_attention_metadata(
            draft, spec, attns, context, len(positions), blocks, positions, causal=True
        )
        with set_forward_context(
            {attn.layer_name: metadata for attn in attns},
            draft.config,
            slot_mapping={attn.layer_name: positions for attn in attns},
        ):
            return model(input_ids, positions, hidden)

    with torch.inference_mode(), set_current_vllm_config(draft.config):
        normed, handed = forward(
            ids, torch.arange(P), model.combine_hidden_states(aux.to(draft.dtype))
        )
        logits = model.compute_logits(normed).float()
        row, state, tokens, chain_logits, states = normed[-1:], handed[-1:], [], [], []
        for j in range(k):
            drawn = _sample_draft(model, row)
            tokens.append(drawn.tokens)
            chain_logits.append(drawn.logits)
            states.append(state)
            if j < k - 1:
                row, state = forward(drawn.tokens, torch.tensor([P + j]), state)
    return VllmChain(handed.float(), logits, torch.cat(tokens), torch.cat(chain_logits),
                     torch.cat(states).float())  # fmt: skip
