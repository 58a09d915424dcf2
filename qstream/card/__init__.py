"""``qstream card``: model-card tables and figures generated from eval-drift results and the
checkpoint directories, so that the numbers in a card are the numbers that were measured.

>>> from qstream.card import write_card
>>> card, written = write_card(["results.json"], Path("CARD.md"), checkpoints=["draft-fp8"],
...                            base="draft")
"""

from qstream.card.build import build_card, write_card
from qstream.card.results import merge_results

__all__ = ["build_card", "merge_results", "write_card"]
