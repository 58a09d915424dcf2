"""``qstream card``: model-card tables and figures generated from eval-drift results and the
checkpoint directories, so that the numbers in a card are the numbers that were measured
(docs/card.md); :func:`qstream.card.build.write_card` is the entry point.
"""
