"""A short rendering of a wire value for an error message, made without rendering the
whole value: ``repr(value)[:80]`` costs the value's whole ``repr`` first, up to four
characters a byte of a bytes value, so one bad frame of 256 MiB cost ~1 GiB more for
its error's text (the decoder's and the replay client's errors name what they got).
"""

from __future__ import annotations

import itertools
import reprlib

__all__ = ["show"]


class _Short(reprlib.Repr):
    """reprlib's bounded repr, for what msgpack decodes to: bytes cut before their repr
    is made, maps not sorted (reprlib sorts every key first), any other type by name."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxstring = 3, 4, 3, 40

    def repr_bytes(self, x: bytes, level: int) -> str:
        text = repr(x[:self.maxstring])
        return text if len(x) <= self.maxstring else text + "..."

    def repr_dict(self, x: dict[object, object], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces) + (", ...}" if len(x) > self.maxdict else "}")

    def repr_instance(self, x: object, level: int) -> str:
        if x is None or isinstance(x, (bool, float)):
            return repr(x)
        if isinstance(x, BaseException):  # (its args may hold what it was raised for)
            return f"{type(x).__name__}({str(x)[:self.maxstring]!r})"
        return f"<{type(x).__name__}>"  # (msgpack's ExtType holds bytes of any length)


_SHORT = _Short()


def show(value: object, limit: int = 80) -> str:
    """At most ``limit`` characters rendering ``value`` (a wire value: msgpack's types),
    made in time and memory bounded whatever its size."""
    try:
        text = _SHORT.repr(value)
    except Exception:  # (a repr of wire data cannot fail today; never let it escape)
        text = f"<{type(value).__name__}>"
    return text[:limit]
