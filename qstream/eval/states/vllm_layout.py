"""The layout vLLM's hidden-state extraction writes (vLLM 0.32.0's
``ExampleHiddenStatesConnector._submit_async_write``,
vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py), which
speculators' offline data generation keeps as it is (docs/states.md): one safetensors file per
request holding exactly ``token_ids`` [T] (int64) and ``hidden_states`` [T, S, H] in the model's
dtype, the S captured layers in the configured order (``eagle_aux_hidden_state_layer_ids``,
hidden-states-index convention).  speculators' ``launch_vllm.py`` appends layer N (the last
layer's output before the final norm) as the last slot, which its trainer splits off as the
verifier's last hidden state.

So a file with S = num_target_layers + 1 slots gives the aux states (slots 0..S−2, concatenated
per position) and the final state (slot S−1, normalized here with the target's final norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from qstream.arch.interface import DraftConfig
from qstream.errors import QStreamError
from qstream.eval.states.captured import AUX, check_float, check_ids, check_shape
from qstream.eval.states.layers import FinalNorm

IDS, STATES = "token_ids", "hidden_states"


@dataclass(frozen=True)
class VllmSource:
    """One request's file: aux rows from slots 0..L−1, target rows from slot L, normalized."""

    where: str
    n_aux: int
    norm: FinalNorm

    def tensor_name(self, kind: str) -> str:
        return f"{STATES}[:, :{self.n_aux}]" if kind == AUX else f"{STATES}[:, {self.n_aux}]"

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(self.where, framework="pt") as f:
            states = f.get_slice(STATES)[start:stop]  # [n, L+1, H]
        if kind == AUX:
            return states[:, : self.n_aux].reshape(states.shape[0], -1).float()
        return self.norm(states[:, self.n_aux].float())


def _check_slots(path: Path, shape: list[int], T: int, config: DraftConfig) -> None:
    """hidden_states must be [T, num_target_layers + 1, target_hidden_size]."""
    L, H = config.num_target_layers, config.target_hidden_size
    if len(shape) != 3 or shape[0] != T or shape[2] != H:
        check_shape(str(path), STATES, shape, [T, L + 1, H],
                    f"T = len({IDS}); {L} target layers and the final state, "
                    f"each target_hidden_size = {H} wide")  # fmt: skip
    if shape[1] == L:
        raise QStreamError(
            f"{path}: tensor {STATES!r} has {L} layer slots {shape}, the draft's "
            f"{L} target layers but no final state; expected {[T, L + 1, H]} (speculators' "
            "launch_vllm.py appends the last layer with --include-last-layer, its default)"
        )
    check_shape(str(path), STATES, shape, [T, L + 1, H],
                f"{L} target layers (num_target_layers) and the final state")  # fmt: skip
    if H != config.hidden_size:
        raise QStreamError(
            f"{path}: the final state is {H} wide (target_hidden_size) but the lm_head "
            f"is {config.hidden_size} wide (hidden_size)"
        )


def open_vllm_file(
    path: Path, config: DraftConfig, norm: FinalNorm
) -> list[tuple[VllmSource, torch.Tensor]]:
    """Validate one request's file; its one stream as (source, token ids)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = sorted(f.keys())
            for name in names:
                if name not in (IDS, STATES):
                    raise QStreamError(
                        f"{path}: unexpected tensor {name!r}; vLLM's hidden-states "
                        f"connector writes exactly {IDS!r} and {STATES!r}"
                    )
            for name in (IDS, STATES):
                if name not in names:
                    raise QStreamError(f"{path}: missing tensor {name!r} (vLLM layout)")
            ids = check_ids(str(path), IDS, f.get_tensor(IDS), config)
            sl = f.get_slice(STATES)
            _check_slots(path, list(sl.get_shape()), ids.numel(), config)
            check_float(str(path), STATES, sl.get_dtype())
    except QStreamError:
        raise
    except Exception as exc:  # safetensors reports a bad header with its own exception types
        raise QStreamError(f"{path}: not a readable safetensors file ({exc})") from None
    return [(VllmSource(str(path), config.num_target_layers, norm), ids)]
