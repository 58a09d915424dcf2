"""Drift evaluation: how far a variant's drafted blocks move from the FP32 reference's
(DESIGN.md section 6).  ``metrics`` holds the pure metric functions and their accumulator."""
