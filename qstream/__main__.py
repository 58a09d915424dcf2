"""``python -m qstream``: the ``qstream`` command (qstream/entry.py)."""

from qstream.entry import main

main()
