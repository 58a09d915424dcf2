"""How vLLM 0.32.0 serves the Qwen3-style DSpark draft (vllm/model_executor/models/
qwen3_dspark.py, built on qwen3_dflash.py), as data: :data:`SERVING` is its serving profile
(qstream/vllm/profiles.py; docs/vllm.md cites each rule).  None until the profile is written:
quantize and verify then treat the draft as a generic checkpoint."""

from __future__ import annotations

from typing import Any

SERVING: dict[str, Any] | None = None
