"""The one exception type for user mistakes: its message names the file, tensor or value at
fault; the CLI turns it into ``Error: <message>`` and exit status 1 (``qstream/cli.py``)."""


class QStreamError(Exception):
    """A problem with the user's input: bad file, bad tensor, bad option value."""
