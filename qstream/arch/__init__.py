"""Draft architectures (docs/model.md): each in a folder of its own, its descriptor in the
folder's ``__init__.py``.  :class:`FlopModel` answers a descriptor's FLOP calls from its model
module, imported when first called (torch stays out of config and tensor-table work)."""

from __future__ import annotations

import importlib
from typing import Any


class FlopModel:
    """The descriptor's FLOP calls (docs/eval-drift.md, "FLOP model"): the functions of the
    same names in the module ``model_module``."""

    model_module: str

    def context_flops(self, config: Any) -> float:
        return importlib.import_module(self.model_module).context_flops(config)

    def drafted_flops(self, config: Any, anchor: Any) -> float:
        return importlib.import_module(self.model_module).drafted_flops(config, anchor)

    def causal_flops(self, config: Any, T: int) -> float:
        return importlib.import_module(self.model_module).causal_flops(config, T)
