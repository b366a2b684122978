"""The bench's one error type for input it cannot run: the CLI prints its message as one
line and exits 2."""

from __future__ import annotations

import math

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


def check_int(name: str, value: object, low: int = 1, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]`` (``high`` None:
    unbounded); BenchError naming ``name`` and the range otherwise."""
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"in {low}..{high:,}" if high is not None else f">= {low}"
        raise BenchError(f"{name} must be an int {bound}, got {shorten(value)}")
    return value


def check_real(name: str, value: object, low: float) -> float:
    """``value`` if it is a finite int or float (not a bool) >= ``low``; BenchError
    naming ``name`` otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            math.isfinite(value) and value >= low):
        raise BenchError(f"{name} must be a finite number >= {low:g}, got {shorten(value)}")
    return float(value)


def check_sizes(config: object) -> None:
    """Every field of a dataclass of sizes (an end-to-end run's config) an int >= 1;
    ``num_blocks`` and ``block_size`` within ``limits``' caps. Raises BenchError naming
    the field."""
    from dataclasses import fields

    from .limits import MAX_BLOCK_SIZE, MAX_POOL_BLOCKS

    caps = {"num_blocks": MAX_POOL_BLOCKS, "block_size": MAX_BLOCK_SIZE}
    for field in fields(config):  # type: ignore[arg-type]
        check_int(f"{type(config).__name__}.{field.name}", getattr(config, field.name), 1,
                  caps.get(field.name))
