"""The chain hash that names blocks outside the process (events, routers, stores)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from ..hashing import HashFn, chain_hashes


class Hasher:
    """The chain hash: ``fn`` and the chain's ``root``. ``checked``: results of ``fn``
    are verified (a caller's callable); the built-in modes are trusted."""

    __slots__ = ("fn", "root", "checked")

    def __init__(self, fn: HashFn, root: bytes, checked: bool) -> None:
        self.fn, self.root, self.checked = fn, root, checked

    def chain(self, parent: bytes, chunks: Sequence[bytes], extras: Sequence[bytes]) -> list[bytes]:
        """``chain_hashes`` with this hash; a caller's callable that raises or returns
        anything but non-empty bytes raises ConfigError."""
        if not self.checked:
            return chain_hashes(self.fn, parent, chunks, extras)
        try:
            return chain_hashes(self._checked, parent, chunks, extras)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"the hash_mode callable raised {exc!r}") from exc

    def _checked(self, data: bytes) -> bytes:
        h = self.fn(data)
        if type(h) is not bytes or not h:
            raise ConfigError(f"the hash_mode callable returned {h!r}, not non-empty bytes")
        return h
