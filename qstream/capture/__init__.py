"""``qstream capture``: the target's hidden states, captured with transformers (docs/capture.md).
:mod:`.run` (the streams and the run) puts together :mod:`.target` (load and tap the target) and
:mod:`.layout` (the files and ``capture.json``).
"""
