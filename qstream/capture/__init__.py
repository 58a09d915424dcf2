"""``qstream capture``: the target's hidden states, captured with transformers (docs/capture.md)."""
