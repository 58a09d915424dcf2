"""Speculative decoding with the target in the loop (docs/speculate.md)."""
