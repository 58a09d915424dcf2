"""Bounded memory (docs/eval-drift.md, "Memory"): keyed tensors held in memory or spilled to
disk, and heap hygiene.  Knows nothing of models, regimes or metrics."""
