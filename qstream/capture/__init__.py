"""``qstream capture``: the target's hidden states, captured with transformers (docs/capture.md).
:mod:`.run` puts together :mod:`.target` (load a local Hugging Face target, check the draft
against it), :mod:`.hooks` (tap the draft's layers and the final norm), :mod:`.streams` (the
corpus, or the target's own samples) and :mod:`.layout` (the files and ``capture.json``).
"""
