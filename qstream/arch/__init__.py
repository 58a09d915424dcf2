"""Draft architectures (docs/model.md, "Architectures"): each in a folder of its own, its
descriptor in the folder's ``__init__.py``, listed by ``registry.py``."""
