"""How an exception reads in a one-line error (the CLI's contract: one line, exit code 2)."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when the message is empty (an empty
    message has no first line to take)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class TpQueryError(ValueError):
    """Every refusal tp-query gives (bad input, data it will not read): one line for the user. The CLI exits 2 on
    it; an API caller can catch this one class."""

