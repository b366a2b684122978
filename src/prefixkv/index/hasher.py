"""The chain hash that names blocks outside the process (events, routers, stores)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import ConfigError

HashFn = Callable[[bytes], bytes]


class Hasher:
    """The chain hash: ``fn`` and the chain's ``root``. ``checked``: results of ``fn``
    are verified (a caller's callable); the built-in modes are trusted."""

    __slots__ = ("fn", "root", "checked")

    def __init__(self, fn: HashFn, root: bytes, checked: bool) -> None:
        self.fn, self.root, self.checked = fn, root, checked

    def chain(self, parent: bytes, chunks: Sequence[bytes], extras: Sequence[bytes]) -> list[bytes]:
        fn, out, h = self.fn, [], parent
        try:
            for c, e in zip(chunks, extras):
                h = fn(h + c + e)
                if self.checked and (type(h) is not bytes or not h):
                    raise ConfigError(f"the hash_mode callable returned {h!r}, not non-empty bytes")
                out.append(h)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"the hash_mode callable raised {exc!r}") from exc
        return out
