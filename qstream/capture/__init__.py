"""``qstream capture``: the target's hidden states, captured with transformers (docs/capture.md).
:mod:`.run` puts together :mod:`.target` (load and tap the target), :mod:`.streams` (the corpus,
or the target's own samples) and :mod:`.layout` (the files and ``capture.json``).
"""
