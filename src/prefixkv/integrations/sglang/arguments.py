"""The checks ``PrefixKVStorage`` runs on what SGLang hands it: its extra config's keys,
its host pool's flat pages, and each page call's places (targets, values, host
indices). Each raises ConfigError before anything is read, stored or written to host
memory, so a refused call changes nothing."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ...errors import ConfigError

KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                  "file_storage_path", "redis_url", "ttl", "timeout", "read_rate",
                  "retry_after", "model"})
"""extra_config keys: SGLang's for a dynamic backend (its factory and controller read
them; it adds file_storage_path when launched with --file-storage-path), then ours.
SGLang pops its own tuning keys (prefetch_threshold, tp_lcm_size, ...) before it makes
the backend."""

PageLike = tuple[torch.dtype, int]
"""A host page tensor's dtype and element count."""


def check_keys(extra: dict[Any, Any]) -> None:
    """Raise ConfigError for an extra_config key that is not in ``KEYS`` (a misspelt key
    would be ignored)."""
    unknown = sorted(str(k) for k in extra if k not in KEYS)
    if unknown:
        raise ConfigError(f"PrefixKVStorage: unknown extra_config keys {unknown}; "
                          f"known: {sorted(KEYS)}")


def page_keys(keys: Any) -> list[str]:
    """``keys`` when it is a list (or tuple) of page keys; ConfigError for anything
    else: a str (its characters would be taken as keys), a set or a generator (no order
    to match host pages with, or consumed by a first look), a number."""
    if type(keys) is not list and type(keys) is not tuple:
        raise ConfigError(f"page keys must be a list of str, got {described(keys)}")
    return keys  # type: ignore[return-value]  # (each key: ``PageStore.key``)


def flat_page_like(mem_pool_host: Any) -> PageLike:
    """The dtype and element count of ``mem_pool_host``'s flat pages. Raises ConfigError
    for a host pool that cannot hand out flat pages (``get_data_page``,
    ``get_dummy_flat_data_page``), e.g. a ``page_unified`` layout or SGLang's MXFP8 pool:
    every page call would raise in SGLang's storage threads."""
    try:
        dummy = mem_pool_host.get_dummy_flat_data_page()
        page = mem_pool_host.get_data_page(0, flat=True)
    except (ValueError, NotImplementedError, RuntimeError, IndexError) as exc:
        raise ConfigError(f"the host pool's {mem_pool_host.layout!r} layout has no flat "
                          f"pages ({exc}): use layer_first, page_first, page_first_direct "
                          "or page_head (--hicache-mem-layout)") from exc
    if (page.dtype, page.numel()) != (dummy.dtype, dummy.numel()):
        raise ConfigError(f"the host pool's {mem_pool_host.layout!r} layout has no flat "
                          f"pages: a page is {page.numel()} {page.dtype}, its dummy "
                          f"page {dummy.numel()} {dummy.dtype}")
    return dummy.dtype, dummy.numel()


def described(t: object) -> str:
    """A tensor's shape, dtype and contiguity, or the type of anything else."""
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}"
    return type(t).__name__


def is_page(t: object, like: PageLike) -> bool:
    """Whether ``t`` is a tensor of one host page: the pool's dtype, a page's elements."""
    return isinstance(t, torch.Tensor) and (t.dtype, t.numel()) == like


def page_text(like: PageLike) -> str:
    """What ``is_page`` takes, for error messages."""
    return f"tensor of {like[1]} {like[0]} (a host page)"


def check_places(pages: int, places: Any, what: str, per_page: int = 1) -> None:
    """Raise ConfigError unless ``places`` (targets, values or host indices) is a
    sequence of ``per_page`` entries for each of ``pages`` pages."""
    try:
        given = len(places)
    except TypeError:  # (None, a number, a 0-d tensor)
        raise ConfigError(f"{what} must be a sequence, got {described(places)}") from None
    if given != pages * per_page:
        raise ConfigError(f"{pages} pages but {given} {what}"
                          + (f" ({per_page} a page)" if per_page > 1 else ""))


def host_page_starts(pages: int, host_indices: Any, page_size: int, pool_size: int) -> list[int]:
    """The host pool index of each page's first token (``host_indices[i * page_size]``).
    Raises ConfigError unless there are ``page_size`` integer indices a page, each page
    lies inside the pool (a negative one would address the pool's last pages: SGLang's
    pools index from the end), each page's indices are one whole page, ``start ..
    start + page_size - 1`` with ``start`` a multiple of ``page_size`` (the pool moves a
    page from its first index: any other indices would read or write rows the call did
    not name), and no host page is named twice (the second read would overwrite the
    first)."""
    check_places(pages, host_indices, "host indices", page_size)
    if not pages:
        return []
    try:
        given = torch.as_tensor(host_indices)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"host indices must be integers: {exc}") from None
    if given.dtype == torch.bool or given.is_floating_point() or given.is_complex():
        raise ConfigError(f"host indices must be integers, got {given.dtype}")
    rows = given.reshape(pages, page_size).to("cpu", torch.int64)
    starts: list[int] = rows[:, 0].tolist()
    bad = [i for i in starts if not 0 <= i <= pool_size - page_size]
    if bad:
        raise ConfigError(f"host indices {bad[:4]} start pages outside the host pool "
                          f"(0 .. {pool_size - page_size})")
    twice = sorted(i for i, n in Counter(starts).items() if n > 1)
    if twice:
        raise ConfigError(f"host pages {twice[:4]} named twice in one call (pages that "
                          "share a host page would overwrite each other)")
    whole = ((rows - rows[:, :1] == torch.arange(page_size)).all(dim=1)
             & (rows[:, 0] % page_size == 0))
    if not bool(whole.all()):
        first = int((~whole).nonzero()[0, 0])
        raise ConfigError(f"host indices must be whole pages ({page_size} consecutive from a "
                          f"multiple of {page_size}); page {first} has "
                          f"{rows[first].tolist()[:8]}")
    return starts
