"""Reading a built card in tests: its tables by key."""

from qstream.card.document import Card
from qstream.tablefit import Table


def tables(card: Card) -> dict[str, Table]:
    """Every table of the card by key."""
    return {p.key: p for s in card.sections for p in s.parts if isinstance(p, Table)}
