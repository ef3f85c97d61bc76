"""One-line errors: an exception's first line, never an IndexError on an empty message."""

from tp_query.schema.messages import first_line


def test_first_line_of_a_multiline_message() -> None:
    assert first_line(ValueError("bad shape\n  detail\n  more")) == "bad shape"


def test_empty_message_reads_as_its_type() -> None:
    # `str(e).splitlines()[0]` raised IndexError here, turning a one-line error into a traceback
    assert first_line(OSError()) == "OSError"
    assert first_line(KeyError("")) == "''"  # KeyError quotes its argument: that is its message
    assert first_line(RuntimeError("\n\n")) == "RuntimeError"


def test_leading_blank_lines_are_skipped() -> None:
    assert first_line(RuntimeError("\n  cuda error: out of memory\nmore")) == "cuda error: out of memory"
