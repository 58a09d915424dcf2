"""The DSpark draft with MLA attention (Kimi-K3's): configuration, reference forward, packed
engine and checkpoint loading; :mod:`.architecture` is its descriptor (docs/model.md)."""
