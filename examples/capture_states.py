"""Write a captured-states file for ``qstream eval-drift --states`` (format: docs/states.md).

A real file comes from the target itself: per token stream, the token ids, the hidden states
of the ``target_layer_ids`` layers concatenated per position (``aux_hidden_states``), and the
post-final-norm hidden state (``target_hidden_states``, whose product with ``lm_head`` is the
target's logits).  vLLM can export hidden states of chosen layers during generation (its
EAGLE-3 / hidden-state extraction paths hand ``aux_hidden_states`` of the draft's
``target_layer_ids`` to the drafter), and draft-training pipelines already stream the same
tensors; save them per stream with the names below.  For the acceptance against the target
to be exact, the streams should be the target's own samples at the temperature and top-p the
evaluation uses (docs/states.md).

Here, with no target at hand, a synthetic draft stands in (as ``qstream synth`` and the boot
regime do): its layers run causally are the "target", its per-layer outputs the aux states,
its last layer's output after ``final_norm`` the target's final hidden state, the checkpoint's
stand-in ``lm_head`` the target's head; the streams are sampled from that stand-in target.

    python examples/capture_states.py --model DRAFT_DIR --output captured.safetensors
    qstream eval-drift --model DRAFT_DIR --states captured.safetensors --acceptance
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import save_file

from qstream.model.dspark import LM_HEAD, rms_norm
from qstream.model.load import load_model
from qstream.model.markov import sample, sampling_probs


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="synthetic draft (qstream synth)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    capture_states(args.model, args.output, args.streams, args.length, args.seed)


if __name__ == "__main__":
    main()
