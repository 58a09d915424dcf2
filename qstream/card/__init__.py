"""``qstream card``: model-card tables and figures generated from eval-drift results and the
checkpoint directories, so that the numbers in a card are the numbers that were measured
(docs/card.md).

>>> from qstream.card.build import write_card
>>> card, written = write_card(["results.json"], Path("CARD.md"), checkpoints=["draft-fp8"],
...                            base="draft")
"""
