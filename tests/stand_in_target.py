"""A stand-in target for the captured-states tests: the synthetic draft's own layers run causally
(one per target layer, as the boot regime does) give the aux states, the last one after
``final_norm`` the target's final hidden state, the checkpoint's stand-in ``lm_head`` the
target's head; streams are sampled from that stand-in at T = 1.0, top-p 0.95 and written in
qstream's one-file layout (docs/states.md).  Real captures come from ``qstream capture``
(docs/capture.md); this keeps the tests free of a Hugging Face target.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from qstream.arch.dspark_mla.model import LM_HEAD, load_model, rms_norm
from qstream.arch.markov import sample, sampling_probs


def stand_in_target(model, ids: torch.Tensor):
    """(aux [S, T, L·H], final hidden [S, T, H]) of the draft's layers run causally over ids."""
    layers = model.causal_hidden(ids)  # [S, T, L, H]
    final = rms_norm(
        layers[:, :, -1], model.w["final_norm.weight"].float(), model.config.rms_norm_eps
    )
    return layers.flatten(2), final


def sample_streams(
    model,
    prompts: torch.Tensor,
    length: int,
    seed: int,
    temperature: float = 1.0,
    top_p: float = 0.95,
) -> torch.Tensor:
    """Extend prompts [S, P] to [S, length] by sampling the stand-in target (T, top-p)."""
    gen = torch.Generator().manual_seed(seed)
    ids = prompts
    head = model.w[LM_HEAD].float()
    while ids.shape[1] < length:
        _, final = stand_in_target(model, ids)
        probs = sampling_probs(final[:, -1] @ head.T, temperature, top_p)
        race = torch.empty(probs.shape).exponential_(generator=gen)
        ids = torch.cat((ids, sample(probs, race)[:, None]), dim=1)
    return ids


def capture_states(
    model_dir: str, output: str, n_streams: int = 4, length: int = 48, seed: int = 0
) -> None:
    model = load_model(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(vocab, (n_streams, 1), generator=gen)
    with torch.no_grad():
        ids = sample_streams(model, prompts, length, seed)
        aux, final = stand_in_target(model, ids)
    tensors = {}
    for i in range(n_streams):
        tensors[f"stream.{i}.input_ids"] = ids[i].to(torch.int64).contiguous()
        tensors[f"stream.{i}.aux_hidden_states"] = aux[i].to(torch.bfloat16).contiguous()
        tensors[f"stream.{i}.target_hidden_states"] = final[i].to(torch.bfloat16).contiguous()
    save_file(
        tensors,
        output,
        metadata={"format": "qstream.states/1", "note": "synthetic stand-in target"},
    )
