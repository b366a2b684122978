"""The bench's one error type for input it cannot run: the CLI prints its message as one
line and exits 2."""

from __future__ import annotations

from ..errors import PrefixKVError


class BenchError(PrefixKVError):
    """The bench cannot run as asked: a request larger than the pool, a workload or pool
    over the caps of ``limits``, an output folder that cannot take the report. The
    message is one line and says what to change. A ``PrefixKVError`` (a ``ValueError``),
    as every caller mistake prefixkv raises."""


def shorten(value: object, width: int = 60) -> str:
    """``repr(value)``, cut to about ``width`` characters (with the full length) so that
    an error message about a huge value stays one short line."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 10]}... ({len(text):,} characters)"
