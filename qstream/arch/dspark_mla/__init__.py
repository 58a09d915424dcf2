"""The DSpark draft with MLA attention (Kimi-K3's): configuration, reference forward, packed
engine, Markov head and checkpoint loading (docs/model.md)."""
