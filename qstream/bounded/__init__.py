"""Bounded memory (docs/eval-drift.md, "Memory"): keyed tensors held in memory or spilled to a
scratch file (store.py: ``Store``, ``Recorded``), and heap hygiene as one context manager
(heap.py: ``heap_hygiene``).  Knows nothing of models, regimes or metrics."""
