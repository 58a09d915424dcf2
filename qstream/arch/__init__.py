"""Draft architectures (docs/model.md): each in a folder of its own."""
