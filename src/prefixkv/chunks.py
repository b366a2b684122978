"""``Chunks``: a prompt's full blocks' token bytes, cut from its bytes only when read.

An admission of token ids cuts the prompt's bytes into one ``bytes`` a full block (each
block's key). A miss reads few of them: the claim probes the first block and stops, and
the store records the blocks after the first as one run whose content is the prompt's
bytes in one piece (``Run.data``). Cutting all of them (2,048 objects for 32k tokens)
was a third of a 32k miss's encoding. ``Chunks`` holds the bytes and cuts a block's
chunk when it is indexed, and the chunks of a whole range, in C 64 at a time, as they
are iterated; a slice is a ``Chunks`` again (no copy), and ``data()`` gives the range's
bytes in one piece without cutting or joining.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from itertools import chain
from typing import overload

from .hashing import _GROUP, _splitter


class Chunks(Sequence[bytes]):
    """``count`` chunks of ``step`` bytes of ``buf``, from chunk ``start`` on: chunk i is
    ``buf[(start + i) * step:(start + i + 1) * step]``. Immutable; ``buf`` is never
    written (a prompt's token bytes)."""

    __slots__ = ("buf", "step", "start", "n")

    def __init__(self, buf: bytes, step: int, start: int, count: int) -> None:
        self.buf, self.step, self.start, self.n = buf, step, start, count

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Chunks: ...

    def __getitem__(self, i: int | slice) -> bytes | Chunks:
        if isinstance(i, slice):
            lo, hi, stride = i.indices(self.n)
            if stride != 1:
                return Chunks(b"".join(list(self)[i]), self.step, 0, len(range(lo, hi, stride)))
            return Chunks(self.buf, self.step, self.start + lo, max(hi - lo, 0))
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("chunk index out of range")
        off = (self.start + i) * self.step
        return self.buf[off:off + self.step]

    def __iter__(self) -> Iterator[bytes]:
        # (in C: the first chunk alone, as a miss's claim reads it and stops, then 64 a
        # call of a cached ``struct.Struct``, one call as it is reached)
        step, buf = self.step, self.buf
        if not self.n:
            return iter(())
        whole, rest = divmod(self.n - 1, _GROUP)
        lo, width = self.start * step, step * _GROUP
        mid = lo + step + whole * width
        parts = chain(((buf[lo:lo + step],),), map(partial(_splitter(step, _GROUP).unpack_from,
                                                            buf), range(lo + step, mid, width)))
        if rest:
            parts = chain(parts, map(partial(_splitter(step, rest).unpack_from, buf), (mid,)))
        return chain.from_iterable(parts)

    def data(self) -> bytes:
        """The chunks' bytes in one piece (``b"".join(self)``): ``buf`` itself when the
        chunks span all of it."""
        lo, hi = self.start * self.step, (self.start + self.n) * self.step
        return self.buf if lo == 0 and hi == len(self.buf) else self.buf[lo:hi]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Chunks):
            return self.step == other.step and self.data() == other.data()
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Chunks({self.n} of {self.step} bytes from chunk {self.start})"


def joined(chunks: Sequence[bytes]) -> bytes:
    """``b"".join(chunks)``, without cutting and joining when they are a ``Chunks``."""
    return chunks.data() if type(chunks) is Chunks else b"".join(chunks)
