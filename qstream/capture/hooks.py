"""Forward hooks on exactly the layers a draft reads (docs/capture.md): the outputs of the
``target_layer_ids`` decoder layers and the final norm's input and output, and nothing else
(never all N+1 hidden states).

>>> with LayerTap(layers, norm, (1, 3)) as tap:
...     model.model(input_ids=ids, attention_mask=mask, use_cache=False)
>>> tap.aux()          # [S, T, L·H] the layers' outputs, concatenated in ids order
>>> tap.final()        # [S, T, H] after the final norm (what lm_head reads)
>>> tap.pre_norm()     # [S, T, H] the last layer's output before the final norm
"""

from __future__ import annotations

from typing import Any

import torch


def _hidden(output: Any) -> torch.Tensor:
    """A decoder layer returns its hidden states, or a tuple whose first item they are."""
    return output[0] if isinstance(output, tuple) else output


class LayerTap:
    """Hooks that keep, per forward, the outputs of ``layers[j]`` for ``j in ids`` and the final
    norm's input and output, moved to the CPU as they come (so a ``--device-map`` spread over
    several GPUs gathers them in one place).  Removed on exit, even on error."""

    def __init__(self, layers: Any, norm: Any, ids: tuple[int, ...]):
        self.layers, self.norm, self.ids = layers, norm, ids
        self.outputs: dict[int, torch.Tensor] = {}
        self.norm_in: torch.Tensor | None = None
        self.norm_out: torch.Tensor | None = None
        self.handles: list[Any] = []

    def __enter__(self) -> LayerTap:
        for j in dict.fromkeys(self.ids):
            self.handles.append(self.layers[j].register_forward_hook(self._layer_hook(j)))
        self.handles.append(self.norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _layer_hook(self, j: int):
        def hook(module, args, output):  # noqa: ARG001 - torch hook signature
            self.outputs[j] = _hidden(output).detach().to("cpu")

        return hook

    def _norm_hook(self, module, args, output):  # noqa: ARG002 - torch hook signature
        self.norm_in = args[0].detach().to("cpu")
        self.norm_out = _hidden(output).detach().to("cpu")

    def aux(self) -> torch.Tensor:
        missing = [j for j in self.ids if j not in self.outputs]
        if missing:
            raise RuntimeError(f"decoder layer {missing[0]} did not run during the forward")
        return torch.cat([self.outputs[j] for j in self.ids], dim=-1)  # [S, T, L·H]

    def final(self) -> torch.Tensor:
        if self.norm_out is None:
            raise RuntimeError("the final norm did not run during the forward")
        return self.norm_out  # [S, T, H]

    def pre_norm(self) -> torch.Tensor:
        if self.norm_in is None:
            raise RuntimeError("the final norm did not run during the forward")
        return self.norm_in  # [S, T, H]

    def layer_stack(self) -> torch.Tensor:
        """``[S, T, L, H]``: the layers' outputs stacked in ids order (vLLM's layout)."""
        return torch.stack([self.outputs[j] for j in self.ids], dim=2)
