"""User-facing errors: one line naming the file and the field, exit code 2, no traceback."""
from __future__ import annotations


class ColiError(Exception):
    """An error caused by the user's input (a file, a flag, a prompt).

    ``str(err)`` is the whole message, one line, e.g.
    ``"model.gguf: header: tensor_count 9223372036854775808 exceeds what the file can hold"``.
    The CLI prints ``coli: <message>`` on stderr and exits with code 2.
    """

    exit_code = 2
