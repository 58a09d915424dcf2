"""Drift evaluation: how far a variant's drafted blocks move from the FP32 reference's
(docs/eval-drift.md).  ``metrics`` holds the pure metric functions and their accumulator."""
